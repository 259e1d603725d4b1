"""Multi-head latent attention (``mla.py``) as a plain-autograd ``nn.Module``: the truth the
kit's MLA math is checked against, itself held to transformers' ``DeepseekV3ForCausalLM``
by the deepseek family's HF tests.

Written apart from the math (imports only torch): the heads are made whole from the
latents, the rope dims rotated pair by pair where they sit (interleaved pairs ``(x0, x1)``
with ``rope_interleave``, else ``(i, i + r/2)``), YaRN's frequencies and factors written
out again, and the scores softmaxed under an explicit causal mask.
"""

from __future__ import annotations

import math
from typing import Any

import torch
from torch import nn

from dataflow_training.kit.decoder_reference import RMSNorm

#: the latent norms' epsilon (transformers' and DeepSeek's RMSNorm default)
LATENT_EPS = 1e-6


def _mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def frequencies(config: Any) -> tuple[torch.Tensor, float]:
    """float64 (rope / 2,) frequencies and the factor the cos/sin are scaled by."""
    dim, base, yarn = config.qk_rope_head_dim, config.rope_theta, config.rope_yarn
    inv = [base ** (-2 * i / dim) for i in range(dim // 2)]
    if yarn is None:
        return torch.tensor(inv, dtype=torch.float64), 1.0

    def band_edge(turns: float) -> float:
        wavelength_turns = yarn.original_max_position / (turns * 2 * math.pi)
        return dim * math.log(wavelength_turns) / (2 * math.log(base))

    low = max(math.floor(band_edge(yarn.beta_fast)), 0)
    high = min(math.ceil(band_edge(yarn.beta_slow)), dim - 1)
    if high == low:
        high = high + 0.001
    out = []
    for i, freq in enumerate(inv):
        t = min(max((i - low) / (high - low), 0.0), 1.0)  # 0: keep, 1: interpolate
        out.append(t * freq / yarn.factor + (1 - t) * freq)
    if yarn.mscale and yarn.mscale_all_dim:
        factor = _mscale(yarn.factor, yarn.mscale) / _mscale(yarn.factor, yarn.mscale_all_dim)
    else:
        factor = _mscale(yarn.factor, 1.0)
    return torch.tensor(out, dtype=torch.float64), factor


def rotate_pairs(x: torch.Tensor, config: Any) -> torch.Tensor:
    """Rotate the rope dims (..., seq, rope) by position, pair ``p`` by angle pos * f_p,
    the pairs where ``rope_interleave`` says they are."""
    inv, factor = frequencies(config)
    angles = torch.arange(x.shape[-2], dtype=torch.float64)[:, None] * inv[None, :]
    cos, sin = (angles.cos() * factor).to(x), (angles.sin() * factor).to(x)
    half = inv.numel()
    if config.rope_interleave:
        first, second = x[..., 0::2], x[..., 1::2]
    else:
        first, second = x[..., :half], x[..., half:]
    a, b = first * cos - second * sin, second * cos + first * sin
    if config.rope_interleave:
        return torch.stack((a, b), dim=-1).flatten(-2)
    return torch.cat((a, b), dim=-1)


class LatentAttention(nn.Module):
    """MLA (``mla.py``): parameters named as HF names them."""

    def __init__(self, config: Any) -> None:
        super().__init__()
        self.config = config
        n, heads = config.hidden_size, config.num_attention_heads
        qk = config.qk_nope_head_dim + config.qk_rope_head_dim
        if config.q_lora_rank is None:
            self.q_proj = nn.Linear(n, heads * qk, bias=False)
        else:
            self.q_a_proj = nn.Linear(n, config.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(config.q_lora_rank, LATENT_EPS)
            self.q_b_proj = nn.Linear(config.q_lora_rank, heads * qk, bias=False)
        self.kv_a_proj_with_mqa = nn.Linear(
            n, config.kv_lora_rank + config.qk_rope_head_dim, bias=False
        )
        self.kv_a_layernorm = RMSNorm(config.kv_lora_rank, LATENT_EPS)
        self.kv_b_proj = nn.Linear(
            config.kv_lora_rank, heads * (config.qk_nope_head_dim + config.v_head_dim), bias=False
        )
        self.o_proj = nn.Linear(heads * config.v_head_dim, n, bias=False)

    def scale(self) -> float:
        c = self.config
        scale = 1 / math.sqrt(c.qk_nope_head_dim + c.qk_rope_head_dim)
        if c.rope_yarn is not None and c.rope_yarn.mscale_all_dim:
            scale = scale * _mscale(c.rope_yarn.factor, c.rope_yarn.mscale_all_dim) ** 2
        return scale

    def heads(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """q, k, v (batch, heads, seq, width) of x, rotated."""
        c = self.config
        batch, seq, _ = x.shape
        heads, nope = c.num_attention_heads, c.qk_nope_head_dim
        if c.q_lora_rank is None:
            q = self.q_proj(x)
        else:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x)))
        q = q.view(batch, seq, heads, -1).transpose(1, 2)
        kv_a = self.kv_a_proj_with_mqa(x)
        latent, k_rope = kv_a[..., : c.kv_lora_rank], kv_a[..., c.kv_lora_rank :]
        kv = self.kv_b_proj(self.kv_a_layernorm(latent)).view(batch, seq, heads, -1)
        kv = kv.transpose(1, 2)
        k_rope = rotate_pairs(k_rope, c)[:, None].expand(batch, heads, seq, c.qk_rope_head_dim)
        q = torch.cat((q[..., :nope], rotate_pairs(q[..., nope:], c)), dim=-1)
        k = torch.cat((kv[..., :nope], k_rope), dim=-1)
        return q, k, kv[..., nope:]

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        batch, seq, _ = x.shape
        q, k, v = self.heads(x)
        scores = (q @ k.transpose(-2, -1)) * self.scale()
        causal = torch.ones(seq, seq, dtype=torch.bool, device=x.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        probs = torch.softmax(scores.to(torch.promote_types(scores.dtype, torch.float32)), -1)
        out = probs.to(v.dtype) @ v
        return self.o_proj(out.transpose(1, 2).reshape(batch, seq, -1))
