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

With ``--lora-dropout P`` the adapter sees ``dropout(x)`` (``x * keep / (1 - P)``) while
the base sees ``x``, as PEFT's LoRA does. The mask is never stored: forward, recompute and
backward make it again from a seed (``dropout_keep``), a hash of the optimizer update's
number, the round, the layer and the adapted weight's name, element by element (a
counter-based hash in integer tensor ops, the same bits on every device). So backward
needs no saved mask (a bool per element of every adapted projection's input would be as
large as the inputs themselves), a resumed run draws the masks of an uninterrupted one,
and a replayed CUDA graph reads the update's number from the device tensor the engine
feeds it. Only the training tasks set the seed (``LoraScale.seed``); without one (an
evaluation's forward) there is no dropout.

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


#: a 32-bit mask
_BITS = 0xFFFFFFFF


@dataclasses.dataclass(frozen=True)
class LoraScale:
    """The ``lora`` entry of the ops: the adapters' ``scale`` (``alpha / rank``), their
    input's ``dropout`` probability and the ``seed`` of this task's masks (an int, or a
    0-d int64 tensor on the device; None: no dropout, as in an evaluation)."""

    scale: float
    dropout: float = 0.0
    seed: Any = None

    @property
    def drops(self) -> bool:
        return self.dropout > 0 and self.seed is not None


def with_lora(ops: Mapping[str, Any], lora: Any) -> Mapping[str, Any]:
    """``ops`` with the ``lora`` entry of ``lora`` (a ``LoraConfig``; None: ``ops``), no
    dropout seed yet (``with_seed``)."""
    if lora is None:
        return ops
    return {**ops, LORA_OP: LoraScale(lora.scale, lora.dropout)}


def with_seed(ops: Mapping[str, Any], seed: Any) -> Mapping[str, Any]:
    """``ops`` whose ``lora`` entry draws its dropout masks from ``seed`` (``task_seed``);
    ``ops`` itself where the adapters have no dropout."""
    lora = ops.get(LORA_OP)
    if lora is None or not lora.dropout:
        return ops
    return {**ops, LORA_OP: dataclasses.replace(lora, seed=seed)}


def task_seed(update: Any, round_: int, layer: int) -> Any:
    """The seed of one task's masks: of the optimizer update's number (1-based; an int
    or the device tensor a CUDA graph reads), the accumulation round and the layer's
    index, so forward, recompute and backward of one block in one round draw the same
    masks and every other draws its own: a 0-d int64 tensor, on the host for an int
    ``update``, on the device for a device value (a float32 0-d tensor, exact up to
    2**24 updates)."""
    update = update.to(torch.int64) if isinstance(update, torch.Tensor) else torch.tensor(update)
    return update * 1_000_003 + round_ * 4099 + layer


def _hash32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit integer mix (an int64 tensor of values below 2**32 in and out): two
    rounds of xor-shift and multiply by 0x45d9f3b, whose products stay below 2**63."""
    x = ((x >> 16) ^ x) * 0x45D9F3B & _BITS
    x = ((x >> 16) ^ x) * 0x45D9F3B & _BITS
    return (x >> 16) ^ x


def dropout_keep(
    shape: tuple[int, ...], seed: Any, salt: int, p: float, device: Any
) -> torch.Tensor:
    """The bool mask of the elements ``dropout(p)`` keeps, of ``shape``: element ``i``
    (row-major) is kept where ``hash(i ^ hash(seed, salt)) >= p * 2**32``, each with
    probability ``1 - p``. ``seed`` is an int or a 0-d int64 tensor (``task_seed``),
    ``salt`` tells apart the projections of one task (``name_salt``)."""
    # an int seed becomes a 0-d host tensor, which ops on a CUDA tensor take as a scalar
    # (no copy), and which torch.compile takes as an input (no recompiling every step)
    key = seed if isinstance(seed, torch.Tensor) else torch.tensor(seed)
    key = _hash32(_hash32(key.to(torch.int64) & _BITS) ^ salt)
    count = 1
    for size in shape:
        count *= size
    index = torch.arange(count, dtype=torch.int64, device=device) & _BITS
    return (_hash32(index ^ key) >= int(p * 2**32)).reshape(shape)


def name_salt(name: str) -> int:
    """A 32-bit number of an adapted weight's name, the same in every process."""
    return _seed(0, name) & _BITS


def _dropped(ops: Any, x: torch.Tensor, name: str) -> torch.Tensor:
    """``dropout(x)`` of the adapter of weight ``name`` (``x`` itself without dropout)."""
    lora = ops[LORA_OP]
    if not lora.drops:
        return x
    keep = dropout_keep(tuple(x.shape), lora.seed, name_salt(name), lora.dropout, x.device)
    return x * keep.to(x.dtype) * (1.0 / (1.0 - lora.dropout))


def adapter_forward(
    ops: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, name: str = ""
) -> torch.Tensor:
    """``scale * (dropout(x) A^T) B^T`` of the adapter of weight ``name``."""
    x = _dropped(ops, x, name)
    return ops["linear"](ops["linear"](x, a), b).mul_(ops[LORA_OP].scale)


def adapter_backward(
    ops: Any, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, dy: torch.Tensor, name: str = ""
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (the adapter's share of dx, dA, dB) of ``scale * (dropout(x) A^T) B^T``, the
    dropout's mask made again (the module docstring)."""
    lora = ops[LORA_OP]
    scale = lora.scale
    x_in = _dropped(ops, x, name)
    x_rows = x_in.reshape(-1, x.shape[-1])
    dy_rows = dy.reshape(-1, dy.shape[-1])
    xa = ops["linear"](x_rows, a)  # (tokens, rank), made again
    d_xa = ops["linear"](dy_rows, b.t()).mul_(scale)  # (tokens, rank)
    d_b = ops["linear"](dy_rows.t(), xa.t()).mul_(scale)  # (out, rank)
    d_a = ops["linear"](d_xa.t(), x_rows.t())  # (rank, in)
    dx = ops["linear"](d_xa, a.t()).reshape(*dy.shape[:-1], a.shape[1])
    if lora.drops:  # through the dropout: the same mask and scale
        keep = dropout_keep(tuple(x.shape), lora.seed, name_salt(name), lora.dropout, x.device)
        dx = dx * keep.to(dx.dtype) * (1.0 / (1.0 - lora.dropout))
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
