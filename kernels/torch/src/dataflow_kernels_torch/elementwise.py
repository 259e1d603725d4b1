"""Elementwise backward ops: GELU (tanh approximation) and SwiGLU.

- ``gelu_bwd(dy, x) -> dx``: d/dx of ``0.5 x (1 + tanh(c (x + 0.044715 x**3)))``,
  ``c = sqrt(2 / pi)``, times dy.
- ``swiglu_fwd(gate, up) -> silu(gate) * up`` and ``swiglu_bwd(dy, gate, up) ->
  (dgate, dup)``: ``dup = dy * silu(gate)``,
  ``dgate = dy * up * sigmoid(gate) * (1 + gate * (1 - sigmoid(gate)))``.

Fast variants call aten's fused elementwise kernels (``gelu_backward``, ``silu``,
``silu_backward``), which compute in float32 for 16-bit inputs; the references evaluate
the formulas in the statistics dtype (float32; float64 for float64) and round once.
Outputs are like the inputs; nothing builds an autograd graph.
"""

from __future__ import annotations

import math

import torch

from dataflow_kernels_torch._support import stats_dtype

_aten = torch.ops.aten
_GELU_C = math.sqrt(2.0 / math.pi)
_GELU_A = 0.044715


def gelu_bwd(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dx of the tanh-approximation GELU (``aten.gelu_backward(approximate="tanh")``)."""
    _check_same("gelu_bwd", dy=dy, x=x)
    with torch.no_grad():
        return _aten.gelu_backward(dy, x, approximate="tanh")


def gelu_bwd_reference(dy: torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """dx from the derivative of the tanh form, in the statistics dtype."""
    _check_same("gelu_bwd", dy=dy, x=x)
    compute = stats_dtype(x.dtype)
    with torch.no_grad():
        xc = x.to(compute)
        t = torch.tanh(_GELU_C * (xc + _GELU_A * xc**3))
        slope = 0.5 * (1 + t) + 0.5 * xc * (1 - t * t) * _GELU_C * (1 + 3 * _GELU_A * xc * xc)
        return (dy.to(compute) * slope).to(x.dtype)


def swiglu_fwd(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``silu(gate) * up`` (two aten kernels: silu, then an in-place multiply)."""
    _check_same("swiglu_fwd", gate=gate, up=up)
    with torch.no_grad():
        return _aten.silu(gate).mul_(up)


def swiglu_bwd(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (dgate, dup): ``silu_backward(dy * up, gate)`` and ``dy * silu(gate)``."""
    _check_same("swiglu_bwd", dy=dy, gate=gate, up=up)
    with torch.no_grad():
        dgate = _aten.silu_backward(dy * up, gate)
        dup = _aten.silu(gate).mul_(dy)
    return dgate, dup


def swiglu_fwd_reference(gate: torch.Tensor, up: torch.Tensor) -> torch.Tensor:
    """``gate * sigmoid(gate) * up`` in the statistics dtype, rounded once."""
    _check_same("swiglu_fwd", gate=gate, up=up)
    compute = stats_dtype(gate.dtype)
    with torch.no_grad():
        g = gate.to(compute)
        return (g * torch.sigmoid(g) * up.to(compute)).to(gate.dtype)


def swiglu_bwd_reference(
    dy: torch.Tensor, gate: torch.Tensor, up: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """The SwiGLU derivatives (module doc) in the statistics dtype, rounded once."""
    _check_same("swiglu_bwd", dy=dy, gate=gate, up=up)
    compute = stats_dtype(gate.dtype)
    with torch.no_grad():
        g, u, d = gate.to(compute), up.to(compute), dy.to(compute)
        sig = torch.sigmoid(g)
        dgate = d * u * sig * (1 + g * (1 - sig))
        dup = d * g * sig
    return dgate.to(gate.dtype), dup.to(up.dtype)


def _check_same(op: str, **tensors: torch.Tensor) -> None:
    """Every tensor has the first one's shape and dtype (a float dtype)."""
    (first_name, first), *others = tensors.items()
    if not first.is_floating_point():
        raise ValueError(f"{op} expects float tensors, got {first_name} {first.dtype}")
    for name, tensor in others:
        if tensor.shape != first.shape or tensor.dtype != first.dtype:
            raise ValueError(
                f"{op} expects {name} shaped and typed like {first_name} "
                f"({tuple(first.shape)}, {first.dtype}), got ({tuple(tensor.shape)}, "
                f"{tensor.dtype})"
            )
