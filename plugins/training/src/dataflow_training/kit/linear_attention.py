"""Linear attention as a part of a block: Gated DeltaNet (Qwen3-Next's and Qwen 3.5's
``linear_attention`` layers), and the config fields it reads.

What one layer computes from its normed input ``h`` (HF's ``Qwen3_5GatedDeltaNet``; names
are HF's)::

    qkv = in_proj_qkv(h); z = in_proj_z(h); b = in_proj_b(h); a = in_proj_a(h)
    q, k, v = split(silu(causal depthwise conv1d(qkv)))    kernel linear_conv_kernel_dim
    q, k = l2norm(q), l2norm(k)                            per key head, eps 1e-6
    beta = sigmoid(b); g = -exp(A_log) * softplus(a + dt_bias)
    core = gated_delta_rule(q, k, v, g, beta)              the recurrence (an op)
    out = out_proj(rmsnorm(core) * norm.weight * silu(z))  per value head, eps rms_norm_eps

q and k have ``linear_num_key_heads`` heads of ``linear_key_head_dim``; v, z and the
output ``linear_num_value_heads`` heads of ``linear_value_head_dim`` (each key head serves
a group of value heads). The gated norm scales by ``w`` itself (not ``1 + w``).

**What backward needs, and why it is not the chunk states.** Forward saves the four
projections as their matmuls leave them (``qkv``, ``z``, ``b``, ``a``) and the rule's
output ``core``: ``conv_dim + 2 value_dim + 2 v_heads`` values a token. Backward makes
again, elementwise, the convolution and its SiLU, the L2 norms, ``g`` and ``beta`` from
``qkv``, ``a`` and ``b``, and the gated norm from ``core`` and ``z``; it calls
``gated_delta_rule_bwd`` on the rule's inputs, which re-derives the chunk states inside
(fla's backward does the same: it recomputes them from the inputs rather than keep them).
Keeping the states instead would cost ``v_heads * k_dim * v_dim / 64`` float32 values a
token (12,288 at Qwen 3.5 9B's 32 x 128 x 128, against 16,448 for everything saved here),
and the conv's output besides; recomputing them is work linear in the sequence length, a
fraction of the rule's forward. No projection runs again.

Cost: the five projections' matmuls, and the rule priced by ``delta_rule_flops``, linear
in the sequence length (64-token chunks).
"""

from __future__ import annotations

import dataclasses
from typing import Any

import attrs
import torch
import torch.nn.functional as F

from dataflow_training.kit import linear_attention_reference
from dataflow_training.kit.decoder import DecoderConfig, _positive, layer_types_field
from dataflow_training.kit.linear import Linear, accumulation_dtype, projections_backward
from dataflow_training.kit.parts import as_is
from dataflow_training.step.family import TensorSpec

Tensors = dict[str, torch.Tensor]

#: the rule's chunk: the pricing's and the kernels' (``dataflow_kernels_torch.delta_rule``)
CHUNK = 64
#: the L2 norm's epsilon on q and k (HF's and fla's ``l2norm``)
L2_EPS = 1e-6

QKV = Linear("linear_attn.in_proj_qkv.weight")
Z = Linear("linear_attn.in_proj_z.weight")
B = Linear("linear_attn.in_proj_b.weight")
A = Linear("linear_attn.in_proj_a.weight")
OUT = Linear("linear_attn.out_proj.weight")
CONV = "linear_attn.conv1d.weight"
DT_BIAS, A_LOG, NORM = "linear_attn.dt_bias", "linear_attn.A_log", "linear_attn.norm.weight"


def _field(default: int) -> Any:
    return attrs.field(default=default, kw_only=True, validator=_positive)


@attrs.frozen
class LinearAttentionConfig(DecoderConfig):
    """A decoder config with Gated DeltaNet's sizes (HF's ``Qwen3_5TextConfig`` names and
    defaults) and ``layer_types`` (which layers are ``linear_attention``). A family's config
    subclasses it (an MoE config takes it beside ``moe.MoEFields``)."""

    linear_conv_kernel_dim: int = _field(4)
    linear_key_head_dim: int = _field(128)
    linear_value_head_dim: int = _field(128)
    linear_num_key_heads: int = _field(16)
    linear_num_value_heads: int = _field(32)
    layer_types: tuple[str, ...] | None = layer_types_field()

    def __attrs_post_init__(self) -> None:
        super().__attrs_post_init__()
        name = type(self).__name__
        if self.linear_num_value_heads % self.linear_num_key_heads:
            raise ValueError(
                f"{name}.linear_num_value_heads ({self.linear_num_value_heads}) must be a "
                f"multiple of {name}.linear_num_key_heads ({self.linear_num_key_heads})"
            )

    @property
    def linear_key_width(self) -> int:
        return self.linear_num_key_heads * self.linear_key_head_dim

    @property
    def linear_value_width(self) -> int:
        return self.linear_num_value_heads * self.linear_value_head_dim

    @property
    def linear_conv_width(self) -> int:
        """The convolved channels: q, k and v (``2 key_width + value_width``)."""
        return 2 * self.linear_key_width + self.linear_value_width


def delta_rule_flops(batch: int, seq_len: int, heads: int, k_dim: int, v_dim: int) -> float:
    """FLOPs of the chunked gated delta rule's forward, per value head and token: the
    chunk's ``k k^T`` and ``q k^T`` (2 C K each), its triangular solves (C (K + V)), the
    state read by the corrections and the queries and its update (2 K V each), and the
    chunk's scores times the corrected values (2 C V): linear in ``seq_len``."""
    per_token = 5 * CHUNK * k_dim + 3 * CHUNK * v_dim + 6 * k_dim * v_dim
    return batch * seq_len * heads * per_token


# -- elementwise pieces, each with its backward -------------------------------------------


def _shifted_sum(x: torch.Tensor, taps: torch.Tensor, before: int, after: int) -> torch.Tensor:
    """sum_j taps[:, j] * x[t - before + j] over the kernel's taps (x (batch, seq,
    channels) padded with ``before`` zero tokens in front and ``after`` behind), in float32
    at least and returned in x's dtype. Shifted products, not ``F.conv1d``: compiled, the
    sum can fuse into one elementwise kernel (not yet measured on the device); aten's
    depthwise convolution kernel took 0.72 ms of a 7.05 ms qwen3_5_cut linear block
    forward at batch 2 on the H200, and its two calls in the backward 1.48 ms of 15.03
    (session 42, results/tasks_qwen3_5_cut_b2_h200_session42.json)."""
    seq, total = x.shape[1], accumulation_dtype(x.dtype)
    padded = F.pad(x, (0, 0, before, after)).to(total)
    taps = taps.to(total)
    out = padded[:, 0:seq] * taps[:, 0]
    for j in range(1, taps.shape[1]):
        out = out + padded[:, j : j + seq] * taps[:, j]
    return out.to(x.dtype)


def _conv(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """Causal depthwise convolution of x (batch, seq, channels) by weight (channels, 1,
    kernel): out[t] = sum_j weight[:, 0, j] * x[t - kernel + 1 + j] (zeros before 0)."""
    kernel = weight.shape[-1]
    return _shifted_sum(x, weight[:, 0], kernel - 1, 0)


def _conv_backward(
    x: torch.Tensor, weight: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """(dx, d_weight) of ``_conv``: dx[t] = sum_j weight[:, 0, j] * dy[t + kernel - 1 - j]
    (the flipped kernel over dy padded on the right); d_weight[:, 0, j] the sum over
    tokens of dy[t] * x[t - kernel + 1 + j]."""
    kernel, seq = weight.shape[-1], x.shape[1]
    dx = _shifted_sum(dy, weight[:, 0].flip(-1), 0, kernel - 1)
    dy_t = dy.transpose(1, 2)
    x_padded = F.pad(x.transpose(1, 2), (kernel - 1, 0))
    total = accumulation_dtype(dy.dtype)
    d_weight = torch.stack(
        [(dy_t * x_padded[..., j : j + seq]).sum((0, 2), dtype=total) for j in range(kernel)],
        dim=-1,
    )
    return dx, d_weight.unsqueeze(1).to(weight.dtype)


def _silu_backward(pre: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    sig = torch.sigmoid(pre)
    return dy * sig * (1 + pre * (1 - sig))


def _l2norm(x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(x / sqrt(sum x^2 + eps) over the last dim, that rstd), in float32 at least."""
    wide = x.to(accumulation_dtype(x.dtype))
    rstd = torch.rsqrt((wide * wide).sum(-1, keepdim=True) + L2_EPS)
    return (wide * rstd).to(x.dtype), rstd


def _l2norm_backward(x: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    wide, d = x.to(rstd.dtype), dy.to(rstd.dtype)
    y = wide * rstd
    return (rstd * (d - y * (d * y).sum(-1, keepdim=True))).to(x.dtype)


@dataclasses.dataclass(frozen=True)
class GatedDeltaNet:
    """Gated DeltaNet, as the attention part of a block (the module docstring says what it
    computes, saves and costs). Parameters (HF's names and order): ``linear_attn.
    conv1d.weight`` (conv_dim, 1, kernel), ``dt_bias`` and ``A_log`` (v_heads), ``norm.
    weight`` (v_dim), ``out_proj.weight``, ``in_proj_{qkv,z,b,a}.weight``."""

    #: the reference module's name in a block (HF's)
    module = "linear_attn"
    #: no sliding window (a decoder checks its block kinds' windows)
    window = None
    ops = ("gated_delta_rule_fwd", "gated_delta_rule_bwd", "rms_norm_fwd", "rms_norm_bwd")

    def params(self, config: Any) -> tuple[TensorSpec, ...]:
        n, heads = config.hidden_size, config.linear_num_value_heads
        conv, value = config.linear_conv_width, config.linear_value_width
        return (
            TensorSpec(CONV, (conv, 1, config.linear_conv_kernel_dim)),
            TensorSpec(DT_BIAS, (heads,), decay=False),
            TensorSpec(A_LOG, (heads,), decay=False),
            TensorSpec(NORM, (config.linear_value_head_dim,), decay=False),
            TensorSpec(OUT.weight, (n, value)),
            TensorSpec(QKV.weight, (conv, n)),
            TensorSpec(Z.weight, (value, n)),
            TensorSpec(B.weight, (heads, n)),
            TensorSpec(A.weight, (heads, n)),
        )

    def saved(self, config: Any, batch: int, seq_len: int) -> tuple[TensorSpec, ...]:
        heads, value = config.linear_num_value_heads, config.linear_value_width
        return (
            TensorSpec("qkv", (batch, seq_len, config.linear_conv_width)),
            TensorSpec("z", (batch, seq_len, value)),
            TensorSpec("b", (batch, seq_len, heads)),
            TensorSpec("a", (batch, seq_len, heads)),
            TensorSpec("core", (batch, seq_len, value)),
        )

    def hf_rules(self, config: Any, prefix: str) -> list[Any]:
        return as_is(self.params(config), prefix)

    def reference(self, config: Any) -> Any:
        """``linear_attention_reference.GatedDeltaNet`` of the config's sizes."""
        return linear_attention_reference.GatedDeltaNet(config)

    # -- math ----------------------------------------------------------------------------
    def project(self, config: Any, params: Tensors, h: torch.Tensor, ops: Any) -> Tensors:
        """The four projections of the normed input ``h`` (saved as they are)."""
        return {
            "qkv": QKV.forward(ops, params, h),
            "z": Z.forward(ops, params, h),
            "b": B.forward(ops, params, h),
            "a": A.forward(ops, params, h),
        }

    def _heads(self, config: Any, t: torch.Tensor, heads: int) -> torch.Tensor:
        batch, seq, width = t.shape
        return t.view(batch, seq, heads, width // heads)

    def _rule_inputs(self, config: Any, params: Tensors, projected: Tensors) -> dict[str, Any]:
        """q, k, v, g, beta of the rule from the projections, and what their backward
        takes (the conv's output before its SiLU, the L2 norms' rstd)."""
        conv = _conv(projected["qkv"], params[CONV])
        key, value = config.linear_key_width, config.linear_value_width
        q, k, v = F.silu(conv).split((key, key, value), dim=-1)
        k_heads, v_heads = config.linear_num_key_heads, config.linear_num_value_heads
        q, q_rstd = _l2norm(self._heads(config, q, k_heads))
        k, k_rstd = _l2norm(self._heads(config, k, k_heads))
        a = projected["a"].to(accumulation_dtype(projected["a"].dtype))
        decay = -params[A_LOG].to(a.dtype).exp()
        g = decay * F.softplus(a + params[DT_BIAS].to(a.dtype))
        return {
            "q": q,
            "k": k,
            "v": self._heads(config, v, v_heads),
            "g": g,
            "beta": torch.sigmoid(projected["b"]),
            "conv": conv,
            "rstd": (q_rstd, k_rstd),
        }

    def _gated_norm(
        self, config: Any, params: Tensors, core: torch.Tensor, z: torch.Tensor, ops: Any
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """(rmsnorm(core) * w * silu(z), per head, flattened; the norm's output; its rstd)."""
        heads = config.linear_num_value_heads
        normed, rstd = ops["rms_norm_fwd"](
            self._heads(config, core, heads), params[NORM], config.rms_norm_eps
        )
        gated = normed * F.silu(self._heads(config, z, heads))
        return gated.flatten(2), normed, rstd

    def attend(
        self, config: Any, params: Tensors, projected: Tensors, ops: Any
    ) -> tuple[torch.Tensor, Tensors]:
        """(the output after ``out_proj``, what it saves beside the projections: ``core``)."""
        rule = self._rule_inputs(config, params, projected)
        core = ops["gated_delta_rule_fwd"](rule["q"], rule["k"], rule["v"], rule["g"], rule["beta"])
        core = core.flatten(2)
        del rule
        gated, _, _ = self._gated_norm(config, params, core, projected["z"], ops)
        return OUT.forward(ops, params, gated), {"core": core}

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
        """The gradients of the projections (``project``'s outputs, in its order) from that
        of the output; the other parameters' gradients go into ``grads``."""
        heads = config.linear_num_value_heads
        gated, normed, norm_rstd = self._gated_norm(config, params, saved["core"], saved["z"], ops)
        d_gated, g = OUT.backward(ops, params, gated, d_out)
        grads.update(g)
        del gated
        z = self._heads(config, saved["z"], heads)
        d_gated = d_gated.view_as(normed)
        d_z = _silu_backward(z, d_gated * normed).flatten(2)
        d_core, d_norm = ops["rms_norm_bwd"](
            d_gated * F.silu(z), self._heads(config, saved["core"], heads), norm_rstd, params[NORM]
        )
        grads[NORM] = d_norm
        del d_gated, normed, z
        rule = self._rule_inputs(config, params, saved)
        dq, dk, dv, dg, d_beta = ops["gated_delta_rule_bwd"](
            d_core, rule["q"], rule["k"], rule["v"], rule["g"], rule["beta"]
        )
        del d_core
        # g = -exp(A_log) * softplus(a + dt_bias); beta = sigmoid(b)
        a = saved["a"].to(rule["g"].dtype)
        shifted = a + params[DT_BIAS].to(a.dtype)
        d_a = dg * -params[A_LOG].to(a.dtype).exp() * torch.sigmoid(shifted)
        grads[A_LOG] = (dg * rule["g"]).sum((0, 1)).to(params[A_LOG].dtype)
        grads[DT_BIAS] = d_a.sum((0, 1)).to(params[DT_BIAS].dtype)
        d_b = d_beta * rule["beta"] * (1 - rule["beta"])
        # back through the L2 norms, the SiLU and the convolution
        q_rstd, k_rstd = rule["rstd"]
        key, value = config.linear_key_width, config.linear_value_width
        q_in, k_in, _ = F.silu(rule["conv"]).split((key, key, value), dim=-1)
        k_heads = config.linear_num_key_heads
        dq = _l2norm_backward(self._heads(config, q_in, k_heads), q_rstd, dq).flatten(2)
        dk = _l2norm_backward(self._heads(config, k_in, k_heads), k_rstd, dk).flatten(2)
        d_act = torch.cat((dq, dk, dv.flatten(2)), dim=-1)
        del dq, dk, dv, q_in, k_in
        d_qkv, grads[CONV] = _conv_backward(
            saved["qkv"], params[CONV], _silu_backward(rule["conv"], d_act)
        )
        return d_qkv, d_z, d_b.to(saved["b"].dtype), d_a.to(saved["a"].dtype)

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
        return projections_backward(ops, params, h, (QKV, Z, B, A), d_projected, grads)

    def flops(self, config: Any, batch: int, seq_len: int) -> tuple[int, float]:
        """(the projections' FLOPs, the convolution's and the rule's) of one forward."""
        tokens, n = batch * seq_len, config.hidden_size
        conv, value = config.linear_conv_width, config.linear_value_width
        heads = config.linear_num_value_heads
        projections = 2 * tokens * n * (conv + 2 * value + 2 * heads)
        mixing = 2 * tokens * conv * config.linear_conv_kernel_dim + delta_rule_flops(
            batch, seq_len, heads, config.linear_key_head_dim, config.linear_value_head_dim
        )
        return projections, mixing
