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
- ``swiglu_fwd_triton`` / ``swiglu_bwd_triton``: ``silu(gate) * up`` and its two
  gradients, one pass each (the torch variant's backward takes four kernels), float32
  math, contiguous inputs; anything else goes to the torch variant.

Every kernel is elementwise over a flat index (int64 offsets), so each output element is
written by exactly one program: deterministic. The step's bias corrections are Python
floats computed on the host, so nothing synchronizes with the device; when ``lr`` or
``step`` come as device tensors (a step replayed from a CUDA graph) the kernel reads them
and works the corrections out itself.
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from dataflow_kernels_torch import elementwise
from dataflow_kernels_torch.adamw_multi import Scalar, adamw_multi, check_lists

_BLOCK = 1024
_NUM_WARPS = 4
_PARAM_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
#: TRITON_INTERPRET=1 runs the kernels on CPU tensors (how the CPU tests exercise them).
_INTERPRET = os.environ.get("TRITON_INTERPRET") == "1"


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
    p = p * decay
    m = beta1 * m + (1.0 - beta1) * g
    v = beta2 * v + (1.0 - beta2) * g * g
    denom = tl.div_rn(tl.sqrt_rn(v), bias_correction2_sqrt) + eps
    p = p - step_size * tl.div_rn(m, denom)
    tl.store(p_ptr + offsets, p.to(p_ptr.dtype.element_ty), mask=mask)
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
    # lr and the step count read on the device (a replayed CUDA graph's current values);
    # the bias corrections worked out here, in float32, by every program alike.
    lr = tl.load(lr_ptr).to(tl.float32)
    step = tl.load(step_ptr).to(tl.float32)
    bias_correction1 = 1.0 - tl.exp2(step * tl.log2(beta1))
    bias_correction2 = 1.0 - tl.exp2(step * tl.log2(beta2))
    _adamw_math(
        p_ptr, g_ptr, m_ptr, v_ptr, n, beta1, beta2, eps, 1.0 - lr * weight_decay,
        lr / bias_correction1, tl.sqrt_rn(bias_correction2), BLOCK,
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
    rest = []
    on_device = isinstance(step, torch.Tensor) or isinstance(lr, torch.Tensor)
    if on_device:
        device = params[0].device
        lr_t, step_t = (
            v if isinstance(v, torch.Tensor) else torch.full((), float(v), device=device)
            for v in (lr, step)
        )
    else:
        scalars = (
            beta1,
            beta2,
            eps,
            1.0 - lr * weight_decay,
            lr / (1.0 - beta1**step),
            math.sqrt(1.0 - beta2**step),
        )
    for i, tensors in enumerate(zip(params, grads, exp_avgs, exp_avg_sqs, strict=True)):
        if not _adamw_kernel_applies(*tensors):
            rest.append(i)
            continue
        n = tensors[0].numel()
        grid = (triton.cdiv(n, _BLOCK),)
        if on_device:
            _adamw_kernel_device_scalars[grid](
                *tensors, n, beta1, beta2, eps, weight_decay, lr_t, step_t,
                BLOCK=_BLOCK, num_warps=_NUM_WARPS,
            )  # fmt: skip
        else:
            _adamw_kernel[grid](*tensors, n, *scalars, BLOCK=_BLOCK, num_warps=_NUM_WARPS)
    if rest:
        adamw_multi(
            *([lst[i] for i in rest] for lst in (params, grads, exp_avgs, exp_avg_sqs)),
            step=step, lr=lr, beta1=beta1, beta2=beta2, eps=eps, weight_decay=weight_decay,
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
