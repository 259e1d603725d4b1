"""Packing a layer's named tensors into one object's bytes, and reading them back.

Each entry starts at a multiple of ``ALIGN_BYTES`` so every typed view is aligned (and
kernels get the alignment they like). Layouts travel in the step layout (``dataflow_training.step``), so an
executable can view ``W_3`` as the family's named parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from dataflow.schema import DTYPE_BYTES

ALIGN_BYTES = 256


@attrs.frozen
class Entry:
    name: str
    offset_bytes: int
    shape: tuple[int, ...] = attrs.field(converter=tuple)
    dtype: str

    @property
    def size_bytes(self) -> int:
        return math.prod(self.shape) * DTYPE_BYTES[self.dtype]


@attrs.frozen
class Layout:
    """Named tensors packed into ``size_bytes`` bytes."""

    entries: tuple[Entry, ...] = attrs.field(converter=tuple)
    size_bytes: int

    @classmethod
    def pack(cls, tensors: Iterable[tuple[str, tuple[int, ...], str]]) -> Layout:
        """Pack (name, shape, dtype) in order, each at an aligned offset."""
        entries, offset = [], 0
        for name, shape, dtype in tensors:
            entry = Entry(name, offset, shape, dtype)
            entries.append(entry)
            offset += -(-entry.size_bytes // ALIGN_BYTES) * ALIGN_BYTES
        return cls(tuple(entries), max(offset, 1))

    def entry(self, name: str) -> Entry:
        for e in self.entries:
            if e.name == name:
                return e
        raise KeyError(f"no entry {name!r}; entries: {', '.join(e.name for e in self.entries)}")

    def to_dict(self) -> dict[str, Any]:
        return {
            "size_bytes": self.size_bytes,
            "entries": [[e.name, e.offset_bytes, list(e.shape), e.dtype] for e in self.entries],
        }

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Layout:
        return cls(
            tuple(
                Entry(name, offset, shape, dtype) for name, offset, shape, dtype in data["entries"]
            ),
            data["size_bytes"],
        )

    def views(self, buffer: Any) -> dict[str, Any]:
        """Typed torch views of each entry in the flat uint8 ``buffer``."""
        import torch

        out = {}
        for e in self.entries:
            raw = buffer[e.offset_bytes : e.offset_bytes + e.size_bytes]
            out[e.name] = raw.view(getattr(torch, e.dtype)).view(e.shape)
        return out
