"""Grouped GEMMs for mixture-of-experts FFNs: one matmul per expert over its rows.

Rows (routed token slots) arrive sorted by expert; ``offsets`` (``E + 1`` int32, from 0
to ``N``) marks where each expert's rows start and end.

- ``grouped_mm(x, weight, offsets) -> y``: x (N, in), weight (E, out, in), y (N, out) with
  ``y[o_e:o_e+1] = x[o_e:o_e+1] @ weight[e].T`` (``linear`` per expert).
- ``grouped_mm_wgrad(dy, x, offsets) -> d_weight``: (E, out, in), ``d_weight[e] =
  dy[o_e:o_e+1].T @ x[o_e:o_e+1]`` (zero for an expert without rows).

The references loop over the experts (any device and dtype, the truth the fast variant
is tested against; the loop reads the offsets on the host). ``grouped_mm_cuda`` /
``grouped_mm_wgrad_cuda`` call ``torch._grouped_mm`` (one launch for all experts, Hopper;
bfloat16 with widths that are multiples of 16) and fall back to the loop for any other
inputs. Outputs are in the inputs' dtype; nothing builds an autograd graph.
"""

from __future__ import annotations

import torch


def _check(op: str, offsets: torch.Tensor, rows: int, experts: int) -> None:
    if offsets.dim() != 1 or offsets.numel() != experts + 1:
        raise ValueError(
            f"{op}: offsets must have E + 1 = {experts + 1} entries, got {tuple(offsets.shape)}"
        )
    if rows and offsets.numel() and int(offsets[-1]) != rows:
        raise ValueError(f"{op}: offsets end at {int(offsets[-1])}, x has {rows} rows")


def grouped_mm_reference(
    x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Expert by expert (see the module docstring)."""
    _check("grouped_mm", offsets, x.shape[0], weight.shape[0])
    bounds = offsets.tolist()
    with torch.no_grad():
        y = x.new_empty(x.shape[0], weight.shape[1])
        for expert in range(weight.shape[0]):
            start, end = bounds[expert], bounds[expert + 1]
            if end > start:
                torch.matmul(x[start:end], weight[expert].t(), out=y[start:end])
        return y


def grouped_mm_wgrad_reference(
    dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor
) -> torch.Tensor:
    """Expert by expert; zero for an expert without rows."""
    experts = offsets.numel() - 1
    _check("grouped_mm_wgrad", offsets, x.shape[0], experts)
    bounds = offsets.tolist()
    with torch.no_grad():
        grad = dy.new_zeros(experts, dy.shape[1], x.shape[1])
        for expert in range(experts):
            start, end = bounds[expert], bounds[expert + 1]
            if end > start:
                torch.matmul(dy[start:end].t(), x[start:end], out=grad[expert])
        return grad


def _fast(*tensors: torch.Tensor) -> bool:
    return (
        hasattr(torch, "_grouped_mm")
        and all(t.is_cuda and t.dtype == torch.bfloat16 for t in tensors)
        and all(size % 16 == 0 for t in tensors for size in t.shape[1:])
    )


def grouped_mm_cuda(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` for bfloat16 CUDA inputs, else the reference loop."""
    if not _fast(x, weight):
        return grouped_mm_reference(x, weight, offsets)
    with torch.no_grad():
        return torch._grouped_mm(x, weight.transpose(-2, -1), offs=offsets[1:].to(torch.int32))


def grouped_mm_wgrad_cuda(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` over the rows (2-D by 2-D, grouped along K), else the loop."""
    if not _fast(dy, x):
        return grouped_mm_wgrad_reference(dy, x, offsets)
    with torch.no_grad():
        return torch._grouped_mm(dy.t(), x, offs=offsets[1:].to(torch.int32))
