"""Attention forward/backward on cuDNN's fused kernels (CUDA, 16-bit), the pair
``attention_fwd`` / ``attention_bwd`` of ``attention.py`` documents.

``aten._scaled_dot_product_cudnn_attention`` returns the logsumexp its backward takes,
like flash. It takes grouped key/value heads as they are (fewer than the query heads,
dividing them; PyTorch 2.8 and later, pytorch/pytorch#150337), so grouped-query attention
runs without the repeated copies of K and V the ``torch`` pair makes, and its backward
returns dk and dv with the key/value heads' count, each group's sum. Where it does not
apply (not CUDA, not 16-bit, head_dim not a multiple of 8 or above 128, a sequence of one
token, a sliding window, a mask, segments) both functions are the ``torch`` pair. The two
must be chosen together: they are registered as one priority, so ``load_ops`` never mixes them with another pair.
"""

from __future__ import annotations

import torch

from dataflow_kernels_torch import attention
from dataflow_kernels_torch._support import HALF_DTYPES

_aten = torch.ops.aten


def _applies(q: torch.Tensor) -> bool:
    return (
        q.device.type == "cuda"
        and q.dtype in HALF_DTYPES
        and q.shape[-1] % 8 == 0
        and q.shape[-1] <= 128
        and q.shape[2] > 1  # cuDNN refuses s_q = s_kv = 1
        and hasattr(_aten, "_scaled_dot_product_cudnn_attention")
    )


def attention_fwd_cudnn(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    if window is not None or mask is not None or segments is not None or not _applies(q):
        return attention.attention_fwd(
            q, k, v, causal=causal, scale=scale, window=window, mask=mask, segments=segments
        )
    attention._check(q, k, v)
    with torch.no_grad():
        out, lse, *_ = _aten._scaled_dot_product_cudnn_attention(
            q, k, v, None, True, 0.0, causal, False, scale=scale
        )
    return out, lse.reshape(q.shape[:3]).float().contiguous()


def attention_bwd_cudnn(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    if window is not None or mask is not None or segments is not None or not _applies(q):
        return attention.attention_bwd(
            dout, q, k, v, out, lse, causal=causal, scale=scale, window=window, mask=mask,
            segments=segments,
        )  # fmt: skip
    attention._check(q, k, v)
    attention._check_saved(dout, q, out, lse)
    seq = q.shape[2]
    with torch.no_grad():
        unused = torch.empty((), dtype=torch.int64, device=q.device)
        dq, dk, dv = _aten._scaled_dot_product_cudnn_attention_backward(
            dout, q, k, v, out, lse.unsqueeze(-1), unused, unused, None, None, None,
            seq, seq, 0.0, causal, scale=scale,
        )  # fmt: skip
    if dk.shape != k.shape or dv.shape != v.shape:
        raise RuntimeError(
            f"cuDNN attention backward returned dk {tuple(dk.shape)}, dv {tuple(dv.shape)} "
            f"for k {tuple(k.shape)}, v {tuple(v.shape)}"
        )
    return dq, dk, dv
