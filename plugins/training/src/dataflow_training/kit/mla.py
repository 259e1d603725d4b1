"""Multi-head latent attention (MLA: DeepSeek V2 and V3), as an attention part of a block.

With ``h`` the block's normed input, ``H`` heads, ``d = qk_nope_head_dim +
qk_rope_head_dim`` (a query's and a key's width) and ``v_head_dim`` (a value's)::

    q     = q_b_proj(rms(q_a_proj(h)))                 (q_lora_rank set; else q_proj(h))
    c, kr = split(kv_a_proj_with_mqa(h), [kv_lora_rank, qk_rope_head_dim])
    k_nope, v = split(kv_b_proj(rms(c)))               per head
    k = [k_nope, rope(kr)]   (kr: one rope key every head shares)
    q = [q_nope, rope(q_rope)]
    out = o_proj(softmax(q k^T * scale) v)             causal

``scale`` is ``1 / sqrt(d)``, times ``mscale(factor, mscale_all_dim)^2`` under YaRN
(``YarnScaling``, as DeepSeek's reference code and transformers' ``yarn_apply_mscale``
do); the rope tables are YaRN's frequencies times its attention factor. With
``rope_interleave`` (DeepSeek's checkpoints) the rope dims are taken as interleaved pairs
``(x0, x1), (x2, x3), ...``: they are gathered evens then odds and rotated as pairs
``(i, i + r/2)``, which gives the same scores (queries and keys are permuted alike).
The latent norms' epsilon is 1e-6 (``LATENT_EPS``: transformers' and DeepSeek's
``RMSNorm`` default; the config's ``rms_norm_eps`` is the block norms').

**Saved** (the ``A`` object's share): the latents, not the heads. ``q_a`` (q_lora_rank
per token; with no q latent, ``q``, H * d), ``kv_a`` (kv_lora_rank + qk_rope_head_dim:
the compressed latent before its norm and the shared rope key before rotation), ``attn``
(H * v_head_dim, ``o_proj``'s input and the attention's output) and ``lse`` (H, float32).
Backward makes the keys and values again (the latent norm and one ``kv_b_proj`` matmul)
and the queries (the q latent's norm and ``q_b_proj``), and calls ``attention_bwd``; no
attention forward runs again. For DeepSeek V3 (H = 128) that is 2,112 values a token
saved, where the heads would be 73,728.

Heads of another width than the values: the attention ops take one head width, so the
narrower of values and queries/keys is padded with zeros to the wider (zeros add nothing
to a score and come out as zeros), and the pad is cut off again.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from dataflow_training.kit import rotary
from dataflow_training.kit.attention import (
    attention_backward,
    attention_flops,
    attention_forward,
    merge_heads,
    split_heads,
)
from dataflow_training.kit.linear import Linear, projections_backward
from dataflow_training.kit.norms import RMSNorm
from dataflow_training.kit.parts import as_is
from dataflow_training.step.family import TensorSpec

Tensors = dict[str, torch.Tensor]

#: the latent norms' epsilon (module docstring)
LATENT_EPS = 1e-6

Q_PROJ = Linear("self_attn.q_proj.weight")
Q_A = Linear("self_attn.q_a_proj.weight")
Q_B = Linear("self_attn.q_b_proj.weight")
KV_A = Linear("self_attn.kv_a_proj_with_mqa.weight")
KV_B = Linear("self_attn.kv_b_proj.weight")
O_PROJ = Linear("self_attn.o_proj.weight")
Q_NORM = RMSNorm("self_attn.q_a_layernorm.weight", LATENT_EPS)
KV_NORM = RMSNorm("self_attn.kv_a_layernorm.weight", LATENT_EPS)


# -- YaRN ------------------------------------------------------------------------------


@attrs.frozen
class YarnScaling:
    """YaRN's rope scaling (HF ``rope_type="yarn"``; DeepSeek V3: factor 40 over 4,096
    positions, ``mscale = mscale_all_dim = 1``)."""

    factor: float
    original_max_position: int
    beta_fast: float = 32.0
    beta_slow: float = 1.0
    mscale: float = 1.0
    mscale_all_dim: float = 0.0


def _as_yarn(value: object) -> object:
    """A ``YarnScaling`` from its fields as a mapping too (overrides travel as JSON)."""
    if isinstance(value, Mapping):
        try:
            return YarnScaling(**value)
        except TypeError as error:
            raise ValueError(f"rope_yarn {dict(value)!r}: {error}") from None
    return value


def _yarn(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value is not None and not isinstance(value, YarnScaling):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be None or a YarnScaling, "
            f"got {value!r}"
        )


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    """YaRN's ``0.1 * mscale * ln(factor) + 1`` (1 at no scaling)."""
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def yarn_inverse_frequencies(
    dim: int, base: float, yarn: YarnScaling, device: Any = "cpu"
) -> torch.Tensor:
    """float64 (dim // 2,) frequencies: interpolated (divided by ``factor``) below the
    band of dims that turn ``beta_slow`` .. ``beta_fast`` times over the original
    context, kept above it, blended linearly across it (the band's ends rounded outward)."""
    steps = torch.arange(0, dim, 2, dtype=torch.float64, device=device)
    kept = 1.0 / base ** (steps / dim)

    def turning_dim(turns: float) -> float:
        return (
            dim
            * math.log(yarn.original_max_position / (turns * 2 * math.pi))
            / (2 * math.log(base))
        )

    low = max(math.floor(turning_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(turning_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001
    pair = torch.arange(dim // 2, dtype=torch.float64, device=device)
    interpolated = ((pair - low) / (high - low)).clamp(0, 1)
    return kept / yarn.factor * interpolated + kept * (1 - interpolated)


def yarn_attention_factor(yarn: YarnScaling) -> float:
    """What the rope tables are multiplied by."""
    if yarn.mscale and yarn.mscale_all_dim:
        return yarn_mscale(yarn.factor, yarn.mscale) / yarn_mscale(yarn.factor, yarn.mscale_all_dim)
    return yarn_mscale(yarn.factor)


def softmax_scale(config: Any) -> float:
    """``1 / sqrt(qk_nope_head_dim + qk_rope_head_dim)``, times YaRN's
    ``mscale(factor, mscale_all_dim)^2`` where it scales."""
    scale = (config.qk_nope_head_dim + config.qk_rope_head_dim) ** -0.5
    yarn = config.rope_yarn
    if yarn is not None and yarn.mscale_all_dim:
        scale *= yarn_mscale(yarn.factor, yarn.mscale_all_dim) ** 2
    return scale


# -- the config fields -------------------------------------------------------------------


def _positive(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be a positive int, got {value!r}"
        )


def _optional_positive(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if value is not None:
        _positive(instance, attribute, value)


def _even(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    _positive(instance, attribute, value)
    if value % 2:
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} ({value}) must be even (rotary pairs)"
        )


def flag(instance: Any, attribute: attrs.Attribute, value: object) -> None:
    if not isinstance(value, bool):
        raise ValueError(
            f"{type(instance).__name__}.{attribute.name} must be True or False, got {value!r}"
        )


@attrs.frozen(slots=False)
class MLAFields:
    """MLA's config fields (HF's names), for a config class to take beside its decoder
    config base, before it (``class Config(MLAFields, DecoderConfig)``; no slots, so it
    combines with other field classes). ``q_lora_rank`` None: a plain ``q_proj``.
    ``rope_yarn``: YaRN's scaling of the rope dims (None: plain RoPE with ``rope_theta``)."""

    q_lora_rank: int | None = attrs.field(default=None, kw_only=True, validator=_optional_positive)
    kv_lora_rank: int = attrs.field(default=512, kw_only=True, validator=_positive)
    qk_nope_head_dim: int = attrs.field(default=128, kw_only=True, validator=_positive)
    qk_rope_head_dim: int = attrs.field(default=64, kw_only=True, validator=_even)
    v_head_dim: int = attrs.field(default=128, kw_only=True, validator=_positive)
    rope_interleave: bool = attrs.field(default=True, kw_only=True, validator=flag)
    rope_yarn: YarnScaling | None = attrs.field(
        default=None, kw_only=True, converter=_as_yarn, validator=_yarn
    )


# -- the part ----------------------------------------------------------------------------


def _interleaved(x: torch.Tensor) -> torch.Tensor:
    """Interleaved pairs (x0, x1), (x2, x3), .. as pairs (i, i + r/2): evens, then odds."""
    return torch.cat((x[..., 0::2], x[..., 1::2]), dim=-1)


def _interleaved_backward(d: torch.Tensor) -> torch.Tensor:
    half = d.shape[-1] // 2
    out = torch.empty_like(d)
    out[..., 0::2], out[..., 1::2] = d[..., :half], d[..., half:]
    return out


def _pad(t: torch.Tensor, width: int) -> torch.Tensor:
    """``t`` with zeros after its last dimension up to ``width``."""
    extra = width - t.shape[-1]
    return t if extra == 0 else torch.nn.functional.pad(t, (0, extra))


@dataclasses.dataclass(frozen=True)
class LatentAttention:
    """Multi-head latent attention (module docstring), as the attention part of a block.
    Parameters (HF's names and order): ``self_attn.q_a_proj``, ``q_a_layernorm``,
    ``q_b_proj`` (or ``q_proj``), ``kv_a_proj_with_mqa``, ``kv_a_layernorm``,
    ``kv_b_proj``, ``o_proj``. Saved: the latents (``q_a`` or ``q``, ``kv_a``), ``attn``
    and ``lse``."""

    module = "self_attn"
    ops = ("attention_fwd", "attention_bwd", "rms_norm_fwd", "rms_norm_bwd")

    # -- declarations ----------------------------------------------------------------------
    @staticmethod
    def _qk(config: Any) -> int:
        return config.qk_nope_head_dim + config.qk_rope_head_dim

    def _queries(self, config: Any) -> tuple[str, int]:
        """(the saved query tensor's name, its width a token)."""
        if config.q_lora_rank is None:
            return "q", config.num_attention_heads * self._qk(config)
        return "q_a", config.q_lora_rank

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        n, heads, r_kv = config.hidden_size, config.num_attention_heads, config.kv_lora_rank
        r_q, rope = config.q_lora_rank, config.qk_rope_head_dim
        if r_q is None:
            queries: tuple[TensorSpec, ...] = (
                TensorSpec(Q_PROJ.weight, (heads * self._qk(config), n)),
            )
        else:
            queries = (
                TensorSpec(Q_A.weight, (r_q, n)),
                TensorSpec(Q_NORM.weight, (r_q,), decay=False),
                TensorSpec(Q_B.weight, (heads * self._qk(config), r_q)),
            )
        return (
            *queries,
            TensorSpec(KV_A.weight, (r_kv + rope, n)),
            TensorSpec(KV_NORM.weight, (r_kv,), decay=False),
            TensorSpec(KV_B.weight, (heads * (config.qk_nope_head_dim + config.v_head_dim), r_kv)),
            TensorSpec(O_PROJ.weight, (n, heads * config.v_head_dim)),
        )

    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        name, width = self._queries(config)
        heads = config.num_attention_heads
        return (
            TensorSpec(name, (batch, seq_len, width)),
            TensorSpec("kv_a", (batch, seq_len, config.kv_lora_rank + config.qk_rope_head_dim)),
            TensorSpec("attn", (batch, seq_len, heads * config.v_head_dim)),
            TensorSpec("lse", (batch, heads, seq_len), dtype="float32"),
        )

    def hf_rules(self, config: Any, prefix: str) -> list[Any]:
        return as_is(self.params(config), prefix)

    def reference(self, config: Any) -> Any:
        # the reference module imports only torch; loaded with the part's reference
        from dataflow_training.kit.mla_reference import LatentAttention as Reference

        return Reference(config)

    # -- math ------------------------------------------------------------------------------
    def _tables(self, config: Any, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(cos, sin), (seq, qk_rope_head_dim), for ``like``'s length (dim 1), device, dtype."""
        seq, dim, base = like.shape[1], config.qk_rope_head_dim, float(config.rope_theta)
        yarn = config.rope_yarn
        if yarn is None:
            return rotary.cached_tables(seq, dim, base, None, like.device, like.dtype)
        inv = yarn_inverse_frequencies(dim, base, yarn, like.device)
        angles = torch.outer(torch.arange(seq, dtype=torch.float64, device=like.device), inv)
        angles = torch.cat((angles, angles), dim=-1)
        factor = yarn_attention_factor(yarn)
        return (angles.cos() * factor).to(like.dtype), (angles.sin() * factor).to(like.dtype)

    def _rope(self, config: Any, x: torch.Tensor, cos, sin) -> torch.Tensor:
        """Rotate (batch, heads, seq, rope) by position."""
        return rotary.apply(_interleaved(x) if config.rope_interleave else x, cos, sin)

    def _rope_backward(self, config: Any, d: torch.Tensor, cos, sin) -> torch.Tensor:
        d = rotary.backward(d, cos, sin)
        return _interleaved_backward(d) if config.rope_interleave else d

    def _heads(self, config: Any, params: Tensors, saved: Tensors, ops: Any) -> dict[str, Any]:
        """The attention's q, k, v heads (batch, heads, seq, width) from the latents, and
        what backward needs of the way there (the normed latents and their statistics)."""
        heads, nope, rope = (
            config.num_attention_heads,
            config.qk_nope_head_dim,
            config.qk_rope_head_dim,
        )
        r_kv = config.kv_lora_rank
        built: dict[str, Any] = {}
        if config.q_lora_rank is None:
            q = saved["q"]
        else:
            built["q_latent"], built["q_stats"] = Q_NORM.forward(ops, params, saved["q_a"])
            q = Q_B.forward(ops, params, built["q_latent"])
        q = split_heads(q, heads)
        latent, k_rope = saved["kv_a"][..., :r_kv], saved["kv_a"][..., r_kv:]
        built["kv_latent"], built["kv_stats"] = KV_NORM.forward(ops, params, latent)
        kv = split_heads(KV_B.forward(ops, params, built["kv_latent"]), heads)
        cos, sin = self._tables(config, saved["kv_a"])
        built["tables"] = (cos, sin)
        k_rope = self._rope(config, k_rope.unsqueeze(1), cos, sin)
        batch, _, seq, _ = q.shape
        built["q"] = torch.cat((q[..., :nope], self._rope(config, q[..., nope:], cos, sin)), -1)
        built["k"] = torch.cat((kv[..., :nope], k_rope.expand(batch, heads, seq, rope)), -1)
        built["v"] = kv[..., nope:]
        return built

    def _width(self, config: Any) -> int:
        """The heads' width the attention ops run at (module docstring)."""
        return max(self._qk(config), config.v_head_dim)

    def project(self, config: Any, params: Tensors, h: torch.Tensor, ops: Any) -> Tensors:
        """The latents of the normed input ``h``, saved as they are."""
        name = "q" if config.q_lora_rank is None else "q_a"
        first = Q_PROJ if config.q_lora_rank is None else Q_A
        return {name: first.forward(ops, params, h), "kv_a": KV_A.forward(ops, params, h)}

    def attend(
        self, config: Any, params: Tensors, projected: Tensors, ops: Any
    ) -> tuple[torch.Tensor, Tensors]:
        """(the output after ``o_proj``, the saved ``attn`` and ``lse``)."""
        built = self._heads(config, params, projected, ops)
        width = self._width(config)
        q, k, v = (_pad(built[name], width) for name in ("q", "k", "v"))
        del built
        out, lse = self.core_forward(config, ops, q, k, v)
        del q, k, v
        attn = merge_heads(out[..., : config.v_head_dim])
        return O_PROJ.forward(ops, params, attn), {"attn": attn, "lse": lse}

    def core_forward(
        self, config: Any, ops: Any, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """The attention of the (padded) heads: causal softmax attention."""
        return attention_forward(ops, q, k, v, scale=softmax_scale(config))

    def core_backward(
        self, config: Any, ops: Any, d_out: torch.Tensor, q, k, v, out, lse
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``core_forward``'s backward from its output and logsumexp."""
        return attention_backward(ops, d_out, q, k, v, out, lse, scale=softmax_scale(config))

    def backward(
        self,
        config: Any,
        params: Tensors,
        x: torch.Tensor,
        saved: Tensors,
        d_out: torch.Tensor,
        grads: dict[str, torch.Tensor],
        ops: Any,
    ) -> tuple[torch.Tensor, ...]:
        """The gradients of the latents (``project``'s outputs, in its order) from that of
        the output; the other parameters' gradients go into ``grads``."""
        d_attn, g = O_PROJ.backward(ops, params, saved["attn"], d_out)
        grads.update(g)
        built = self._heads(config, params, saved, ops)
        width, heads = self._width(config), config.num_attention_heads
        q, k, v = (_pad(built[name], width) for name in ("q", "k", "v"))
        out = _pad(split_heads(saved["attn"], heads), width)
        d_core = _pad(split_heads(d_attn, heads), width)
        dq, dk, dv = self.core_backward(config, ops, d_core, q, k, v, out, saved["lse"])
        del q, k, v, out, d_attn, d_core
        return self.latents_backward(config, params, saved, built, (dq, dk, dv), grads, ops)

    def latents_backward(
        self,
        config: Any,
        params: Tensors,
        saved: Tensors,
        built: dict[str, Any],
        d_heads: tuple[torch.Tensor, torch.Tensor, torch.Tensor],
        grads: dict[str, torch.Tensor],
        ops: Any,
    ) -> tuple[torch.Tensor, ...]:
        """The latents' gradients from the (padded) heads' ``(dq, dk, dv)``; the
        projections' and latent norms' gradients go into ``grads``."""
        nope, v_dim = config.qk_nope_head_dim, config.v_head_dim
        dq, dk, dv = d_heads
        qk = self._qk(config)
        dq, dk, dv = dq[..., :qk], dk[..., :qk], dv[..., :v_dim]
        cos, sin = built["tables"]
        # keys and values: kv = kv_b(norm(latent)); the rope key is every head's
        d_kv = merge_heads(torch.cat((dk[..., :nope], dv), dim=-1))
        d_k_rope = self._rope_backward(config, dk[..., nope:].sum(1), cos, sin)
        d_kv_latent, g = KV_B.backward(ops, params, built["kv_latent"], d_kv)
        grads.update(g)
        latent = saved["kv_a"][..., : config.kv_lora_rank]
        d_latent, g = KV_NORM.backward(ops, params, latent, built["kv_stats"], d_kv_latent)
        grads.update(g)
        d_kv_a = torch.cat((d_latent, d_k_rope.to(d_latent.dtype)), dim=-1)
        # queries
        d_rope = self._rope_backward(config, dq[..., nope:], cos, sin)
        d_q = merge_heads(torch.cat((dq[..., :nope], d_rope), dim=-1))
        if config.q_lora_rank is None:
            return d_q, d_kv_a
        d_q_latent, g = Q_B.backward(ops, params, built["q_latent"], d_q)
        grads.update(g)
        d_q_a, g = Q_NORM.backward(ops, params, saved["q_a"], built["q_stats"], d_q_latent)
        grads.update(g)
        return d_q_a, d_kv_a

    def project_backward(
        self,
        config: Any,
        params: Tensors,
        h: torch.Tensor,
        d_projected: tuple[torch.Tensor, ...],
        grads: dict[str, torch.Tensor],
        ops: Any,
    ) -> torch.Tensor:
        """``dh`` from the latents' gradients; their projections' go into ``grads``."""
        first = Q_PROJ if config.q_lora_rank is None else Q_A
        return projections_backward(ops, params, h, (first, KV_A), d_projected, grads)

    def flops(self, config: Any, batch: int, seq_len: int) -> tuple[int, float]:
        """(the projections' FLOPs, the attention's) of one forward: the latents'
        projections, the heads' made from them, ``o_proj``; causal attention over
        queries and keys of ``qk_nope_head_dim + qk_rope_head_dim`` and values of
        ``v_head_dim``."""
        tokens, n, heads = batch * seq_len, config.hidden_size, config.num_attention_heads
        qk, v, r_kv = self._qk(config), config.v_head_dim, config.kv_lora_rank
        if config.q_lora_rank is None:
            queries = n * heads * qk
        else:
            queries = config.q_lora_rank * (n + heads * qk)
        latent = n * (r_kv + config.qk_rope_head_dim) + r_kv * heads * (config.qk_nope_head_dim + v)
        projections = 2 * tokens * (queries + latent + heads * v * n)
        return projections, attention_flops(batch, seq_len, heads * (qk + v) // 2, None)
