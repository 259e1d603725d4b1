"""AdamW: one decoupled-weight-decay Adam step, in place on param, exp_avg and exp_avg_sq.

Both variants compute, for the ``step``-th update (1 for the first, as ``torch.optim``
counts), in float32 (float64 when param is float64) whatever the storage dtypes::

    param      *= 1 - lr * weight_decay
    exp_avg     = beta1 * exp_avg + (1 - beta1) * grad
    exp_avg_sq  = beta2 * exp_avg_sq + (1 - beta2) * grad**2
    param      -= lr / (1 - beta1**step) * exp_avg
                  / (sqrt(exp_avg_sq) / sqrt(1 - beta2**step) + eps)

- ``adamw_reference``: that formula with plain tensor ops; states may be stored in a
  lower precision than param (bfloat16 moments of a float32 param), grad in any float dtype.
- ``adamw_fused``: ``torch._fused_adamw_`` (one kernel, the same formula) when param, grad
  and both states share one dtype, are contiguous and the device has the fused kernel
  (CPU and CUDA); otherwise ``adamw_reference``.

Neither synchronizes with the device, so on CUDA they only enqueue work.
"""

from __future__ import annotations

import math

import torch

_FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_FUSED_DEVICES = ("cpu", "cuda")


def adamw_reference(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step with float32 math over any storage dtypes (see the module doc)."""
    _check(param, grad, exp_avg, exp_avg_sq, step)
    compute = torch.float64 if param.dtype == torch.float64 else torch.float32
    with torch.no_grad():
        p = param.to(compute)  # the tensor itself when already in the compute dtype
        m = exp_avg.to(compute)
        v = exp_avg_sq.to(compute)
        g = grad.to(compute)
        p.mul_(1 - lr * weight_decay)
        m.mul_(beta1).add_(g, alpha=1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        bias_correction1 = 1 - beta1**step
        bias_correction2_sqrt = math.sqrt(1 - beta2**step)
        denom = v.sqrt().div_(bias_correction2_sqrt).add_(eps)
        p.addcdiv_(m, denom, value=-lr / bias_correction1)
        for stored, computed in ((param, p), (exp_avg, m), (exp_avg_sq, v)):
            if computed is not stored:
                stored.copy_(computed)


def adamw_fused(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    beta1: float,
    beta2: float,
    eps: float,
    weight_decay: float,
) -> None:
    """One AdamW step through ``torch._fused_adamw_`` when it applies, else the reference."""
    if not fused_applies(param, grad, exp_avg, exp_avg_sq):
        adamw_reference(
            param,
            grad,
            exp_avg,
            exp_avg_sq,
            step=step,
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            eps=eps,
            weight_decay=weight_decay,
        )
        return
    _check(param, grad, exp_avg, exp_avg_sq, step)
    # The kernel reads the step count from a float32 tensor on the parameter's device; a
    # fill launches no copy from the host.
    state_step = torch.full((), float(step), dtype=torch.float32, device=param.device)
    with torch.no_grad():
        torch._fused_adamw_(
            [param],
            [grad],
            [exp_avg],
            [exp_avg_sq],
            [],
            [state_step],
            lr=lr,
            beta1=beta1,
            beta2=beta2,
            weight_decay=weight_decay,
            eps=eps,
            amsgrad=False,
            maximize=False,
        )


def fused_applies(
    param: torch.Tensor, grad: torch.Tensor, exp_avg: torch.Tensor, exp_avg_sq: torch.Tensor
) -> bool:
    """Whether ``torch._fused_adamw_`` can take these tensors: one dtype it supports, one
    device it has a kernel for, all contiguous."""
    tensors = (param, grad, exp_avg, exp_avg_sq)
    return (
        hasattr(torch, "_fused_adamw_")
        and param.dtype in _FUSED_DTYPES
        and param.device.type in _FUSED_DEVICES
        and all(t.dtype == param.dtype and t.device == param.device for t in tensors)
        and all(t.is_contiguous() for t in tensors)
    )


def _check(
    param: torch.Tensor,
    grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    step: int,
) -> None:
    if isinstance(step, bool) or not isinstance(step, int) or step < 1:
        raise ValueError(f"step must be an int >= 1 (the first update is step 1), got {step!r}")
    for name, tensor in (("grad", grad), ("exp_avg", exp_avg), ("exp_avg_sq", exp_avg_sq)):
        if tensor.shape != param.shape:
            raise ValueError(
                f"{name} has shape {tuple(tensor.shape)}, param {tuple(param.shape)}: they "
                "must match"
            )
        if not tensor.is_floating_point():
            raise ValueError(f"{name} must be floating point, got {tensor.dtype}")
