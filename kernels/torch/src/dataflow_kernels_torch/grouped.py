"""Grouped GEMMs for mixture-of-experts FFNs: one matmul per expert over its rows.

Rows (routed token slots) arrive sorted by expert; ``offsets`` (``E + 1`` int32, from 0
to at most ``N``) marks where each expert's rows start and end. Rows past the last offset
belong to no expert: they are not computed (their output rows are left as the output's
buffer held them) and add nothing to a weight gradient. A shard of the experts runs so
over a window of every row of its layer, its own first, in shapes that do not depend on
the routing (``kit.moe.ShardWindow``: a CUDA graph can replay it).

- ``grouped_mm(x, weight, offsets) -> y``: x (N, in), weight (E, out, in), y (N, out) with
  ``y[o_e:o_{e+1}] = x[o_e:o_{e+1}] @ weight[e].T`` (``linear`` per expert).
- ``grouped_mm_wgrad(dy, x, offsets) -> d_weight``: (E, out, in), ``d_weight[e] =
  dy[o_e:o_{e+1}].T @ x[o_e:o_{e+1}]`` (zero for an expert without rows).

The references loop over the experts (any device and dtype, the truth the fast variant
is tested against; the loop reads the offsets on the host). ``grouped_mm_cuda`` /
``grouped_mm_wgrad_cuda`` call ``torch._grouped_mm`` (one launch for all experts) where
its CUDA kernel takes the operands, and fall back to the loop otherwise. What that kernel
takes (``aten/src/ATen/native/GroupedMMUtils.h``, ``cuda/GroupMMCommon.cuh``):

- ``offs``: 1-D **int32**, one entry per group, each the cumulative END of its group (no
  leading 0): ``offsets[1:]`` here; groups may be empty (equal neighbours).
- forward, 2-D x 3-D: ``mat_a`` x (N, in), rows grouped; ``mat_b`` (E, in, out), so the
  stored (E, out, in) weight is passed as ``weight.transpose(-2, -1)`` (a column-major
  view; row-major works too); out (N, out).
- wgrad, 2-D x 2-D (the contraction grouped): ``mat_a`` ``dy.t()`` (out, N) and ``mat_b``
  x (N, in); out (E, out, in). Only a column-major ``mat_a`` with a row-major ``mat_b``
  admits EMPTY groups (an expert no token chose; its gradient comes out 0) and needs no
  per-group 16-byte alignment of the group sizes, so ``dy.t()`` is passed as the
  transposed view of a row-major ``dy``, never made contiguous.
- every operand: bfloat16 on CUDA, ``data_ptr`` 16-byte aligned, its last two dims
  row- or column-major with the other stride a multiple of 16 bytes (8 elements); the
  output's last dim is padded to 16 bytes, so widths that are not multiples of 8 would
  come back strided: those take the loop.

Outputs are in the inputs' dtype (float32 accumulation inside the kernel); nothing
builds an autograd graph.
"""

from __future__ import annotations

import torch


def _check_count(op: str, offsets: torch.Tensor, experts: int) -> None:
    if offsets.dim() != 1 or offsets.numel() != experts + 1:
        raise ValueError(
            f"{op}: offsets must have E + 1 = {experts + 1} entries, got {tuple(offsets.shape)}"
        )


def _check(op: str, offsets: torch.Tensor, rows: int, experts: int) -> None:
    """The offsets' count, and their end within the rows (read on the host)."""
    _check_count(op, offsets, experts)
    if offsets.numel() and int(offsets[-1]) > rows:
        raise ValueError(f"{op}: offsets end at {int(offsets[-1])}, x has {rows} rows")


# The loops run eagerly under torch.compile: they read the offsets on the host (a graph
# break either way), and traced into, each break left a resume function that dynamo
# compiled again for every weight's strides until its recompile limit (qwen3_moe_tiny's
# compiled float32 step took 286 s on the CPU, olmoe_tiny's 105 s; session 17)
@torch.compiler.disable
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


@torch.compiler.disable
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


#: torch._grouped_mm's alignment: 16 bytes (8 bfloat16 elements)
_ALIGN_BYTES = 16


def strides_ok(t: torch.Tensor) -> bool:
    """Whether ``t``'s last two dims are row- or column-major with the other stride a
    multiple of 16 bytes (``check_valid_strides_and_return_transposed`` of torch)."""
    align = _ALIGN_BYTES // t.element_size()
    rows, cols = t.shape[-2:]
    row_stride, col_stride = t.stride()[-2:]
    if col_stride == 1 and row_stride >= max(1, cols):
        return row_stride % align == 0
    if row_stride == 1 and col_stride >= max(1, rows):
        return col_stride % align == 0
    return False


def _tma_ready(t: torch.Tensor) -> bool:
    """Whether ``torch._grouped_mm``'s CUDA kernel takes ``t`` as an operand: bfloat16 on
    CUDA, 2-D or 3-D, 16-byte aligned, ``strides_ok``."""
    return (
        t.is_cuda
        and t.dtype == torch.bfloat16
        and t.dim() in (2, 3)
        and t.data_ptr() % _ALIGN_BYTES == 0
        and strides_ok(t)
    )


def _fast(a: torch.Tensor, b: torch.Tensor, out_width: int, groups: int) -> bool:
    """``torch._grouped_mm`` for ``a`` x ``b`` (the operands as passed to it): both
    operands taken, an output whose rows come back dense (``out_width`` a multiple of 8)
    and at most 1,024 groups (its set-up kernel runs one thread per group)."""
    align = _ALIGN_BYTES // a.element_size()
    return (
        hasattr(torch, "_grouped_mm")
        and _tma_ready(a)
        and _tma_ready(b)
        and out_width % align == 0
        and groups <= 1024
    )


def forward_operands(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor):
    """``(mat_a, mat_b, offs)`` of ``torch._grouped_mm`` for ``grouped_mm``: the rows
    (N, in), the weights as (E, in, out) (a view), the groups' ends (int32)."""
    _check_count("grouped_mm", offsets, weight.shape[0])
    return x, weight.transpose(-2, -1), offsets[1:].to(torch.int32)


def wgrad_operands(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor):
    """``(mat_a, mat_b, offs)`` of ``torch._grouped_mm`` for ``grouped_mm_wgrad``:
    ``dy.t()`` (out, N) (a view), the rows (N, in), the groups' ends (int32)."""
    return dy.t(), x, offsets[1:].to(torch.int32)


def grouped_mm_cuda(x: torch.Tensor, weight: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` (2-D rows x 3-D weights) where it takes the operands, else
    the reference loop."""
    mat_a, mat_b, offs = forward_operands(x, weight, offsets)
    if not _fast(mat_a, mat_b, weight.shape[1], weight.shape[0]):
        return grouped_mm_reference(x, weight, offsets)
    with torch.no_grad():
        return torch._grouped_mm(mat_a, mat_b, offs=offs)


def grouped_mm_wgrad_cuda(dy: torch.Tensor, x: torch.Tensor, offsets: torch.Tensor) -> torch.Tensor:
    """``torch._grouped_mm`` over the rows (2-D by 2-D, grouped along the contraction; a
    column-major ``dy.t()`` with row-major rows, the pair that admits empty groups) where
    it takes the operands, else the loop."""
    mat_a, mat_b, offs = wgrad_operands(dy, x, offsets)
    layouts = mat_a.stride(0) == 1 and mat_b.stride(1) == 1
    if not (layouts and _fast(mat_a, mat_b, x.shape[1], offs.numel())):
        return grouped_mm_wgrad_reference(dy, x, offsets)
    with torch.no_grad():
        return torch._grouped_mm(mat_a, mat_b, offs=offs)
