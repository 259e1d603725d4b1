"""Adafactor (Shazeer & Stern, "Adafactor: Adaptive Learning Rates with Sublinear Memory
Cost", 2018, Algorithms 4 and 5) without momentum: a matrix keeps the row and column means
of its squared gradients (``rows`` + ``cols`` numbers instead of ``rows x cols``), a vector
keeps the full second moment.

Step ``t`` (from 1), for a gradient ``g``:

- ``beta2_t = 1 - t ** beta2_decay`` (``beta2_decay`` -0.8, section 7.2);
- matrices: ``R = beta2_t R + (1 - beta2_t) mean_cols(g^2)``, ``C`` likewise over rows,
  ``V = R C^T / max(mean(R), eps1)`` (the rank-1 factorization, section 3); vectors:
  ``V = beta2_t V + (1 - beta2_t) g^2``;
- ``U = g / sqrt(max(V, eps1^2))``, clipped to RMS ``clip_threshold`` (section 5:
  ``U / max(1, RMS(U) / d)``);
- relative step size (section 8): ``alpha = max(eps2, RMS(w)) * min(lr, 1 / sqrt(t))``;
- ``w = w (1 - lr wd) - alpha U`` (decoupled decay, as the run's other optimizers).

The conventions (``eps1`` as a floor on the second moment, ``lr`` capping the relative
step) are those ``torch.optim.Adafactor`` documents, so the two agree; the state fields'
shapes follow the parameter (``row_shape``, ``col_shape``, ``full_shape``). ``lr`` and
``step`` may be device tensors (``scalars``)."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataflow_training.optim.scalars import as_float, minimum


def factored(shape: tuple[int, ...]) -> bool:
    return len(shape) >= 2


def row_shape(shape: tuple[int, ...], role: str) -> tuple[int, ...]:
    """``row`` state: the mean over the last dimension of a matrix; nothing for a vector."""
    return tuple(shape[:-1]) if factored(shape) else (0,)


def col_shape(shape: tuple[int, ...], role: str) -> tuple[int, ...]:
    """``col`` state: the mean over the second-last dimension; nothing for a vector."""
    return (*shape[:-2], shape[-1]) if factored(shape) else (0,)


def full_shape(shape: tuple[int, ...], role: str) -> tuple[int, ...]:
    """``variance`` state: a vector's whole second moment; nothing for a matrix."""
    return (0,) if factored(shape) else tuple(shape)


def adafactor_update(
    ops: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Mapping[str, Sequence[torch.Tensor]],
    *,
    step: int,
    policy: Mapping[str, Any],
    weight_decay: float,
    roles: Sequence[str] = (),
) -> None:
    lr, t = as_float(policy["lr"]), as_float(step)
    fresh = t ** policy["beta2_decay"]  # 1 - beta2_t: how much of this step's g^2 enters
    eps1, eps2, clip = policy["eps1"], policy["eps2"], policy["clip_threshold"]
    rho = minimum(lr, t**-0.5)
    rows, cols, fulls = states["row"], states["col"], states["variance"]
    for p, g, r, c, v in zip(params, grads, rows, cols, fulls, strict=True):
        w, g32 = p.float(), g.float()
        square = g32 * g32
        if factored(tuple(p.shape)):
            r32, c32 = r.float(), c.float()
            r32.lerp_(square.mean(dim=-1), fresh)
            c32.lerp_(square.mean(dim=-2), fresh)
            variance = r32.unsqueeze(-1) * c32.unsqueeze(-2)
            variance /= r32.mean(dim=-1, keepdim=True).clamp_min(eps1).unsqueeze(-1)
            r.copy_(r32)
            c.copy_(c32)
        else:
            v32 = v.float()
            v32.lerp_(square, fresh)
            variance = v32.clone()
            v.copy_(v32)
        update = g32 * variance.clamp_min(eps1 * eps1).rsqrt()
        update /= (_rms(update) / clip).clamp_min(1.0)
        alpha = _rms(w).clamp_min(eps2) * rho
        w.mul_(1 - lr * weight_decay).sub_(update * alpha)
        p.copy_(w)


def _rms(x: torch.Tensor) -> torch.Tensor:
    return x.square().mean().sqrt()
