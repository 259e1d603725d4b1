"""Softmax attention for families: heads split and merged, grouped-query attention, and the
fused forward that returns its logsumexp with the backward that takes it.

Backward never runs attention's forward again: it needs q, k, v, the output and the
logsumexp, all saved by forward (``attention_fwd`` / ``attention_bwd`` ops). Grouped-query
attention (fewer key/value heads than query heads) passes the grouped heads to the ops,
whose contract takes them (docs/kernel_registry.md): a variant that cannot run them
grouped repeats each key/value head for its query heads itself and sums their gradients,
one that can (cuDNN's) makes no repeated copies.
"""

from __future__ import annotations

from typing import Any

import torch


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


def attention_forward(
    ops: Any,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool = True,
    scale: float | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """q (batch, heads, seq, dim); k, v (batch, kv_heads, seq, dim) -> (out like q, lse)."""
    _check_groups(q, k)
    return ops["attention_fwd"](q, k, v, causal=causal, scale=scale)


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
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv), dk and dv with k's and v's head counts."""
    _check_groups(q, k)
    return ops["attention_bwd"](d_out, q, k, v, out, lse, causal=causal, scale=scale)
