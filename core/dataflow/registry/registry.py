"""A registry: the records of one kind from every loaded plugin, sorted by name.

Built from ``(distribution, record)`` pairs; a name registered twice is a
``DuplicateNameError`` naming both distributions. ``get(name)`` either returns the record or
raises ``UnknownNameError`` listing the names it knows.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from typing import Any, Generic, TypeVar

import attrs

from dataflow.registry.errors import DuplicateNameError, UnknownNameError
from dataflow.registry.kinds import RegistryKind
from dataflow.registry.records import FeedSpec, KernelVariant

R = TypeVar("R")


@attrs.frozen
class Entry(Generic[R]):
    """One registered record and the distribution whose plugin registered it."""

    name: str
    record: R
    distribution: str


class Registry(Generic[R]):
    """Records of one kind by name. Iterating yields the records in name order."""

    def __init__(
        self, kind: RegistryKind, entries: Sequence[Entry[R]], broken: Sequence[str] = ()
    ) -> None:
        self.kind = kind
        self._entries = {entry.name: entry for entry in sorted(entries, key=lambda e: e.name)}
        self._broken = tuple(broken)

    @classmethod
    def build(
        cls,
        kind: RegistryKind,
        records: Iterable[tuple[str, R]],
        *,
        broken: Sequence[str] = (),
    ) -> Registry[R]:
        """Collect ``(distribution, record)`` pairs; a repeated name is a DuplicateNameError.

        ``broken`` names the plugins that failed to load; a failed lookup mentions them.
        """
        seen: dict[str, Entry[R]] = {}
        for distribution, record in records:
            name = kind.key(record)
            if name in seen:
                raise DuplicateNameError(kind.noun, name, seen[name].distribution, distribution)
            seen[name] = Entry(name, record, distribution)
        return cls(kind, list(seen.values()), broken)

    def get(self, name: str) -> R:
        """The record called ``name``; ``UnknownNameError`` (listing known names) if none."""
        try:
            return self._entries[name].record
        except KeyError:
            raise UnknownNameError(self.kind.noun, name, self.names(), self._broken) from None

    def distribution_of(self, name: str) -> str:
        """The distribution that registered ``name``."""
        self.get(name)
        return self._entries[name].distribution

    def names(self) -> list[str]:
        return list(self._entries)

    def entries(self) -> list[Entry[R]]:
        return list(self._entries.values())

    def __contains__(self, name: object) -> bool:
        return name in self._entries

    def __iter__(self) -> Iterator[R]:
        return (entry.record for entry in self._entries.values())

    def __len__(self) -> int:
        return len(self._entries)

    def __repr__(self) -> str:
        return f"<Registry {self.kind.name}: {', '.join(self._entries) or 'empty'}>"


#: ``OP=NAME[,OP=NAME...]``: the variant each named op runs wherever that variant supports
#: the device, ahead of the priorities (``KernelRegistry.for_op``); e.g.
#: ``attention_fwd=torch,attention_bwd=torch`` runs flash attention where cuDNN's pair
#: would be chosen. A forward/backward pair that shares saved statistics is pinned together
PIN_ENV = "DATAFLOW_KERNELS"


def pinned_variants(text: str | None = None) -> dict[str, str]:
    """``{op: variant name}`` from ``text`` (default: the ``DATAFLOW_KERNELS`` variable);
    ``ValueError`` naming the variable for an entry that is not ``OP=NAME``."""
    import os

    text = os.environ.get(PIN_ENV, "") if text is None else text
    pins: dict[str, str] = {}
    for entry in filter(None, (part.strip() for part in text.split(","))):
        op, equals, name = (part.strip() for part in entry.partition("="))
        if not equals or not op or not name:
            raise ValueError(f"{PIN_ENV}: {entry!r} is not OP=NAME (e.g. attention_fwd=torch)")
        pins[op] = name
    return pins


class KernelRegistry(Registry[KernelVariant]):
    """Kernel variants, named ``OP/NAME``; ``for_op`` lists one op's variants, best first."""

    def for_op(self, op: str, *, device: str | None = None) -> list[KernelVariant]:
        """Variants of ``op`` (that support ``device``), highest priority first, then by name;
        a variant pinned by ``DATAFLOW_KERNELS`` (``PIN_ENV``) first of all.

        Raises ``UnknownNameError`` when no variant of ``op`` is registered at all, and
        ``ValueError`` when the pinned name is none of its variants.
        """
        variants = [variant for variant in self if variant.op == op]
        if not variants:
            ops = sorted({variant.op for variant in self})
            raise UnknownNameError("kernel op", op, ops, self._broken)
        pinned = pinned_variants().get(op)
        if pinned is not None and pinned not in {variant.name for variant in variants}:
            known = ", ".join(sorted(variant.name for variant in variants))
            raise ValueError(f"{PIN_ENV}: op {op} has no variant {pinned!r}; its variants: {known}")
        if device is not None:
            variants = [variant for variant in variants if device in variant.devices]
        return sorted(
            variants,
            key=lambda variant: (variant.name != pinned, -variant.priority, variant.name),
        )

    def check_pins(self) -> dict[str, str]:
        """The ``DATAFLOW_KERNELS`` pins (``pinned_variants``), each checked against this
        registry before any kernel is loaded: ``ValueError`` naming the variable for an op
        it has no variant of, or a variant name the op does not have."""
        pins = pinned_variants()
        ops = sorted({variant.op for variant in self})
        for op in pins:
            if op not in ops:
                raise ValueError(f"{PIN_ENV}: no kernel op {op!r}; the ops: {', '.join(ops)}")
            self.for_op(op)  # a name the op has no variant of
        return pins


class FeedRegistry(Registry[FeedSpec]):
    """Feeds by scheme; ``open("shards:data/tok")`` opens one from a spec string."""

    def open(self, spec: str, **options: Any) -> Any:
        """Open the feed that ``SCHEME:LOCATION`` names with ``open(LOCATION, **options)``."""
        scheme, colon, location = spec.partition(":")
        if not colon:
            raise ValueError(
                f"feed spec {spec!r} has no scheme; write SCHEME:LOCATION, with SCHEME one of: "
                f"{', '.join(self.names()) or 'none registered'}"
            )
        return self.get(scheme).open(location, **options)
