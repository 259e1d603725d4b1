"""The math of a Llama-style decoder (``decoder.py``): embed, block, head, on the kit.

Every op with a kernel goes through ``env.ops``. A block is
``h = x + o_proj(attention(rope(qn(q_proj(n1(x)))), rope(kn(k_proj(n1(x)))), v_proj(n1(x))))``,
``y = h + down_proj(silu(gate_proj(n2(h))) * up_proj(n2(h)))``, where ``qn`` / ``kn`` are
the per-head q/k RMSNorms of Qwen 3 (``config.qk_norm``; absent for Llama 3) and the
attention is causal grouped-query attention, scaled by ``1 / sqrt(head_dim)``.

What a block saves for backward (the contents of ``A_<layer>``), per token:

- ``q`` (heads * head_dim), ``k`` and ``v`` (kv_heads * head_dim each): the three
  projections as they come out of their matmuls, before the q/k norm and the rotation;
- ``attn`` (heads * head_dim): the attention output, ``o_proj``'s input;
- ``lse`` (heads, float32): the attention's logsumexp;
- ``h_mid`` (hidden): the residual stream between attention and MLP;
- ``gate``, ``up`` (intermediate each): the SwiGLU's two projections.

That is ``2 * (heads + kv_heads) * head_dim + hidden + 2 * intermediate`` values and
``heads`` floats per token. With them backward runs no projection and no attention forward
again: it rebuilds only elementwise work (the two RMSNorms from ``x`` and ``h_mid``, the
q/k norms and rotations from the saved ``q`` and ``k``, ``silu(gate) * up``) and calls the
fused backward kernels (``attention_bwd`` with the saved logsumexp, ``rms_norm_bwd``,
``swiglu_bwd``); every projection's gradients are ``linear`` calls. ``forward`` is
``recompute`` plus the SwiGLU product and ``down_proj``, so the two cannot drift apart.

The block offers one partial save, ``mlp``: forward keeps the attention half's tensors
(``q``, ``k``, ``v``, ``attn``, ``lse``, ``h_mid``) and ``rederive`` makes ``gate`` and
``up`` again from ``h_mid`` (``n2`` and the two projections: no attention), freeing the
``2 * intermediate`` values a token that are most of what the block saves.
"""

from __future__ import annotations

from typing import Any

import torch

from dataflow_training.family import Env, LayerCost, PartialSave, RowGradient, TensorSpec, Work
from dataflow_training.kit import rotary
from dataflow_training.kit.attention import (
    attention_backward,
    attention_forward,
    merge_heads,
    split_heads,
)
from dataflow_training.kit.decoder import EMBED_WEIGHT, FINAL_NORM, LM_HEAD, DecoderConfig
from dataflow_training.kit.head import lm_head_loss
from dataflow_training.kit.linear import Linear, accumulation_dtype
from dataflow_training.kit.mlp import SwiGLU
from dataflow_training.kit.norms import RMSNorm

Tensors = dict[str, torch.Tensor]

#: every op the math calls through ``env.ops``
OPS = (
    "linear",
    "rms_norm_fwd",
    "rms_norm_bwd",
    "attention_fwd",
    "attention_bwd",
    "swiglu_fwd",
    "swiglu_bwd",
    "chunked_cross_entropy",
)

Q_PROJ = Linear("self_attn.q_proj.weight")
K_PROJ = Linear("self_attn.k_proj.weight")
V_PROJ = Linear("self_attn.v_proj.weight")
O_PROJ = Linear("self_attn.o_proj.weight")
MLP = SwiGLU(
    Linear("mlp.gate_proj.weight"), Linear("mlp.up_proj.weight"), Linear("mlp.down_proj.weight")
)


def _norms(config: DecoderConfig) -> tuple[RMSNorm, RMSNorm]:
    eps = config.rms_norm_eps
    return RMSNorm("input_layernorm.weight", eps), RMSNorm("post_attention_layernorm.weight", eps)


def _qk_norms(config: DecoderConfig) -> tuple[RMSNorm, RMSNorm]:
    eps = config.rms_norm_eps
    return RMSNorm("self_attn.q_norm.weight", eps), RMSNorm("self_attn.k_norm.weight", eps)


def _check_seq_len(config: DecoderConfig, seq_len: int) -> None:
    if seq_len > config.max_position_embeddings:
        raise ValueError(
            f"sequence length {seq_len} exceeds {type(config).__name__}.max_position_embeddings "
            f"({config.max_position_embeddings})"
        )


def _rope(config: DecoderConfig, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(cos, sin) for ``like``'s sequence length (dim 1), device and dtype."""
    return rotary.cached_tables(
        like.shape[1],
        config.head_dim,
        float(config.rope_theta),
        config.rope_scaling,
        like.device,
        like.dtype,
    )


def _per_head(config: DecoderConfig, t: torch.Tensor) -> torch.Tensor:
    """(batch, seq, heads * head_dim) -> a (batch, seq, heads, head_dim) view."""
    batch, seq, width = t.shape
    return t.view(batch, seq, width // config.head_dim, config.head_dim)


def _attention_inputs(
    config: DecoderConfig, params: Tensors, q: torch.Tensor, k: torch.Tensor, ops: Any
) -> tuple[torch.Tensor, torch.Tensor, tuple]:
    """Query and key heads (batch, heads, seq, head_dim) as attention takes them, from the
    projections: normed (``qk_norm``: per head, or over the whole projection for
    ``qk_norm_scope == "projection"``), then rotated; and the norms' statistics."""
    stats: tuple = ()
    if config.qk_norm:
        q_norm, k_norm = _qk_norms(config)
        per_head = config.qk_norm_scope == "head"
        q_in, k_in = (_per_head(config, t) if per_head else t for t in (q, k))
        q, q_stats = q_norm.forward(ops, params, q_in)
        k, k_stats = k_norm.forward(ops, params, k_in)
        stats = (q_stats, k_stats)
    q_heads, k_heads = _per_head(config, q.flatten(2)), _per_head(config, k.flatten(2))
    cos, sin = _rope(config, q_heads)
    rotated = (rotary.apply(t.transpose(1, 2), cos, sin) for t in (q_heads, k_heads))
    return *rotated, stats


def _qk_norm_backward(
    config: DecoderConfig, params: Tensors, saved: Tensors, stats: tuple, dq, dk, ops: Any
) -> tuple[torch.Tensor, torch.Tensor, Tensors]:
    """(dq, dk) of the projections (batch, seq, width) from those of the normed heads
    (batch, seq, heads, head_dim), and the norms' gradients."""
    if not config.qk_norm:
        return dq.flatten(2), dk.flatten(2), {}
    q_norm, k_norm = _qk_norms(config)
    per_head = config.qk_norm_scope == "head"
    grads: dict[str, torch.Tensor] = {}
    out = []
    for norm, name, stat, d in ((q_norm, "q", stats[0], dq), (k_norm, "k", stats[1], dk)):
        x = _per_head(config, saved[name]) if per_head else saved[name]
        d_in, g = norm.backward(ops, params, x, stat, d if per_head else d.flatten(2))
        grads.update(g)
        out.append(d_in.flatten(2))
    return out[0], out[1], grads


class DecoderEmbed:
    """``embed_tokens.weight[tokens]``; its gradient the rows of the round's tokens
    (``RowGradient``: no (vocab, dim) table)."""

    def forward(self, config: DecoderConfig, params: Tensors, tokens: torch.Tensor, env: Env):
        _check_seq_len(config, tokens.shape[1])
        return params[EMBED_WEIGHT][tokens]

    def backward(
        self, config: DecoderConfig, tokens: torch.Tensor, d_hidden: torch.Tensor, env: Env
    ) -> Tensors:
        """Needs no weights; each token's rows summed in float32 at least."""
        n = config.hidden_size
        grad = RowGradient.summed(
            tokens,
            d_hidden.reshape(-1, n),
            (config.vocab_size, n),
            accumulation_dtype(d_hidden.dtype),
        )
        return {EMBED_WEIGHT: grad}

    def cost(self, config: DecoderConfig, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        tokens, n = batch * seq_len, config.hidden_size
        rows = tokens * n * 4  # float32 row sums
        # read d_hidden; sum, gather and add the rows; read and write the gradient's rows
        return LayerCost(
            forward=Work(0, 2 * tokens * n * act_bytes),
            backward=Work(0, tokens * n * act_bytes + 4 * rows + 2 * tokens * n * act_bytes),
        )


def attention_saved(config: DecoderConfig, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
    """What a block's attention half saves: ``q``, ``k``, ``v``, ``attn``, ``lse``, ``h_mid``."""
    q, kv = config.q_width, config.kv_width
    return (
        TensorSpec("q", (batch, seq_len, q)),
        TensorSpec("k", (batch, seq_len, kv)),
        TensorSpec("v", (batch, seq_len, kv)),
        TensorSpec("attn", (batch, seq_len, q)),
        TensorSpec("lse", (batch, config.num_attention_heads, seq_len), dtype="float32"),
        TensorSpec("h_mid", (batch, seq_len, config.hidden_size)),
    )


def attention_forward_half(
    config: DecoderConfig, params: Tensors, x: torch.Tensor, ops: Any
) -> tuple[Tensors, torch.Tensor]:
    """``h_mid = x + o_proj(attention(n1(x)))``: (what it saves, including ``h_mid``, and
    ``n2(h_mid)``, the FFN's input)."""
    _check_seq_len(config, x.shape[1])
    norm_1, norm_2 = _norms(config)
    h1, _ = norm_1.forward(ops, params, x)
    # three calls, not a generator over h1: deleting a variable a closure captured is a
    # bytecode (DELETE_DEREF) torch.compile cannot trace, and it skips the rest of the block
    q, k, v = (
        Q_PROJ.forward(ops, params, h1),
        K_PROJ.forward(ops, params, h1),
        V_PROJ.forward(ops, params, h1),
    )
    del h1
    q_heads, k_heads, _ = _attention_inputs(config, params, q, k, ops)
    v_heads = split_heads(v, config.num_key_value_heads)
    out, lse = attention_forward(ops, q_heads, k_heads, v_heads, causal=True)
    del q_heads, k_heads, v_heads
    attn = merge_heads(out)
    h_mid = x + O_PROJ.forward(ops, params, attn)
    h2, _ = norm_2.forward(ops, params, h_mid)
    return {"q": q, "k": k, "v": v, "attn": attn, "lse": lse, "h_mid": h_mid}, h2


def ffn_input(config: DecoderConfig, params: Tensors, h_mid: torch.Tensor, ops: Any):
    """``(n2(h_mid), its statistics)``: the FFN's input, rebuilt in backward."""
    return _norms(config)[1].forward(ops, params, h_mid)


def attention_backward_half(
    config: DecoderConfig,
    params: Tensors,
    x: torch.Tensor,
    saved: Tensors,
    stats_2: tuple,
    d_h2: torch.Tensor,
    dy: torch.Tensor,
    grads: dict[str, torch.Tensor],
    ops: Any,
) -> torch.Tensor:
    """``dx`` from the gradient of the FFN's input ``d_h2`` and of the block's output
    ``dy`` (the residual); the attention half's gradients go into ``grads``."""
    norm_1, norm_2 = _norms(config)
    d_h_mid, g = norm_2.backward(ops, params, saved["h_mid"], stats_2, d_h2)
    grads.update(g)
    del d_h2
    d_h_mid += dy  # the residual
    # attention: h_mid = x + o_proj(attention(...))
    d_attn, g = O_PROJ.backward(ops, params, saved["attn"], d_h_mid)
    grads.update(g)
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    q_heads, k_heads, qk_stats = _attention_inputs(config, params, saved["q"], saved["k"], ops)
    dq, dk, dv = attention_backward(
        ops,
        split_heads(d_attn, heads),
        q_heads,
        k_heads,
        split_heads(saved["v"], kv_heads),
        split_heads(saved["attn"], heads),
        saved["lse"],
        causal=True,
    )
    del d_attn, q_heads, k_heads
    cos, sin = _rope(config, x)
    dq, dk = (rotary.backward(d, cos, sin).transpose(1, 2).contiguous() for d in (dq, dk))
    # back through the q/k norms, from the saved projections
    dq, dk, g = _qk_norm_backward(config, params, saved, qk_stats, dq, dk, ops)
    grads.update(g)
    d_proj = (dq, dk, merge_heads(dv))
    del dq, dk, dv
    h1, stats_1 = norm_1.forward(ops, params, x)
    d_h1 = None
    for proj, d_out in zip((Q_PROJ, K_PROJ, V_PROJ), d_proj, strict=True):
        d_in, g = proj.backward(ops, params, h1, d_out)
        grads.update(g)
        d_h1 = d_in if d_h1 is None else d_h1.add_(d_in)
    del d_proj, h1
    d_x, g = norm_1.backward(ops, params, x, stats_1, d_h1)
    grads.update(g)
    return d_x.add_(d_h_mid)


def attention_matmul_flops(config: DecoderConfig, batch: int, seq_len: int) -> tuple[int, int]:
    """(projection flops, attention flops) of one forward of the attention half."""
    tokens, n = batch * seq_len, config.hidden_size
    q, kv = config.q_width, config.kv_width
    return 2 * tokens * n * (2 * q + 2 * kv), 2 * tokens * seq_len * q  # causal: half


class MlpPartialSave:
    """The ``mlp`` partial save of a block on the attention half (the decoder's and the
    MoE block): keep what the attention half saves, re-derive the FFN's saved projections
    from the kept ``h_mid``: the block's ``ffn_saved`` of ``n2(h_mid)``, the very call its
    ``recompute`` ends with."""

    def partial_saves(self, config: DecoderConfig) -> tuple[PartialSave, ...]:
        return (PartialSave("mlp", tuple(s.name for s in attention_saved(config, 1, 1))),)

    def rederive(
        self,
        config: DecoderConfig,
        params: Tensors,
        x: torch.Tensor,
        kept: Tensors,
        aux_temp: Tensors,
        env: Env,
        partial: str,
    ) -> Tensors:
        if partial != "mlp":
            raise KeyError(f"the block has no partial save {partial!r}; it has: mlp")
        h2, _ = ffn_input(config, params, kept["h_mid"], env.ops)
        return self.ffn_saved(config, params, h2, aux_temp, env.ops)


class DecoderBlock(MlpPartialSave):
    """Pre-norm block: ``h = x + attention(n1(x))``, ``y = h + swiglu(n2(h))``."""

    def saved(self, config: DecoderConfig, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return (
            *attention_saved(config, batch, seq_len),
            TensorSpec("gate", (batch, seq_len, config.intermediate_size)),
            TensorSpec("up", (batch, seq_len, config.intermediate_size)),
        )

    def aux_temp(self, config: DecoderConfig, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        return ()

    def forward(
        self, config: DecoderConfig, params: Tensors, x: torch.Tensor, env: Env
    ) -> tuple[torch.Tensor, Tensors, Tensors]:
        saved = self.recompute(config, params, x, {}, env)
        act = env.ops["swiglu_fwd"](saved["gate"], saved["up"])
        return saved["h_mid"] + MLP.down.forward(env.ops, params, act), saved, {}

    def recompute(
        self, config: DecoderConfig, params: Tensors, x: torch.Tensor, aux_temp: Tensors, env: Env
    ) -> Tensors:
        saved, h2 = attention_forward_half(config, params, x, env.ops)
        return saved | self.ffn_saved(config, params, h2, aux_temp, env.ops)

    def ffn_saved(
        self, config: DecoderConfig, params: Tensors, h2: torch.Tensor, aux_temp: Tensors, ops: Any
    ) -> Tensors:
        """The SwiGLU's two projections of ``h2 = n2(h_mid)``, as the block saves them."""
        return {"gate": MLP.gate.forward(ops, params, h2), "up": MLP.up.forward(ops, params, h2)}

    def backward(
        self,
        config: DecoderConfig,
        params: Tensors,
        x: torch.Tensor,
        saved: Tensors,
        aux_temp: Tensors,
        dy: torch.Tensor,
        env: Env,
    ) -> tuple[torch.Tensor, Tensors]:
        ops = env.ops
        # MLP: y = h_mid + swiglu(n2(h_mid))
        h2, stats_2 = ffn_input(config, params, saved["h_mid"], ops)
        d_h2, grads = MLP.backward(ops, params, h2, saved["gate"], saved["up"], dy)
        del h2
        return attention_backward_half(
            config, params, x, saved, stats_2, d_h2, dy, grads, ops
        ), grads

    def cost(self, config: DecoderConfig, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        tokens, n, inner = batch * seq_len, config.hidden_size, config.intermediate_size
        q, kv = config.q_width, config.kv_width
        projections, attention = attention_matmul_flops(config, batch, seq_len)
        matmul = projections + 2 * tokens * 3 * n * inner
        saved = 2 * q + 2 * kv + n + 2 * inner
        activations = tokens * act_bytes * (2 * n + 2 * saved)
        # mlp: n2 reads h_mid and writes h2, gate and up each read h2 and write their own
        mlp_in = Work(2 * tokens * 2 * n * inner, tokens * act_bytes * (4 * n + 2 * inner))
        # recompute: forward up to the saved gate and up (no SwiGLU product, no down_proj,
        # no output): x read, the saved tensors written, all but gate and up read again
        down = 2 * tokens * n * inner
        rederived = tokens * act_bytes * (n + 2 * saved - 2 * inner)
        return LayerCost(
            forward=Work(matmul + attention, activations),
            backward=Work(2 * matmul + 2.5 * attention, 2 * activations),
            recompute=Work(matmul - down + attention, rederived),
            partial={"mlp": mlp_in},
        )


class DecoderHead:
    """Final RMSNorm, logits against ``lm_head.weight`` (the embedding's, when tied) chunk
    by chunk, mean loss."""

    def forward_backward(
        self, config: DecoderConfig, params: Tensors, x: torch.Tensor, targets: Any, env: Env
    ) -> tuple[torch.Tensor, torch.Tensor, Tensors]:
        norm = RMSNorm(FINAL_NORM, config.rms_norm_eps)
        return lm_head_loss(env, params, x, targets, norm=norm, projection=LM_HEAD)

    def cost(self, config: DecoderConfig, batch: int, seq_len: int, act_bytes: int) -> LayerCost:
        tokens, n = batch * seq_len, config.hidden_size
        logits = 2 * tokens * config.vocab_size * n
        work = Work(3 * logits, tokens * act_bytes * 4 * n + tokens * config.vocab_size * 8)
        return LayerCost(forward=work, backward=Work())


_KINDS = {"embed": DecoderEmbed, "block": DecoderBlock, "head": DecoderHead}


def math_of(family: str, kind: str) -> Any:
    """The math object of a layer kind (``embed``, ``block``, ``head``) of ``family``."""
    if kind not in _KINDS:
        raise KeyError(f"{family} has no layer kind {kind!r}; its kinds: {', '.join(_KINDS)}")
    return _KINDS[kind]()
