"""Block-wise 8-bit storage of optimizer moments (``--optimizer-states int8``).

A moment tensor is cut, in its flat order, into blocks of ``BLOCK`` elements (the last
one may be shorter); each block keeps its absolute maximum as a float32 scale, and each
element a one-byte code for its value divided by that scale, a number in [-1, 1]. The
codes follow a *geometric* map: code magnitude ``k`` (1 ..  ``top``) stands for
``ratio ** (top - k)``, so the block's largest element is exact and every other one is
kept to the same relative precision however far below the largest it sits, down to the
map's floor, ``ratio ** (top - 1)``; below it, see each moment. Rounding
is to the nearest code in the logarithm (one ``log``, ``round``, ``exp`` per element: no
table search), which bounds the relative error by ``sqrt(1 / ratio) - 1``.

- ``exp_avg`` (signed): int8 codes -127 .. 127 (the sign is the code's), floor
  ``SIGNED_FLOOR`` = 1e-5 of the block's largest: 126 steps of 9.1 %, each value kept
  within 4.7 %; a value below half the floor is kept as 0 (a smaller update).
- ``exp_avg_sq`` (non-negative): uint8 codes 0 .. 255, floor ``UNSIGNED_FLOOR`` = 1e-10
  (the signed floor squared), 254 steps of 9.1 %: within 4.7 % of the value, 2.3 % of its
  square root (what the update divides by). A value below the floor is kept as the floor,
  never as 0 unless it is 0: the update divides by this moment's root, and AdamW's first
  moment is at most 1.17 times the second's root (betas 0.9, 0.95), so a raised floor
  keeps an update of a tiny entry below lr where a zero would make it ``m / eps``.

The same design as bitsandbytes' and torchao's 8-bit optimizers (block-wise absmax scales,
a non-linear map dense near zero), with a map of our own: theirs is a "dynamic tree" table
searched per element. torchao's functions were tried on our states and not used: they
need the element count to be a multiple of the block (our moments are views of the
parameters' own shapes, packed per layer), write new tensors instead of into the packed
state in place, and torchao is a GPU-only dependency of this project while CPU runs and
CI must carry the same numbers. Everything here is plain torch, elementwise, capturable
in a CUDA graph (nothing is read back to the host).
"""

from __future__ import annotations

import math

import torch

from dataflow_training.optim.int8_blocks import BLOCK

#: the signed map's smallest non-zero magnitude, as a fraction of the block's largest
SIGNED_FLOOR = 1e-5
#: the unsigned map's: the signed floor squared (module doc)
UNSIGNED_FLOOR = SIGNED_FLOOR**2
#: the smallest normal float32: a second moment this far below its block's largest is 0
_TINY = torch.finfo(torch.float32).tiny
#: the largest code magnitude of each map
SIGNED_TOP, UNSIGNED_TOP = 127, 255


def log_ratio(top: int, floor: float) -> float:
    """``log(ratio)`` of a map whose code 1 stands for ``floor`` and code ``top`` for 1."""
    return math.log(floor) / (top - 1)


def relative_error(top: int, floor: float) -> float:
    """The largest relative error of a value at or above ``floor`` (module doc)."""
    return math.exp(-log_ratio(top, floor) / 2) - 1


def _padded(flat: torch.Tensor) -> torch.Tensor:
    """``flat`` as (blocks, BLOCK) rows, its tail padded with zeros where it is short."""
    short = -flat.numel() % BLOCK
    if short:
        flat = torch.nn.functional.pad(flat, (0, short))
    return flat.view(-1, BLOCK)


def _magnitude_codes(
    magnitude: torch.Tensor, top: int, floor: float, zero_below: float
) -> torch.Tensor:
    """Code magnitudes (0 .. ``top``, float32) of values in [0, 1]: nearest in the log,
    the floor's code 1 for a value under it, 0 for one under ``zero_below``."""
    level = top - torch.log(magnitude.clamp_min(floor)) / log_ratio(top, floor)
    codes = level.round_().clamp_(1, top)
    return codes.masked_fill_(magnitude < zero_below, 0)


def _magnitudes(codes: torch.Tensor, top: int, floor: float) -> torch.Tensor:
    """Values in [0, 1] (float32) of code magnitudes 0 .. ``top``."""
    values = torch.exp((top - codes) * log_ratio(top, floor))
    return values.masked_fill_(codes == 0, 0.0)


def quantize_(value: torch.Tensor, codes: torch.Tensor, scales: torch.Tensor) -> None:
    """Write ``value`` (any float dtype and shape) into ``codes`` (int8 for a signed
    moment, uint8 for a non-negative one, ``value``'s shape) and ``scales`` (float32, one
    per block) in place. A uint8 moment takes ``value``'s magnitude (it is non-negative)."""
    flat = _padded(value.reshape(-1).float())
    absmax = flat.abs().amax(dim=1)
    scales.copy_(absmax)
    unit = flat.abs() / absmax.clamp_min(_TINY).unsqueeze(1)
    if codes.dtype == torch.uint8:
        code = _magnitude_codes(unit, UNSIGNED_TOP, UNSIGNED_FLOOR, _TINY)
    else:
        code = _magnitude_codes(unit, SIGNED_TOP, SIGNED_FLOOR, SIGNED_FLOOR / 2)
        code.mul_(flat.sign())
    codes.view(-1).copy_(code.view(-1)[: codes.numel()])


def dequantize(codes: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:
    """The float32 values ``codes`` and ``scales`` keep, in ``codes``' shape."""
    flat = _padded(codes.reshape(-1).float())
    if codes.dtype == torch.uint8:
        unit = _magnitudes(flat, UNSIGNED_TOP, UNSIGNED_FLOOR)
    else:
        unit = _magnitudes(flat.abs(), SIGNED_TOP, SIGNED_FLOOR).mul_(flat.sign())
    values = unit.mul_(scales.unsqueeze(1)).view(-1)[: codes.numel()]
    return values.view(codes.shape)
