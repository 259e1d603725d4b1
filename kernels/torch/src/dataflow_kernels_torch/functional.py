"""The differentiable ops, as thin wrappers over ``torch.nn.functional``.

Each function has the exact signature ``dataflow_training.step.ops`` documents, so a family's
math can call it through ``ops[NAME]``; gradients come from torch autograd.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel


def attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool) -> torch.Tensor:
    """Softmax attention of q, k, v (batch, heads, seq, head_dim), scaled by
    1/sqrt(head_dim); PyTorch picks the backend (flash, memory-efficient, cuDNN or math)."""
    return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def attention_math(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
) -> torch.Tensor:
    """``attention`` on PyTorch's math backend only: plain matmul and softmax, forward and
    backward, so two runs give the same bits (no atomics in the backward)."""
    with sdpa_kernel(SDPBackend.MATH):
        return F.scaled_dot_product_attention(q, k, v, is_causal=causal)


def layer_norm(
    x: torch.Tensor, weight: torch.Tensor | None, bias: torch.Tensor | None, eps: float
) -> torch.Tensor:
    """Layer normalization over the last dimension, then ``* weight + bias``."""
    return F.layer_norm(x, (x.shape[-1],), weight, bias, eps)


def rms_norm(x: torch.Tensor, weight: torch.Tensor | None, eps: float) -> torch.Tensor:
    """``x / sqrt(mean(x**2) + eps) * weight`` over the last dimension."""
    return F.rms_norm(x, (x.shape[-1],), weight, eps)


def gelu(x: torch.Tensor) -> torch.Tensor:
    """GELU, tanh approximation (GPT-2's ``gelu_new``)."""
    return F.gelu(x, approximate="tanh")


def silu(x: torch.Tensor) -> torch.Tensor:
    """``x * sigmoid(x)``."""
    return F.silu(x)


def linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``x @ weight.T + bias`` with weight (out, in)."""
    return F.linear(x, weight, bias)
