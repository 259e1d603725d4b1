"""Triton kernels for CUDA: the one-pass AdamW of mixed storage dtypes and SwiGLU.

Registered only where triton is installed (``plugin.py``), for ``cuda`` only; this module
imports triton, so only a variant's ``load()`` imports it.

- ``adamw_multi_triton``: ``adamw_multi`` (``adamw_multi.py``) where each tensor whose
  param, grad and states do not all share one dtype (bfloat16 params and grads with
  float32 states, the common case) is updated by one kernel launch that reads p, g, m, v
  once and writes p, m, v once, in float32: 2+2+4+4 bytes read and 2+4+4 written per
  bfloat16 parameter, where the torch variant first makes float32 copies. Tensors of one
  dtype throughout, float64 ones and non-contiguous ones go to the torch variant (its
  ``torch._fused_adamw_`` groups).
- ``adamw_compensated_multi_triton``: ``adamw_compensated_multi`` in one pass per tensor
  of 16-bit params: reads p, g, m, v and the compensation c once, updates ``p + c`` in
  float32 and writes p (rounded to nearest even), m, v and c (what the rounding lost)
  once: 18 bytes per parameter of ``--precision bf16`` where the torch variant's float32
  copies move about 96. Float32 params (nothing to compensate in a policy), float64 and
  non-contiguous tensors go to the torch variant. Untested on a GPU so far (its tests are
  marked gpu); the CPU interpreter rounds 16-bit stores by truncation, so its results
  there differ from CUDA's by a unit.
- ``swiglu_fwd_triton`` / ``swiglu_bwd_triton``: ``silu(gate) * up`` and its two
  gradients, one pass each (the torch variant's backward takes four kernels), float32
  math, contiguous inputs; anything else goes to the torch variant.
- ``rows_add_masked_triton`` / ``rows_put_masked_triton`` (``rows.py``): an MoE shard's
  window rows added into their tokens (float32 atomics) or written into their places,
  the rows not the shard's never read; (16, 256) tiles, the size of the elementwise
  kernels' blocks, not tuned.

Every kernel but ``rows_add_masked``'s (atomics: a token's rows are summed in any order)
is elementwise over a flat index (int64 offsets), so each output element is written by
exactly one program: deterministic. The step's bias corrections are Python
floats computed on the host, so nothing synchronizes with the device; when ``lr`` or
``step`` come as device tensors (a step replayed from a CUDA graph) the kernel reads them
and works the corrections out itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Callable, Sequence

import torch
import triton
import triton.language as tl

from dataflow_kernels_torch import elementwise
from dataflow_kernels_torch import rows as rows_module
from dataflow_kernels_torch.adamw_multi import (
    Scalar,
    adamw_compensated_multi,
    adamw_multi,
    check_compensations,
    check_lists,
)

_BLOCK = 1024
_NUM_WARPS = 4
_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: TRITON_INTERPRET=1 runs the kernels on CPU tensors (how the CPU tests exercise them).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


@triton.jit
def _adam_update(p, g, m, v, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt):
    # the adamw formula in float32 on loaded values: (param, exp_avg, exp_avg_sq) after
    p = p * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    return p, m, v


@triton.jit
def _device_hyper(lr_ptr, step_ptr, beta1, beta2, weight_decay):
    # lr and the step count read on the device (a replayed CUDA graph's current values);
    # (decay, step_size, sqrt of bias correction 2) worked out here, in float32, by every
    # program alike.
    lr = tl.load(lr_ptr).to(tl.float32)
    step = tl.load(step_ptr).to(tl.float32)
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias_correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    return 1.0 - lr * weight_decay, lr / bias_correction1, tl.sqrt_rn(bias_correction2)


@triton.jit
def _adamw_math(
    p_ptr, g_ptr, m_ptr, v_ptr, n, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt,
    BLOCK: tl.constexpr,
):  # fmt: skip
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask).to(tl.float32)
    p, m, v = _adam_update(p, g, m, v, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_compensated_math(
    p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, n, beta1, beta2, eps, decay, step_size,
    bias_correction2_sqrt, BLOCK: tl.constexpr,
):  # fmt: skip
    # the update of p + c in float32, rounded to nearest even into p, the loss into c
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    p = tl.load(p_ptr + offsets, mask=mask).to(tl.float32)
    p = p + tl.load(c_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(g_ptr + offsets, mask=mask).to(tl.float32)
    m = tl.load(m_ptr + offsets, mask=mask).to(tl.float32)
    v = tl.load(v_ptr + offsets, mask=mask).to(tl.float32)
    p, m, v = _adam_update(p, g, m, v, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt)
    rounded = p.to(p_ptr.dtype.element_ty, fp_downcast_rounding="rtne")  # 16-bit params
    tl.store(p_ptr + offsets, rounded, mask=mask)
    tl.store(c_ptr + offsets, (p - rounded.to(tl.float32)).to(c_ptr.dtype.element_ty), mask=mask)
    tl.store(m_ptr + offsets, m.to(m_ptr.dtype.element_ty), mask=mask)
    tl.store(v_ptr + offsets, v.to(v_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _adamw_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, n, beta1, beta2, eps, decay, step_size, bias_correction2_sqrt,
    BLOCK: tl.constexpr,
):  # fmt: skip
    _adamw_math(
        p_ptr, g_ptr, m_ptr, v_ptr, n, beta1, beta2, eps, decay, step_size,
        bias_correction2_sqrt, BLOCK,
    )  # fmt: skip


@triton.jit
def _adamw_kernel_device_scalars(
    p_ptr, g_ptr, m_ptr, v_ptr, n, beta1, beta2, eps, weight_decay, lr_ptr, step_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    decay, step_size, bc2_sqrt = _device_hyper(lr_ptr, step_ptr, beta1, beta2, weight_decay)
    _adamw_math(
        p_ptr, g_ptr, m_ptr, v_ptr, n, beta1, beta2, eps, decay, step_size, bc2_sqrt, BLOCK
    )  # fmt: skip


@triton.jit
def _adamw_compensated_kernel(
    p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, n, beta1, beta2, eps, decay, step_size,
    bias_correction2_sqrt, BLOCK: tl.constexpr,
):  # fmt: skip
    _adamw_compensated_math(
        p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, n, beta1, beta2, eps, decay, step_size,
        bias_correction2_sqrt, BLOCK,
    )  # fmt: skip


@triton.jit
def _adamw_compensated_kernel_device_scalars(
    p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, n, beta1, beta2, eps, weight_decay, lr_ptr, step_ptr,
    BLOCK: tl.constexpr,
):  # fmt: skip
    decay, step_size, bc2_sqrt = _device_hyper(lr_ptr, step_ptr, beta1, beta2, weight_decay)
    _adamw_compensated_math(
        p_ptr, g_ptr, m_ptr, v_ptr, c_ptr, n, beta1, beta2, eps, decay, step_size, bc2_sqrt,
        BLOCK,
    )  # fmt: skip


@triton.jit
def _swiglu_fwd_kernel(gate_ptr, up_ptr, out_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    g = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    out = g * tl.sigmoid(g) * u
    tl.store(out_ptr + offsets, out.to(out_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _swiglu_bwd_kernel(dy_ptr, gate_ptr, up_ptr, dgate_ptr, dup_ptr, n, BLOCK: tl.constexpr):
    offsets = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    mask = offsets < n
    dy = tl.load(dy_ptr + offsets, mask=mask).to(tl.float32)
    g = tl.load(gate_ptr + offsets, mask=mask).to(tl.float32)
    u = tl.load(up_ptr + offsets, mask=mask).to(tl.float32)
    sig = tl.sigmoid(g)
    dgate = dy * u * sig * (1.0 + g * (1.0 - sig))
    dup = dy * g * sig
    tl.store(dgate_ptr + offsets, dgate.to(dgate_ptr.dtype.element_ty), mask=mask)
    tl.store(dup_ptr + offsets, dup.to(dup_ptr.dtype.element_ty), mask=mask)


#: a program of the masked row kernels takes a (rows, columns) tile of this size
_ROWS_TILE = (16, 256)


@triton.jit
def _rows_tile(valid_ptr, n_rows, width, BLOCK_R: tl.constexpr, BLOCK_C: tl.constexpr):
    # the program's (rows, columns) tile: its row indices, which are valid, its columns
    # and the elements that move (a valid row's, inside the width)
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = tl.load(valid_ptr + r, mask=r < n_rows, other=0) != 0
    c = tl.program_id(1).to(tl.int64) * BLOCK_C + tl.arange(0, BLOCK_C)
    return r, valid, c, valid[:, None] & (c < width)[None, :]


@triton.jit
def _rows_add_kernel(
    rows_ptr,
    into_ptr,
    valid_ptr,
    weights_ptr,
    out_ptr,
    n_rows,
    width,
    row_stride,
    HAS_WEIGHTS: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # the valid rows of the tile alone load, scale and add (a row not valid moves nothing)
    r, valid, c, mask = _rows_tile(valid_ptr, n_rows, width, BLOCK_R, BLOCK_C)
    x = tl.load(rows_ptr + r[:, None] * row_stride + c[None, :], mask=mask, other=0.0)
    x = x.to(tl.float32)
    if HAS_WEIGHTS:
        x = x * tl.load(weights_ptr + r, mask=valid, other=0.0).to(tl.float32)[:, None]
    dest = tl.load(into_ptr + r, mask=valid, other=0)
    tl.atomic_add(out_ptr + dest[:, None] * width + c[None, :], x, mask=mask)


@triton.jit
def _rows_put_kernel(
    values_ptr,
    index_ptr,
    valid_ptr,
    target_ptr,
    n_rows,
    width,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    r, valid, c, mask = _rows_tile(valid_ptr, n_rows, width, BLOCK_R, BLOCK_C)
    x = tl.load(values_ptr + r[:, None] * width + c[None, :], mask=mask)
    dest = tl.load(index_ptr + r, mask=valid, other=0)
    target = target_ptr + dest[:, None] * width + c[None, :]
    tl.store(target, x.to(target_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _rows_gather_kernel(
    source_ptr,
    index_ptr,
    valid_ptr,
    out_ptr,
    n_rows,
    width,
    source_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # a valid row of the tile alone loads its source row and stores it; the others move
    # nothing (their rows of out keep what the new buffer held)
    r, valid, c, mask = _rows_tile(valid_ptr, n_rows, width, BLOCK_R, BLOCK_C)
    src = tl.load(index_ptr + r, mask=valid, other=0)
    x = tl.load(source_ptr + src[:, None] * source_stride + c[None, :], mask=mask)
    tl.store(out_ptr + r[:, None] * width + c[None, :], x, mask=mask)


@triton.jit
def _swiglu_rows_bwd_kernel(
    gate_up_ptr,
    d_act_ptr,
    weights_ptr,
    valid_ptr,
    act_ptr,
    d_gate_up_ptr,
    d_weights_ptr,
    n_rows,
    inner,
    gate_up_stride,
    d_act_stride,
    BLOCK_R: tl.constexpr,
    BLOCK_C: tl.constexpr,
):
    # a valid row's SwiGLU, its routing weight's gradient (summed over the row in float32)
    # and its gate and up gradients, in one pass over the row; a row not valid moves nothing
    r = tl.program_id(0).to(tl.int64) * BLOCK_R + tl.arange(0, BLOCK_R)
    valid = tl.load(valid_ptr + r, mask=r < n_rows, other=0) != 0
    w = tl.load(weights_ptr + r, mask=valid, other=0.0).to(tl.float32)[:, None]
    acc = tl.zeros((BLOCK_R,), dtype=tl.float32)
    for start in range(0, inner, BLOCK_C):
        c = start + tl.arange(0, BLOCK_C)
        mask = valid[:, None] & (c < inner)[None, :]
        row = gate_up_ptr + r[:, None] * gate_up_stride + c[None, :]
        g = tl.load(row, mask=mask, other=0.0).to(tl.float32)
        u = tl.load(row + inner, mask=mask, other=0.0).to(tl.float32)
        d = tl.load(d_act_ptr + r[:, None] * d_act_stride + c[None, :], mask=mask, other=0.0)
        d = d.to(tl.float32)
        sig = tl.sigmoid(g)
        silu = g * sig
        acc += tl.sum(silu * u * d, axis=1)
        tl.store(
            act_ptr + r[:, None] * inner + c[None, :],
            (silu * u * w).to(act_ptr.dtype.element_ty),
            mask=mask,
        )
        dw = d * w
        out = d_gate_up_ptr + r[:, None] * (2 * inner) + c[None, :]
        dgate = dw * u * sig * (1.0 + g * (1.0 - sig))
        tl.store(out, dgate.to(d_gate_up_ptr.dtype.element_ty), mask=mask)
        tl.store(out + inner, (dw * silu).to(d_gate_up_ptr.dtype.element_ty), mask=mask)
    tl.store(d_weights_ptr + r, acc, mask=valid)


def adamw_multi_triton(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    *,
    step: Scalar,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step: the Triton kernel for mixed-dtype tensors, fused groups for the rest."""
    check_lists(params, grads, exp_avgs, exp_avg_sqs, step)
    _per_tensor(
        (params, grads, exp_avgs, exp_avg_sqs), _adamw_kernel_applies,
        (_adamw_kernel, _adamw_kernel_device_scalars), adamw_multi, step=step, lr=lr,
        beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
    )  # fmt: skip


def adamw_compensated_multi_triton(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    compensations: Sequence[torch.Tensor],
    *,
    step: Scalar,
    lr: Scalar,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """``adamw_compensated_multi`` (``adamw_multi.py``): one Triton pass per tensor, any
    storage dtypes of ``_PARAM_DTYPES``; the rest (non-contiguous, float64) as the torch
    variant."""
    check_compensations(params, compensations)
    check_lists(params, grads, exp_avgs, exp_avg_sqs, step)
    _per_tensor(
        (params, grads, exp_avgs, exp_avg_sqs, compensations), _compensated_kernel_applies,
        (_adamw_compensated_kernel, _adamw_compensated_kernel_device_scalars),
        adamw_compensated_multi, step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps,
        weight_decay=weight_decay,
    )  # fmt: skip


def _per_tensor(
    lists: tuple[Sequence[torch.Tensor], ...],
    applies: Callable[..., bool],
    kernels: tuple,
    fallback: Callable[..., None],
    *,
    step: Scalar,
    lr: Scalar,
    **hyper: float,
) -> None:
    """One launch of a kernel of ``kernels`` (``_hyper``) per tensor (one from each of the
    parallel ``lists``) that ``applies`` takes; the rest through ``fallback``, the torch
    variant, with the same arguments."""
    kernel, scalars = _hyper(kernels, lists[0], step, lr, **hyper)
    rest = []
    for i, tensors in enumerate(zip(*lists, strict=True)):
        if not applies(*tensors):
            rest.append(i)
            continue
        n = tensors[0].numel()
        kernel[(triton.cdiv(n, _BLOCK),)](*tensors, n, *scalars, BLOCK=_BLOCK, num_warps=_NUM_WARPS)
    if rest:
        fallback(*([lst[i] for i in rest] for lst in lists), step=step, lr=lr, **hyper)


def _hyper(
    kernels: tuple, params: Sequence[torch.Tensor], step: Scalar, lr: Scalar, *, beta1: float,
    beta2: float, eps: float, weight_decay: float,
) -> tuple:  # fmt: skip
    """``(kernel, its scalar arguments after n)``: of ``kernels`` (host scalars, device
    scalars) the first with the bias corrections worked out here, or the second, which
    reads ``lr`` and ``step`` on the device, when either is a device tensor."""
    if isinstance(step, torch.Tensor) or isinstance(lr, torch.Tensor):
        device = params[0].device
        lr_t, step_t = (
            v if isinstance(v, torch.Tensor) else torch.full((), float(v), device=device)
            for v in (lr, step)
        )
        return kernels[1], (beta1, beta2, eps, weight_decay, lr_t, step_t)
    return kernels[0], (
        beta1, beta2, eps, 1.0 - lr * weight_decay, lr / (1.0 - beta1**step),
        math.sqrt(1.0 - beta2**step),
    )  # fmt: skip


def swiglu_fwd_triton(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` in one pass (float32 math)."""
    if not _elementwise_applies(gate, up):
        return elementwise.swiglu_fwd(gate, up)
    out = torch.empty_like(gate)
    n = gate.numel()
    _swiglu_fwd_kernel[(triton.cdiv(n, _BLOCK),)](gate, up, out, n, BLOCK=_BLOCK)
    return out


def swiglu_bwd_triton(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dgate, dup) in one pass (float32 math)."""
    if not _elementwise_applies(dy, gate, up):
        return elementwise.swiglu_bwd(dy, gate, up)
    dgate, dup = torch.empty_like(gate), torch.empty_like(up)
    n = gate.numel()
    _swiglu_bwd_kernel[(triton.cdiv(n, _BLOCK),)](dy, gate, up, dgate, dup, n, BLOCK=_BLOCK)
    return dgate, dup


def rows_add_masked_triton(
    rows: torch.Tensor,
    into: torch.Tensor,
    valid: torch.Tensor,
    weights: torch.Tensor | None,
    count: int,
    *,
    slices: int = 1,
) -> torch.Tensor:
    """``rows_add_masked`` (``rows.py``) in one pass where only the valid rows move (float32
    atomics; ``slices`` is not needed: no float32 copy of the rows is made); float64 rows,
    rows whose columns are not contiguous and CPU tensors go to the torch variant."""
    if not _rows_add_applies(rows, into, valid, weights):
        return rows_module.rows_add_masked(rows, into, valid, weights, count, slices=slices)
    width = rows.shape[1]
    out = torch.zeros(count, width, dtype=torch.float32, device=rows.device)
    if rows.shape[0] and width:
        block_r, block_c = _ROWS_TILE
        grid = (triton.cdiv(rows.shape[0], block_r), triton.cdiv(width, block_c))
        _rows_add_kernel[grid](
            rows, into, valid.view(torch.uint8), rows if weights is None else weights, out,
            rows.shape[0], width, rows.stride(0),
            HAS_WEIGHTS=weights is not None, BLOCK_R=block_r, BLOCK_C=block_c,
        )  # fmt: skip
    return out


def rows_put_masked_triton(
    values: torch.Tensor, index: torch.Tensor, valid: torch.Tensor, target: torch.Tensor
) -> None:
    """``rows_put_masked`` (``rows.py``) in one pass: only the valid rows are read and
    written; anything but contiguous CUDA tensors goes to the torch variant."""
    rows_module.check_put(values, index, valid, target)
    if not (
        _on_kernel_device(values)
        and values.device == target.device == index.device == valid.device
        and all(t.is_contiguous() for t in (values, index, valid, target))
        and index.dtype == torch.int64
    ):
        return rows_module.rows_put_masked(values, index, valid, target)
    width = values[0].numel() if values.shape[0] else 0
    if values.shape[0] and width:
        block_r, block_c = _ROWS_TILE
        grid = (triton.cdiv(values.shape[0], block_r), triton.cdiv(width, block_c))
        _rows_put_kernel[grid](
            values, index, valid.view(torch.uint8), target, values.shape[0], width,
            BLOCK_R=block_r, BLOCK_C=block_c,
        )  # fmt: skip
    return None


def rows_gather_masked_triton(
    source: torch.Tensor, index: torch.Tensor, valid: torch.Tensor
) -> torch.Tensor:
    """``rows_gather_masked`` (``rows.py``) in one pass: only the valid rows are read and
    written (the others of the result are left as the new buffer held them); source rows
    whose columns are strided and CPU tensors go to the torch variant."""
    rows_module.check_gather(source, index, valid)
    if not (
        _on_kernel_device(source)
        and source.device == index.device == valid.device
        and source.stride(1) == 1
        and index.is_contiguous()
        and valid.is_contiguous()
    ):
        return rows_module.rows_gather_masked(source, index, valid)
    width = source.shape[1]
    out = torch.empty(index.shape[0], width, dtype=source.dtype, device=source.device)
    if index.shape[0] and width:
        block_r, block_c = _ROWS_TILE
        grid = (triton.cdiv(index.shape[0], block_r), triton.cdiv(width, block_c))
        _rows_gather_kernel[grid](
            source, index, valid.view(torch.uint8), out, index.shape[0], width,
            source.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
        )  # fmt: skip
    return out


def swiglu_rows_bwd_triton(
    gate_up: torch.Tensor, d_act: torch.Tensor, weights: torch.Tensor, valid: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``swiglu_rows_bwd`` (``rows.py``) in one pass over the valid rows (float32 math,
    each output rounded once; the rows not valid are left as the new buffers held them);
    float64 rows, columns that are strided and CPU tensors go to the torch variant."""
    rows_module.check_swiglu_rows(gate_up, d_act, weights, valid)
    if not (
        _on_kernel_device(gate_up)
        and gate_up.dtype != torch.float64
        and gate_up.device == d_act.device == weights.device == valid.device
        and gate_up.stride(1) == 1
        and d_act.stride(1) == 1
        and weights.is_contiguous()
        and valid.is_contiguous()
    ):
        return rows_module.swiglu_rows_bwd(gate_up, d_act, weights, valid)
    n_rows, inner = d_act.shape
    act = torch.empty(n_rows, inner, dtype=gate_up.dtype, device=gate_up.device)
    d_gate_up = torch.empty(n_rows, 2 * inner, dtype=gate_up.dtype, device=gate_up.device)
    d_weights = torch.empty(n_rows, dtype=torch.float32, device=gate_up.device)
    if n_rows and inner:
        block_r, block_c = _ROWS_TILE
        _swiglu_rows_bwd_kernel[(triton.cdiv(n_rows, block_r),)](
            gate_up, d_act, weights, valid.view(torch.uint8), act, d_gate_up, d_weights,
            n_rows, inner, gate_up.stride(0), d_act.stride(0), BLOCK_R=block_r, BLOCK_C=block_c,
        )  # fmt: skip
    return act, d_gate_up, d_weights


def _rows_add_applies(rows, into, valid, weights) -> bool:
    rows_module.check_add(rows, into, valid, weights)
    others = (into, valid) if weights is None else (into, valid, weights)
    return (
        rows.dtype in _PARAM_DTYPES
        and _on_kernel_device(rows)
        and (rows.shape[1] <= 1 or rows.stride(1) == 1)
        and into.dtype == torch.int64
        and all(t.device == rows.device and t.is_contiguous() for t in others)
    )


def _on_kernel_device(t: torch.Tensor) -> bool:
    return t.device.type == "cuda" or (_INTERPRET and t.device.type == "cpu")


def _adamw_kernel_applies(
    p: torch.Tensor, g: torch.Tensor, m: torch.Tensor, v: torch.Tensor
) -> bool:
    tensors = (p, g, m, v)
    return (
        len({t.dtype for t in tensors}) > 1  # one dtype throughout: the fused group is as fast
        and p.dtype in _PARAM_DTYPES
        and g.dtype in _PARAM_DTYPES
        and m.dtype in _PARAM_DTYPES
        and v.dtype in _PARAM_DTYPES
        and p.numel() > 0
        and all(_on_kernel_device(t) and t.is_contiguous() for t in tensors)
    )


def _compensated_kernel_applies(*tensors: torch.Tensor) -> bool:
    return (
        tensors[0].numel() > 0
        and tensors[0].dtype in (torch.bfloat16, torch.float16)  # rounded to nearest even
        and all(t.dtype in _PARAM_DTYPES for t in tensors)
        and all(_on_kernel_device(t) and t.is_contiguous() for t in tensors)
    )


def _elementwise_applies(*tensors: torch.Tensor) -> bool:
    first = tensors[0]
    return (
        first.dtype in _PARAM_DTYPES
        and first.numel() > 0
        and all(
            t.shape == first.shape
            and t.dtype == first.dtype
            and t.device == first.device
            and t.is_contiguous()
            and _on_kernel_device(t)
            for t in tensors
        )
    )
