"""Gated DeltaNet as one plain-autograd ``nn.Module``: the truth ``linear_attention.
GatedDeltaNet``'s math is checked against (``dataflow verify``'s step level, the families'
HF tests).

Isolated as ``decoder_reference`` is: it imports only torch and shares no code with the
kit's math or the kernels (no ops, no chunks): the convolution is ``F.conv1d``, and the
gated delta rule runs token by token as its definition says, so a bug in a chunked kernel
or a hand-written backward cannot hide in it. Parameter names are HF's
(``Qwen3_5GatedDeltaNet``), in its order. ``A_log`` starts at ``log`` of 1 .. 16 spread over
the heads and ``dt_bias`` at 1 (HF draws ``A`` uniformly from that range); the
convolution's weight is a matrix ``DecoderReference.init_weights`` draws from N(0, std).
"""

from __future__ import annotations

from typing import Any

import torch
import torch.nn.functional as F
from torch import nn


class GatedNorm(nn.Module):
    """``rmsnorm(x) * weight * silu(z)`` over the last dim (weight starts at 1)."""

    def __init__(self, width: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(width))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        normed = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
        return normed * self.weight * F.silu(z)


def l2norm(x: torch.Tensor) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedDeltaNet(nn.Module):
    """``out_proj(norm(delta_rule(...), z))`` of ``config``'s Gated DeltaNet sizes."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = c = config
        n, heads = c.hidden_size, c.linear_num_value_heads
        key = c.linear_num_key_heads * c.linear_key_head_dim
        value = heads * c.linear_value_head_dim
        self.widths = (key, key, value)
        conv = 2 * key + value
        kernel = c.linear_conv_kernel_dim
        self.conv1d = nn.Conv1d(conv, conv, kernel, groups=conv, padding=kernel - 1, bias=False)
        self.dt_bias = nn.Parameter(torch.ones(heads))
        self.A_log = nn.Parameter(torch.linspace(1.0, 16.0, heads).log())
        self.norm = GatedNorm(c.linear_value_head_dim, c.rms_norm_eps)
        self.out_proj = nn.Linear(value, n, bias=False)
        self.in_proj_qkv = nn.Linear(n, conv, bias=False)
        self.in_proj_z = nn.Linear(n, value, bias=False)
        self.in_proj_b = nn.Linear(n, heads, bias=False)
        self.in_proj_a = nn.Linear(n, heads, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        c = self.config
        batch, seq, _ = x.shape
        mixed = self.conv1d(self.in_proj_qkv(x).transpose(1, 2))[..., :seq]
        q, k, v = F.silu(mixed).transpose(1, 2).split(self.widths, dim=-1)
        v_heads, k_heads = c.linear_num_value_heads, c.linear_num_key_heads
        q = l2norm(q.reshape(batch, seq, k_heads, -1))
        k = l2norm(k.reshape(batch, seq, k_heads, -1))
        v = v.reshape(batch, seq, v_heads, -1)
        beta = torch.sigmoid(self.in_proj_b(x))
        g = -self.A_log.exp() * F.softplus(self.in_proj_a(x) + self.dt_bias)
        core = self.rule(q, k, v, g, beta)
        z = self.in_proj_z(x).reshape(batch, seq, v_heads, -1)
        return self.out_proj(self.norm(core, z).reshape(batch, seq, -1))

    def rule(self, q, k, v, g, beta) -> torch.Tensor:
        """The gated delta rule token by token: q, k (batch, seq, k_heads, k_dim), each key
        head for its group of value heads; v (batch, seq, v_heads, v_dim); g, beta (batch,
        seq, v_heads) -> (batch, seq, v_heads, v_dim)."""
        group = v.shape[2] // k.shape[2]
        q, k = q.repeat_interleave(group, 2), k.repeat_interleave(group, 2)
        scale = q.shape[-1] ** -0.5
        state = q.new_zeros(q.shape[0], v.shape[2], q.shape[-1], v.shape[-1])
        outs = []
        for t in range(q.shape[1]):  # S = a S; S += beta k (v - S^T k)^T; o = scale S^T q
            state = state * g[:, t].exp()[..., None, None]
            error = v[:, t] - torch.einsum("bhkv,bhk->bhv", state, k[:, t])
            state = state + torch.einsum("bhk,bhv->bhkv", k[:, t], beta[:, t, :, None] * error)
            outs.append(scale * torch.einsum("bhkv,bhk->bhv", state, q[:, t]))
        return torch.stack(outs, 1)
