"""Several named tensors in one object: a layer's parameters, what its forward saves.

The engine moves objects, not tensors, so a layer's parameters travel as one flat byte
object (``W_3``) and so do its saved context (``A_3``) and its router choices (``T_3``).
A ``Packing`` is the table of where each tensor lies in such an object; ``views`` turns
the engine's flat ``uint8`` view of it back into named, typed tensors (no copy).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from dataflow import DTYPE_BYTES, TensorMeta

#: every tensor starts at a multiple of this many bytes (a typed view needs its element
#: size; 16 suits every dtype and vector loads)
ALIGN_BYTES = 16


@attrs.frozen
class Slot:
    name: str
    dtype: str
    shape: tuple[int, ...]
    offset: int
    #: the tensor's bytes, worked out once: ``views`` runs at every task launch, and a
    #: ``TensorMeta`` per slot per launch was some 75 us of host time a call (CPU profile)
    nbytes: int = attrs.field(init=False)

    @nbytes.default
    def _nbytes(self) -> int:
        return TensorMeta(self.dtype, self.shape).nbytes


@attrs.frozen
class Packing:
    """Where each named tensor lies in one flat object of ``size_bytes`` bytes."""

    slots: tuple[Slot, ...]
    size_bytes: int

    @classmethod
    def of(cls, tensors: Iterable[tuple[str, str, tuple[int, ...]]]) -> Packing:
        """Pack ``(name, dtype, shape)`` in order, each aligned to ``ALIGN_BYTES``."""
        slots, offset = [], 0
        for name, dtype, shape in tensors:
            if dtype not in DTYPE_BYTES:
                raise ValueError(f"tensor {name!r}: unknown dtype {dtype!r}")
            slot = Slot(name, dtype, tuple(shape), offset)
            slots.append(slot)
            offset += -(-slot.nbytes // ALIGN_BYTES) * ALIGN_BYTES
        return cls(tuple(slots), max(offset, ALIGN_BYTES))

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(slot.name for slot in self.slots)

    def meta(self) -> TensorMeta:
        """The object's tensor metadata: flat bytes."""
        return TensorMeta("uint8", (self.size_bytes,))

    def views(self, flat: Any) -> dict[str, Any]:
        """Named typed views into ``flat`` (a ``uint8`` tensor of ``size_bytes``)."""
        import torch  # the entry point of this package imports no torch

        return {
            slot.name: flat[slot.offset : slot.offset + slot.nbytes]
            .view(getattr(torch, slot.dtype))
            .view(slot.shape)
            for slot in self.slots
        }

    def pack(self, tensors: Mapping[str, Any]) -> Any:
        """A new flat ``uint8`` tensor holding ``tensors`` (every slot by name)."""
        import torch

        missing = sorted(set(self.names) - set(tensors))
        if missing:
            raise KeyError(f"no tensor for {', '.join(missing)}")
        flat = torch.zeros(self.size_bytes, dtype=torch.uint8)
        for name, view in self.views(flat).items():
            view.copy_(tensors[name])
        return flat
