"""Softmax attention for families: heads split and merged, grouped-query attention, the
fused forward that returns its logsumexp with the backward that takes it, and the
attention parts a block is composed of (``SelfAttention``, ``QKNorm``, ``OutputGate``,
``ChunkedMask``).

Backward never runs attention's forward again: it needs q, k, v, the output and the
logsumexp, all saved by forward (``attention_fwd`` / ``attention_bwd`` ops). Grouped-query
attention (fewer key/value heads than query heads) passes the grouped heads to the ops,
whose contract takes them (docs/kernel_registry.md): a variant that cannot run them
grouped repeats each key/value head for its query heads itself and sums their gradients,
one that can (cuDNN's) makes no repeated copies.

The mask is causal, and a sliding ``window`` (HF's ``sliding_window``) keeps only the
``window`` latest keys of each query, itself included (key ``j`` of query ``i`` where
``i - window < j <= i``). The ops take it as ``window=`` only when it cuts something
(``window < seq``): at or past the sequence length a window is plain causal attention,
and a kernel variant written before the keyword need not take it.

A **mask** part (``SelfAttention.mask``) leaves out any further pairs, the same for every
sequence: an object with ``keep(config, seq_len, device)`` (a (seq, seq) bool tensor, True
where query ``i`` sees key ``j``, every query keeping at least its own position; None
where it cuts nothing at this length) and ``pairs(config, seq_len)`` (how many (query,
key) pairs stay, causal and window included, which prices the attention). The ops take it
as ``mask=`` only where it cuts something. ``ChunkedMask`` is Llama 4's chunked attention;
a family writes its own the same way (a prefix of bidirectional tokens, say, with
``causal`` kept for the rest).

**Segments** (``kit.Segments``, per batch: ``Env.segments``) say which sequence each
token belongs to and its position: a padded batch (padding belongs to none) or a packed
one (several sequences a row, ``cu_seqlens``). ``SelfAttention`` rotates each token at
its own position and passes the ids to the ops as ``segments=``: a query sees only keys
of its own sequence (causal, window and mask as above), a padded query gives zero output
and zero gradients. The ops take the keyword only where a batch has segments.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from dataflow_training.kit import decoder_reference, rotary
from dataflow_training.kit.linear import Linear, projections_backward
from dataflow_training.kit.norms import Norm
from dataflow_training.kit.parts import as_is
from dataflow_training.step.family import TensorSpec

Tensors = dict[str, torch.Tensor]


def split_heads(t: torch.Tensor, heads: int) -> torch.Tensor:
    """(batch, seq, heads * head_dim) -> a (batch, heads, seq, head_dim) view."""
    batch, seq, width = t.shape
    return t.view(batch, seq, heads, width // heads).transpose(1, 2)


def merge_heads(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, head_dim) -> (batch, seq, heads * head_dim)."""
    batch, heads, seq, head_dim = t.shape
    return t.transpose(1, 2).reshape(batch, seq, heads * head_dim)


def _check_groups(q: torch.Tensor, k: torch.Tensor) -> None:
    if q.shape[1] % k.shape[1]:
        raise ValueError(
            f"attention: {q.shape[1]} query heads are not a multiple of {k.shape[1]} key heads"
        )


def _window(window: int | None, seq: int) -> dict[str, int]:
    """The ops' ``window`` keyword, only where it cuts something (module docstring)."""
    return {"window": window} if window is not None and window < seq else {}


def _cuts(
    window: int | None, mask: torch.Tensor | None, seq: int, segments: Any = None
) -> dict[str, Any]:
    """The ops' ``window``, ``mask`` and ``segments`` keywords, each only where given (the
    window: where it cuts something); ``segments`` a ``Segments`` or its ids tensor."""
    cuts = _window(window, seq) | ({} if mask is None else {"mask": mask})
    if segments is not None:
        cuts["segments"] = segments if isinstance(segments, torch.Tensor) else segments.ids
    return cuts


def attention_forward(
    ops: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    segments: Any = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (batch, heads, seq, dim); k, v (batch, kv_heads, seq, dim) -> (out like q, lse).
    ``mask``: (seq, seq) bool, the pairs kept; ``segments``: a ``Segments`` (module doc)."""
    _check_groups(q, k)
    cuts = _cuts(window, mask, q.shape[2], segments)
    return ops["attention_fwd"](q, k, v, causal=causal, scale=scale, **cuts)


def attention_backward(
    ops: Any,
    d_out: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    segments: Any = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv), dk and dv with k's and v's head counts."""
    _check_groups(q, k)
    cuts = _cuts(window, mask, q.shape[2], segments)
    return ops["attention_bwd"](d_out, q, k, v, out, lse, causal=causal, scale=scale, **cuts)


def attention_flops(
    batch: int, seq_len: int, q_width: int, window: int | None, pairs: int | None = None
) -> float:
    """FLOPs of ``q k^T`` and ``p v`` over the (query, key) pairs the mask keeps: causal,
    half of ``seq_len^2`` per sequence; with a window ``w < seq_len``, ``seq_len * w -
    w^2 / 2`` (the band below the diagonal), so a window is priced by its width; with
    ``pairs`` (a mask part's count of the pairs kept, window included), those."""
    if pairs is not None:
        return 4 * batch * q_width * pairs
    if window is None or window >= seq_len:
        return 2 * batch * seq_len * seq_len * q_width  # causal: half
    return 4 * batch * q_width * (seq_len * window - window * window / 2)


@dataclasses.dataclass(frozen=True)
class ChunkedMask:
    """Chunked attention, as a mask part of an attention (Llama 4's ``attention_chunk_size``
    layers): the sequence is cut into chunks of the config field ``field``'s tokens and a
    query sees the keys of its own chunk alone, causally. A field whose value is None, or a
    chunk at or past the sequence length, cuts nothing: plain causal attention."""

    field: str = "attention_chunk_size"

    def chunk(self, config: Any, seq_len: int) -> int | None:
        """The chunk's tokens where it cuts the sequence, else None."""
        size = getattr(config, self.field)
        if size is not None and (isinstance(size, bool) or not isinstance(size, int) or size < 1):
            raise ValueError(f"{self.field} = {size!r}: a chunk is a whole number of tokens >= 1")
        return size if size is not None and size < seq_len else None

    def keep(self, config: Any, seq_len: int, device: Any) -> torch.Tensor | None:
        size = self.chunk(config, seq_len)
        if size is None:
            return None
        position = torch.arange(seq_len, device=device) // size
        return position[:, None] == position[None, :]

    def pairs(self, config: Any, seq_len: int) -> int:
        size = self.chunk(config, seq_len) or seq_len
        whole, rest = divmod(seq_len, size)
        return whole * size * (size + 1) // 2 + rest * (rest + 1) // 2


def _positions(segments: Any) -> torch.Tensor | None:
    """The tokens' rotary positions of a ``Segments``, or None (0 .. seq - 1 per row)."""
    return None if segments is None else segments.positions


# -- the parts ---------------------------------------------------------------------------

Q_PROJ = Linear("self_attn.q_proj.weight")
K_PROJ = Linear("self_attn.k_proj.weight")
V_PROJ = Linear("self_attn.v_proj.weight")
O_PROJ = Linear("self_attn.o_proj.weight")
_PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj")


def _per_head(config: Any, t: torch.Tensor) -> torch.Tensor:
    """(batch, seq, heads * head_dim) -> a (batch, seq, heads, head_dim) view."""
    batch, seq, width = t.shape
    return t.view(batch, seq, width // config.head_dim, config.head_dim)


@dataclasses.dataclass(frozen=True)
class QKNorm:
    """A norm of the queries and keys before the rotation, as a part of an attention.
    ``scope``: ``"head"`` normalises each head with one ``head_dim`` weight shared by the
    heads (Qwen 3), ``"projection"`` the whole q and k projections, one weight per channel
    (OLMoE). Parameters ``self_attn.q_norm.weight`` and ``self_attn.k_norm.weight`` (HF's
    names); it saves nothing (its input is the saved projection, its statistics are
    made again in backward)."""

    scope: str = "head"
    norm: Norm = Norm()

    def __post_init__(self) -> None:
        if self.scope not in ("head", "projection"):
            raise ValueError(f"QKNorm.scope must be 'head' or 'projection', got {self.scope!r}")

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        per_head = self.scope == "head"
        q = config.head_dim if per_head else config.q_width
        kv = config.head_dim if per_head else config.kv_width
        return (*self.norm.params("self_attn.q_norm", q), *self.norm.params("self_attn.k_norm", kv))

    def forward(
        self, config: Any, params: Tensors, q: torch.Tensor, k: torch.Tensor, ops: Any
    ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """(normed q, normed k, their statistics) of the projections (batch, seq, width)."""
        q_norm, k_norm = (
            self.norm.op(config, "self_attn.q_norm"),
            self.norm.op(config, "self_attn.k_norm"),
        )
        per_head = self.scope == "head"
        q_in, k_in = (_per_head(config, t) if per_head else t for t in (q, k))
        q, q_stats = q_norm.forward(ops, params, q_in)
        k, k_stats = k_norm.forward(ops, params, k_in)
        return q, k, (q_stats, k_stats)

    def backward(
        self, config: Any, params: Tensors, saved: Tensors, stats: tuple, dq, dk, ops: Any
    ) -> tuple[torch.Tensor, torch.Tensor, Tensors]:
        """(dq, dk) of the projections (batch, seq, width) from those of the normed heads
        (batch, seq, heads, head_dim), and the norms' gradients."""
        per_head = self.scope == "head"
        grads: dict[str, torch.Tensor] = {}
        out = []
        for name, stat, d in (("q", stats[0], dq), ("k", stats[1], dk)):
            norm = self.norm.op(config, f"self_attn.{name}_norm")
            x = _per_head(config, saved[name]) if per_head else saved[name]
            d_in, g = norm.backward(ops, params, x, stat, d if per_head else d.flatten(2))
            grads.update(g)
            out.append(d_in.flatten(2))
        return out[0], out[1], grads


@dataclasses.dataclass(frozen=True)
class OutputGate:
    """A sigmoid gate on the attention's output, as a part of an attention (Qwen3-Next's
    and Qwen 3.5's full attention): ``q_proj`` makes each head's query and then its gate
    (``head_dim`` each, so it is twice as wide), and ``o_proj`` takes ``attn *
    sigmoid(gate)``. Its parameters are ``q_proj``'s second half; it saves nothing of its
    own (the gate is in the saved ``q``, the ungated output is ``attn``, which the
    attention's backward needs); its work is elementwise."""

    def split(self, config: Any, q: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(queries, gates), each (batch, seq, heads * head_dim), of the projection ``q``."""
        batch, seq, _ = q.shape
        heads = q.view(batch, seq, config.num_attention_heads, 2 * config.head_dim)
        query, gate = heads.chunk(2, dim=-1)
        return query.reshape(batch, seq, config.q_width), gate.reshape(batch, seq, config.q_width)

    def join(self, config: Any, d_query: torch.Tensor, d_gate: torch.Tensor) -> torch.Tensor:
        """The gradient of the projection ``q`` from those of its queries and gates."""
        batch, seq, _ = d_query.shape
        shape = (batch, seq, config.num_attention_heads, config.head_dim)
        return torch.cat((d_query.view(shape), d_gate.view(shape)), dim=-1).flatten(2)

    def forward(self, attn: torch.Tensor, gate: torch.Tensor) -> torch.Tensor:
        return attn * torch.sigmoid(gate)

    def backward(
        self, attn: torch.Tensor, gate: torch.Tensor, d_out: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """(d attn, d gate) of ``attn * sigmoid(gate)``."""
        sig = torch.sigmoid(gate)
        d_attn = d_out * sig
        return d_attn, d_attn * attn * (1 - sig)


@dataclasses.dataclass(frozen=True)
class SelfAttention:
    """Causal grouped-query self-attention, as a part of a block: ``o_proj(attention(
    rope(qn(q_proj(h))), rope(kn(k_proj(h))), v_proj(h)))`` scaled by ``1 / sqrt(head_dim)``,
    no biases. Its parts: ``qk_norm`` (None: none), ``positions`` (``Rope``), and
    ``window``, the config field holding a sliding window (None: full causal; a field
    whose value is None: full causal too).

    Parameters (HF's names and order): ``self_attn.{q,k,v,o}_proj.weight``, stored
    ``(out, in)``, then the q/k norm's. Saved, per token: ``q`` (heads * head_dim), ``k``
    and ``v`` (kv_heads * head_dim each), the projections as their matmuls leave them
    (before the q/k norm and the rotation); ``attn`` (heads * head_dim), ``o_proj``'s
    input; ``lse`` (heads, float32), the logsumexp. Backward rebuilds the norms and
    rotations from ``q`` and ``k`` and calls ``attention_bwd``; no projection or attention
    forward runs again. Cost: the projections' matmuls and ``attention_flops`` of the
    window (or of the mask's pairs). With a ``gate`` (``OutputGate``), ``q`` holds each
    head's query and gate and ``o_proj`` takes the gated output. With a ``mask`` (a mask
    part, e.g. ``ChunkedMask``; module doc), only the pairs it keeps are attended."""

    qk_norm: QKNorm | None = None
    positions: rotary.Rope = rotary.Rope()
    window: str | None = None
    gate: OutputGate | None = None
    mask: Any = None
    #: the reference module's name in a block (HF's)
    module = "self_attn"

    @property
    def ops(self) -> tuple[str, ...]:
        norm = self.qk_norm.norm.ops if self.qk_norm is not None else ()
        return ("attention_fwd", "attention_bwd", *norm)

    def window_size(self, config: Any) -> int | None:
        """The tokens each query sees counting itself, or None (causal, unbounded)."""
        return None if self.window is None else getattr(config, self.window)

    def mask_of(self, config: Any, seq_len: int, device: Any) -> torch.Tensor | None:
        """The mask part's (seq, seq) pairs kept, or None (no part, or it cuts nothing)."""
        return None if self.mask is None else self.mask.keep(config, seq_len, device)

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        n, q, kv = config.hidden_size, config.q_width, config.kv_width
        projected = q if self.gate is None else 2 * q
        shapes = {"q_proj": (projected, n), "k_proj": (kv, n), "v_proj": (kv, n), "o_proj": (n, q)}
        qk_norm = self.qk_norm.params(config) if self.qk_norm is not None else ()
        return (
            *(TensorSpec(f"self_attn.{p}.weight", shapes[p]) for p in _PROJECTIONS),
            *qk_norm,
        )

    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        q, kv = config.q_width, config.kv_width
        return (
            TensorSpec("q", (batch, seq_len, q if self.gate is None else 2 * q)),
            TensorSpec("k", (batch, seq_len, kv)),
            TensorSpec("v", (batch, seq_len, kv)),
            TensorSpec("attn", (batch, seq_len, q)),
            TensorSpec("lse", (batch, config.num_attention_heads, seq_len), dtype="float32"),
        )

    def hf_rules(self, config: Any, prefix: str) -> list[Any]:
        return as_is(self.params(config), prefix)

    def reference_args(self, config: Any) -> dict[str, Any]:
        """The settings ``decoder_reference.Attention`` takes, as plain values."""
        args = {
            "qk_norm": None if self.qk_norm is None else self.qk_norm.scope,
            "window": self.window_size(config),
            **self.positions.reference_args(config),
        }
        if self.qk_norm is not None and self.qk_norm.norm.offset:
            args["qk_norm_offset"] = self.qk_norm.norm.offset
        if self.mask is not None:  # the pairs kept, made on the CPU for any length
            args["mask"] = lambda seq: self.mask_of(config, seq, "cpu")
        return args | ({"gated": True} if self.gate is not None else {})

    def reference(self, config: Any) -> Any:
        """``decoder_reference.Attention`` with this part's settings."""

        return decoder_reference.Attention(config, **self.reference_args(config))

    # -- math ----------------------------------------------------------------------------
    def _heads(
        self,
        config: Any,
        params: Tensors,
        q: torch.Tensor,
        k: torch.Tensor,
        ops: Any,
        segments: Any = None,
    ) -> tuple[torch.Tensor, torch.Tensor, tuple]:
        """Query and key heads (batch, heads, seq, head_dim) as attention takes them, from
        the projections: normed, then rotated (at the segments' positions where given);
        and the norms' statistics."""
        stats: tuple = ()
        if self.gate is not None:
            q, _ = self.gate.split(config, q)
        if self.qk_norm is not None:
            q, k, stats = self.qk_norm.forward(config, params, q, k, ops)
        q_heads, k_heads = _per_head(config, q.flatten(2)), _per_head(config, k.flatten(2))
        cos, sin = self.positions.tables(config, q_heads, _positions(segments))
        rotated = (rotary.apply(t.transpose(1, 2), cos, sin) for t in (q_heads, k_heads))
        return *rotated, stats

    def project(self, config: Any, params: Tensors, h: torch.Tensor, ops: Any) -> Tensors:
        """The projections of the normed input ``h``: ``q``, ``k``, ``v`` (saved as they are)."""
        # three calls, not a generator over h: deleting a variable a closure captured is a
        # bytecode (DELETE_DEREF) torch.compile cannot trace, and it skips the rest of the block
        return {
            "q": Q_PROJ.forward(ops, params, h),
            "k": K_PROJ.forward(ops, params, h),
            "v": V_PROJ.forward(ops, params, h),
        }

    def attend(
        self, config: Any, params: Tensors, projected: Tensors, ops: Any, segments: Any = None
    ) -> tuple[torch.Tensor, Tensors]:
        """(the attention's output after ``o_proj``, what it saves beside the projections:
        ``attn`` and ``lse``); ``segments``: the batch's ``Segments`` or None."""
        q_heads, k_heads, _ = self._heads(
            config, params, projected["q"], projected["k"], ops, segments
        )
        v_heads = split_heads(projected["v"], config.num_key_value_heads)
        window, seq = self.window_size(config), q_heads.shape[2]
        mask = self.mask_of(config, seq, q_heads.device)
        out, lse = attention_forward(
            ops, q_heads, k_heads, v_heads, window=window, mask=mask, segments=segments
        )
        del q_heads, k_heads, v_heads
        attn = merge_heads(out)
        if self.gate is None:
            return O_PROJ.forward(ops, params, attn), {"attn": attn, "lse": lse}
        gated = self.gate.forward(attn, self.gate.split(config, projected["q"])[1])
        return O_PROJ.forward(ops, params, gated), {"attn": attn, "lse": lse}

    def backward(
        self,
        config: Any,
        params: Tensors,
        x: torch.Tensor,
        saved: Tensors,
        d_out: torch.Tensor,
        grads: dict[str, torch.Tensor],
        ops: Any,
        segments: Any = None,
    ) -> tuple[torch.Tensor, ...]:
        """The gradients of the projections (``project``'s outputs, in its order) from that
        of the output; ``x`` (the block input) gives the rotary tables' length, device and
        dtype; ``segments`` as ``attend`` took them. The parameters' gradients but the
        projections' go into ``grads``."""
        if self.gate is None:
            d_attn, g = O_PROJ.backward(ops, params, saved["attn"], d_out)
        else:  # o_proj's input made again from the saved output and gate
            gate = self.gate.split(config, saved["q"])[1]
            d_gated, g = O_PROJ.backward(ops, params, self.gate.forward(saved["attn"], gate), d_out)
            d_attn, d_gate = self.gate.backward(saved["attn"], gate, d_gated)
            del d_gated, gate
        grads.update(g)
        heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
        q_heads, k_heads, qk_stats = self._heads(
            config, params, saved["q"], saved["k"], ops, segments
        )
        dq, dk, dv = attention_backward(
            ops,
            split_heads(d_attn, heads),
            q_heads,
            k_heads,
            split_heads(saved["v"], kv_heads),
            split_heads(saved["attn"], heads),
            saved["lse"],
            window=self.window_size(config),
            mask=self.mask_of(config, q_heads.shape[2], q_heads.device),
            segments=segments,
        )
        del d_attn, q_heads, k_heads
        cos, sin = self.positions.tables(config, x, _positions(segments))
        dq, dk = (rotary.backward(d, cos, sin).transpose(1, 2).contiguous() for d in (dq, dk))
        if self.qk_norm is None:
            dq, dk = dq.flatten(2), dk.flatten(2)
        else:  # back through the q/k norms, from the saved projections
            queries = saved if self.gate is None else self._queries(config, saved)
            dq, dk, g = self.qk_norm.backward(config, params, queries, qk_stats, dq, dk, ops)
            grads.update(g)
        if self.gate is not None:
            dq = self.gate.join(config, dq, d_gate)
        return dq, dk, merge_heads(dv)

    def _queries(self, config: Any, saved: Tensors) -> Tensors:
        """``saved`` with ``q`` its queries alone (the q/k norm's input)."""
        return {"q": self.gate.split(config, saved["q"])[0], "k": saved["k"]}

    def project_backward(
        self,
        config: Any,
        params: Tensors,
        h: torch.Tensor,
        d_projected: tuple[torch.Tensor, ...],
        grads: dict[str, torch.Tensor],
        ops: Any,
    ) -> torch.Tensor:
        """``dh`` from the projections' gradients; theirs go into ``grads``."""
        return projections_backward(ops, params, h, (Q_PROJ, K_PROJ, V_PROJ), d_projected, grads)

    def flops(self, config: Any, batch: int, seq_len: int) -> tuple[int, float]:
        """(the projections' FLOPs, the attention's) of one forward."""
        tokens, n = batch * seq_len, config.hidden_size
        q, kv = config.q_width, config.kv_width
        window = self.window_size(config)
        projections = 2 * tokens * n * (2 * q + 2 * kv)
        if self.gate is not None:  # q_proj's gate half
            projections += 2 * tokens * n * q
        pairs = None if self.mask is None else self.mask.pairs(config, seq_len)
        return projections, attention_flops(batch, seq_len, q, window, pairs)
