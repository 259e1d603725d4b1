"""A LoRA base stored in bf16, int8 or nf4 (``step.lora``'s ``BASES``): the formats, the
quantization at load, and the weight the math multiplies by.

- ``int8``: per output row, symmetric absmax. ``scale = absmax(row) / 127`` (float32),
  ``code = round(w / scale)`` in [-127, 127]; ``w ~ code * scale``, off by at most
  ``scale / 2`` per element. 1 byte a weight and 4 a row.
- ``nf4``: QLoRA's 4-bit NormalFloat. The row-major weight in blocks of 64 consecutive
  elements, each with its absmax (float32); an element's code is the index of the
  ``NF4`` value nearest to ``w / absmax`` (the lower one on a tie), two codes a byte, the
  first element in the high nibble; ``w ~ NF4[code] * absmax``. Half a byte a weight and
  4 bytes a block (0.5625 bytes a weight). The absmax are kept in float32, not quantized
  again (QLoRA's double quantization would save 0.06 more bytes a weight).
- ``bf16``: the weight rounded to bfloat16.

Quantization is deterministic (no random rounding) and happens once, when a run's state
first meets the step (``stored_base``: an HF folder's or a preset's random weights), so a
run's checkpoints hold the quantized base, which ``--resume`` loads as it is.

The math (``base_weight``, called by ``kit.linear.Linear``) dequantizes one projection at
a time into the activations' dtype through the ops ``dequantize_int8`` and
``dequantize_nf4`` (this module's functions are their reference variants, registered by
the training plugin), then multiplies by it as by a dense weight: forward ``x W^T``,
backward ``dy W`` and no ``dW`` (the base is frozen). The dequantized weight is a
temporary of the task, one projection's at a time.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dataflow_training.step.lora import BASE_DTYPES, NF4_BLOCK, SCALE_SUFFIX, scale_name

#: QLoRA's NF4 values (Dettmers et al. 2023, appendix E): the quantiles of N(0, 1)
#: scaled to [-1, 1], with an exact zero
NF4 = (
    -1.0,
    -0.6961928009986877,
    -0.5250730514526367,
    -0.39491748809814453,
    -0.28444138169288635,
    -0.18477343022823334,
    -0.09105003625154495,
    0.0,
    0.07958029955625534,
    0.16093020141124725,
    0.24611230194568634,
    0.33791524171829224,
    0.44070982933044434,
    0.5626170039176941,
    0.7229568362236023,
    1.0,
)

#: the ops the math calls for each quantized base
OPS = {"int8": ("dequantize_int8",), "nf4": ("dequantize_nf4",)}
_DEQUANTIZE = {torch.int8: "dequantize_int8", torch.uint8: "dequantize_nf4"}


def quantize_int8(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (codes int8 like ``weight``, scales float32 (out,)) of a (out, in) weight."""
    w = weight.detach().float()
    scale = w.abs().amax(1) / 127
    divisor = torch.where(scale > 0, scale, torch.ones_like(scale))
    codes = torch.round(w / divisor[:, None]).clamp_(-127, 127).to(torch.int8)
    return codes, scale


def dequantize_int8(codes: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``codes * scale`` per row, in ``dtype`` (the reference ``dequantize_int8``)."""
    return (codes.float() * scale[:, None]).to(dtype)


def _table(device: torch.device) -> torch.Tensor:
    return torch.tensor(NF4, dtype=torch.float32, device=device)


def quantize_nf4(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (codes uint8 (out, in / 2), absmax float32 (out * in / 64,)) of a (out, in)
    weight (the module docstring's format)."""
    out_features, in_features = weight.shape
    blocks = weight.detach().float().reshape(-1, NF4_BLOCK)
    absmax = blocks.abs().amax(1)
    divisor = torch.where(absmax > 0, absmax, torch.ones_like(absmax))
    normal = blocks / divisor[:, None]
    table = _table(weight.device)
    # the nearest value: the count of midpoints below (a tie goes to the lower value)
    codes = torch.bucketize(normal, (table[1:] + table[:-1]) / 2).to(torch.uint8)
    pairs = codes.reshape(-1, 2)
    packed = (pairs[:, 0] << 4) | pairs[:, 1]
    return packed.reshape(out_features, in_features // 2), absmax


def dequantize_nf4(codes: torch.Tensor, absmax: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``NF4[code] * absmax`` of each block, (out, in) in ``dtype`` (the reference
    ``dequantize_nf4``)."""
    out_features, half = codes.shape
    table = _table(codes.device)
    flat = torch.stack((codes >> 4, codes & 0xF), -1).reshape(-1, NF4_BLOCK)
    values = table[flat.long()] * absmax[:, None]
    return values.reshape(out_features, 2 * half).to(dtype)


def quantize(weight: torch.Tensor, base: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(codes, scales) of ``weight`` in ``base`` (``int8`` or ``nf4``)."""
    return (quantize_int8 if base == "int8" else quantize_nf4)(weight)


def base_weight(ops: Any, params: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype):
    """The weight ``params[name]`` as the math multiplies by it, in ``dtype``: dequantized
    where it is stored quantized (its dtype says how: int8 codes are ``int8``, nf4's
    packed pairs ``uint8``; its scales are ``params[scale_name(name)]``), cast where it is
    stored in another dtype (a ``bf16`` base of a float32 run), as it is otherwise."""
    weight = params[name]
    op = _DEQUANTIZE.get(weight.dtype)
    if op is not None:
        return ops[op](weight, params[scale_name(name)], dtype)
    return weight if weight.dtype == dtype else weight.to(dtype)


def stored_apart(params: Mapping[str, torch.Tensor], name: str, dtype: torch.dtype) -> bool:
    """Whether ``params[name]`` is stored otherwise than in ``dtype`` (a LoRA base: frozen)."""
    return params[name].dtype != dtype


def stored_base(
    layers: Any, state: Mapping[str, torch.Tensor], dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """A copy of the model ``state`` as the step of ``layers`` stores it: every tensor in
    ``dtype``, but a base projection in the dtype its ``TensorSpec`` names
    (``step.lora.base_specs``): a dense weight (an HF folder's, a preset's random one)
    quantized, a quantized one (a checkpoint's) kept as it is, with its scales."""
    specs = {
        f"{layer.name}.{p.name}": p.dtype
        for layer in layers
        for p in layer.params
        if p.dtype in BASE_DTYPES.values()
    }
    out: dict[str, torch.Tensor] = {}
    for key, tensor in state.items():
        stored = specs.get(key)
        if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in specs:
            continue  # with its weight
        if stored is None:
            out[key] = tensor.detach().to(dtype, copy=True)
            continue
        if stored == "bfloat16":
            out[key] = tensor.detach().to(torch.bfloat16, copy=True)
            continue
        if tensor.dtype == getattr(torch, stored):  # quantized already
            out[key] = tensor.detach().clone()
            out[scale_name(key)] = state[scale_name(key)].detach().float().clone()
            continue
        base = "int8" if stored == "int8" else "nf4"
        out[key], out[scale_name(key)] = quantize(tensor, base)
    return out


def dense_base(
    weights: Mapping[str, torch.Tensor], dtype: torch.dtype | None = None
) -> dict[str, torch.Tensor]:
    """``weights`` with every quantized base weight dequantized and its scales dropped,
    and every stored-apart (bf16) base weight cast: each into ``dtype`` (default: the
    dtype of the state's floating-point tensors that are not the base's, the adapters'
    and the norms', i.e. the run's)."""
    scaled = {k.removesuffix(SCALE_SUFFIX) for k in weights if k.endswith(SCALE_SUFFIX)}
    if dtype is None:
        floats = [
            v.dtype
            for k, v in weights.items()
            if k not in scaled and v.is_floating_point() and not k.endswith(SCALE_SUFFIX)
        ]
        dtype = max(floats, key=lambda d: torch.finfo(d).bits) if floats else torch.float32
    out = {}
    for key, tensor in weights.items():
        if key.endswith(SCALE_SUFFIX) and key.removesuffix(SCALE_SUFFIX) in scaled:
            continue
        if key in scaled:
            scales = weights[scale_name(key)]
            fn = dequantize_int8 if tensor.dtype == torch.int8 else dequantize_nf4
            out[key] = fn(tensor, scales, dtype)
        elif tensor.is_floating_point() and tensor.dtype != dtype:
            out[key] = tensor.to(dtype)
        else:
            out[key] = tensor
    return out
