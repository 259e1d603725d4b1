"""Packing a layer's named tensors into one object's bytes, and reading them back.

Each entry starts at a multiple of ``ALIGN_BYTES`` so every typed view is aligned (and
kernels get the alignment they like), and takes a whole number of ``ALIGN_ELEMENTS``
elements. So two layouts that pack the same shapes in the same order, each in one dtype
(a layer's bf16 parameters and their float32 Adam moments), put every entry at the same
*element* offset: a span of consecutive entries of one is the matching span of the other,
element for element, and the optimizer updates a whole group as one flat tensor. The
padding (``gaps``) holds zeros. Layouts travel in the step layout (``dataflow_training.step.layout``), so an
executable can view ``W_3`` as the family's named parameters.
"""

from __future__ import annotations

import math
from collections.abc import Iterable, Mapping
from typing import Any

import attrs

from dataflow import DTYPE_BYTES

ALIGN_BYTES = 256
ALIGN_ELEMENTS = 128


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
            offset = -(-offset // ALIGN_BYTES) * ALIGN_BYTES
            entry = Entry(name, offset, shape, dtype)
            entries.append(entry)
            elements = -(-math.prod(entry.shape) // ALIGN_ELEMENTS) * ALIGN_ELEMENTS
            offset += elements * DTYPE_BYTES[dtype]
        return cls(tuple(entries), max(offset, 1))

    def gaps(self) -> list[tuple[int, int]]:
        """Byte ranges ``[start, end)`` that no entry's data covers (padding)."""
        out, cursor = [], 0
        for e in sorted(self.entries, key=lambda e: e.offset_bytes):
            if e.offset_bytes > cursor:
                out.append((cursor, e.offset_bytes))
            cursor = max(cursor, e.offset_bytes + e.size_bytes)
        if cursor < self.size_bytes:
            out.append((cursor, self.size_bytes))
        return out

    def span_range(self, names: Iterable[str]) -> tuple[int, int, str] | None:
        """(start byte, end byte, dtype) from the first of ``names`` to the end of the last
        (entries of one dtype, consecutive in the layout), padding between them included;
        None when they are not consecutive or not of one dtype."""
        wanted = set(names)
        index = [i for i, e in enumerate(self.entries) if e.name in wanted]
        if not index or index != list(range(index[0], index[-1] + 1)):
            return None
        chosen = [self.entries[i] for i in index]
        if len({e.dtype for e in chosen}) != 1:
            return None
        end = chosen[-1].offset_bytes + chosen[-1].size_bytes
        return chosen[0].offset_bytes, end, chosen[0].dtype

    def span(self, buffer: Any, names: Iterable[str]) -> Any:
        """One flat typed view over ``span_range(names)`` of ``buffer``; None where that
        range is None."""
        found = self.span_range(names)
        return None if found is None else flat_view(buffer, *found)

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
        # the step stage lowers and plans without torch: torch loads when a task runs
        import torch

        out = {}
        for e in self.entries:
            raw = buffer[e.offset_bytes : e.offset_bytes + e.size_bytes]
            out[e.name] = raw.view(getattr(torch, e.dtype)).view(e.shape)
        return out


def flat_view(buffer: Any, start: int, end: int, dtype: str) -> Any:
    """Bytes ``[start, end)`` of a flat uint8 ``buffer`` as one 1-D tensor of ``dtype``."""
    # the step stage lowers and plans without torch: torch loads when a task runs
    import torch

    return buffer[start:end].view(getattr(torch, dtype))
