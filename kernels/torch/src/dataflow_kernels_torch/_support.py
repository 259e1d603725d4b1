"""Small helpers the explicit forward/backward ops share: the statistics dtype, and
whether this torch build has a kernel for an aten op on a device."""

from __future__ import annotations

import functools

import torch

#: The 16-bit float dtypes: their statistics and softmax math run in float32.
HALF_DTYPES = (torch.float16, torch.bfloat16)


def stats_dtype(dtype: torch.dtype) -> torch.dtype:
    """float64 for float64 inputs, else float32: the dtype of saved statistics (attention's
    logsumexp, a norm's mean and rstd) and of the math that produces them."""
    return torch.float64 if dtype == torch.float64 else torch.float32


@torch.compiler.assume_constant_result  # fixed per build: no graph break under torch.compile
def has_kernel(op: str, device_type: str) -> bool:
    """Whether aten op ``op`` (``"aten::mm.dtype"``) has a kernel registered for
    ``device_type`` (``"cpu"`` or ``"cuda"``) in this build; asked once per pair."""
    return _has_kernel(op, device_type)


@functools.cache
def _has_kernel(op: str, device_type: str) -> bool:
    key = {"cpu": "CPU", "cuda": "CUDA"}.get(device_type)
    return key is not None and torch._C._dispatch_has_kernel_for_dispatch_key(op, key)
