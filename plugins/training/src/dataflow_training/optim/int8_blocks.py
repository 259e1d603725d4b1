"""The sizes of block-wise 8-bit moments (``blockwise8``), in pure Python: what the
lowering sizes their state objects by and what ``--precision`` prices, without torch."""

from __future__ import annotations

import math

#: elements a moment's float32 scale covers
BLOCK = 256


def blocks(numel: int) -> int:
    """Scales a moment of ``numel`` elements keeps."""
    return -(-numel // BLOCK)


def scale_shape(param_shape: tuple[int, ...], role: str) -> tuple[int, ...]:
    """The shape of a moment's scales (``StateField.shape``): one per block; none for a
    parameter that keeps no moment (shape ``()``, as ``same_shape`` keeps none)."""
    if not param_shape:
        return ()
    return (blocks(math.prod(param_shape)),)
