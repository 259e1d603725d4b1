"""Per-step scalars as the updates take them: ``lr`` and ``step`` are Python numbers, or,
inside a replayed CUDA graph, 0-d tensors on the device that the engine refills each step.
The updates never read such a tensor back (``.item()`` would break the capture and bake
the first step's value into the graph): they compute with whichever they get."""

from __future__ import annotations

from typing import Any

import torch

Scalar = int | float | torch.Tensor


def as_float(value: Scalar) -> Any:
    """``value`` as a float: a Python float, or a float32 tensor where it is a tensor."""
    return value.float() if isinstance(value, torch.Tensor) else float(value)


def minimum(a: Scalar, b: Scalar) -> Any:
    """``min(a, b)`` of two scalars either of which may be a 0-d tensor."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        like = a if isinstance(a, torch.Tensor) else b
        a, b = (x if isinstance(x, torch.Tensor) else torch.full_like(like, x) for x in (a, b))
        return torch.minimum(a, b)
    return min(a, b)
