"""LoRA's math over ``env.ops`` (``step.lora`` says what the adapters are).

``Linear`` (``kit.linear``) takes an adapter where its parameters hold one: the forward
adds ``scale * (x A^T) B^T`` to ``x W^T`` and the backward returns ``dA`` and ``dB`` and
adds the adapter's share to ``dx``, with no ``dW`` (the base is frozen under LoRA). The
scale (``alpha / rank``) reaches the math as the ``lora`` entry of the ops
(``LoraScale``), which the training tasks add when the step has adapters.

What backward needs is ``x``, the linear's input, which every kit part already has at its
projections' backward (saved, or made again from the saved tensors elementwise), and
``x A^T`` (tokens x rank), which backward makes again from ``x`` and ``A``: a matmul of
``2 * tokens * in * rank`` FLOPs (at rank 16 on a 4096-wide projection, 0.4% of the
projection's), rather than a saved tensor per target.

``init_adapters`` gives a model state the adapters it lacks, as PEFT initialises them by
default: ``A`` Kaiming-uniform with ``a = sqrt(5)`` (uniform in +-1/sqrt(in)), ``B`` zero,
so a fresh adapter changes nothing and the first step's output is the base's.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Mapping, MutableMapping
from typing import Any

import torch

from dataflow_training.step.lora import GROUP

#: the ops entry that carries the adapters' scale
LORA_OP = "lora"


@dataclasses.dataclass(frozen=True)
class LoraScale:
    """The adapters' ``scale`` (``alpha / rank``), as the ``lora`` entry of the ops."""

    scale: float


def with_lora(ops: Mapping[str, Any], lora: Any) -> Mapping[str, Any]:
    """``ops`` with the ``lora`` entry of ``lora`` (a ``LoraConfig``; None: ``ops``)."""
    if lora is None:
        return ops
    return {**ops, LORA_OP: LoraScale(lora.scale)}


def adapter_forward(ops: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """``scale * (x A^T) B^T``."""
    return ops["linear"](ops["linear"](x, a), b).mul_(ops[LORA_OP].scale)


def adapter_backward(
    ops: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (the adapter's share of dx, dA, dB) of ``scale * (x A^T) B^T``."""
    scale = ops[LORA_OP].scale
    x_rows = x.reshape(-1, x.shape[-1])
    dy_rows = dy.reshape(-1, dy.shape[-1])
    xa = ops["linear"](x_rows, a)  # (tokens, rank), made again
    d_xa = ops["linear"](dy_rows, b.t()).mul_(scale)  # (tokens, rank)
    d_b = ops["linear"](dy_rows.t(), xa.t()).mul_(scale)  # (out, rank)
    d_a = ops["linear"](d_xa.t(), x_rows.t())  # (rank, in)
    dx = ops["linear"](d_xa, a.t()).reshape(*dy.shape[:-1], a.shape[1])
    return dx, d_a, d_b


def init_adapters(
    layers: Any, state: MutableMapping[str, torch.Tensor], seed: int, dtype: torch.dtype
) -> None:
    """Add to ``state`` each adapter of ``layers`` it lacks (the module docstring): ``A``
    from a generator seeded by ``seed`` and the adapter's name, so a run's adapters do not
    depend on the order they are made in; ``B`` zeros."""
    for layer in layers:
        for group in layer.groups:
            if group.name != GROUP:
                continue
            for p in group.params:
                key = f"{layer.name}.{p.name}"
                if key in state:
                    continue
                if ".lora_B." in p.name:
                    state[key] = torch.zeros(p.shape, dtype=dtype)
                    continue
                generator = torch.Generator().manual_seed(_seed(seed, key))
                bound = 1.0 / math.sqrt(p.shape[1])  # kaiming_uniform_(a=sqrt(5))
                a = torch.empty(p.shape, dtype=torch.float32).uniform_(
                    -bound, bound, generator=generator
                )
                state[key] = a.to(dtype)


def _seed(seed: int, key: str) -> int:
    """A seed of ``seed`` and ``key`` that does not change between processes."""
    value = seed & 0xFFFFFFFF
    for char in key.encode():
        value = (value * 1_000_003 + char) % (2**61 - 1)
    return value
