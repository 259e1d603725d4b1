"""The Program: a chain of tasks over named objects, with links and a budget."""

from __future__ import annotations

import functools
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import attrs

from dataflow.schema.converter import (
    OMIT_IF_DEFAULT,
    program_from_dict,
    program_from_json,
    program_to_dict,
    program_to_json,
)
from dataflow.schema.objects import Location, Obj
from dataflow.schema.tasks import Prologue, Task


@attrs.frozen
class Link:
    """One transfer direction: ``latency_us + size_bytes / bw_bytes_per_us`` per transfer."""

    bw_bytes_per_us: float
    latency_us: float = 0.0

    def transfer_us(self, size_bytes: int) -> float:
        return self.latency_us + size_bytes / self.bw_bytes_per_us


def _default_link() -> Link:
    # 25 GB/s, 10 us: a PCIe Gen4 x16 link in practice. Programs that care set their own
    # (measured) links; this default only keeps hand-written examples short.
    return Link(bw_bytes_per_us=25_000.0, latency_us=10.0)


def _positive_or_none(instance: Any, attribute: attrs.Attribute, value: float | None) -> None:
    if value is not None and not value > 0:
        raise ValueError(f"links.{attribute.name} must be > 0 (or absent), got {value!r}")


@attrs.frozen
class Links:
    """Bandwidth and latency of each direction between fast and slow memory, and of the
    collective link (None: the program has no collective tasks).

    ``duplex_bytes_per_us`` is the two directions' total bandwidth while both copy at once
    (None: no shared limit, each direction always runs at its own ``bw_bytes_per_us``).
    While both directions are busy each runs at its share (``shared_bw``), and a transfer
    in flight is re-timed when the other direction starts or ends (docs/execution_model.md).
    """

    h2d: Link = attrs.field(factory=_default_link)
    d2h: Link = attrs.field(factory=_default_link)
    #: an all-reduce of ``size_bytes`` over the fleet takes ``collective.transfer_us(size)``:
    #: its bandwidth is the algorithm bandwidth (bytes reduced per us) for the fleet's size
    collective: Link | None = attrs.field(default=None, metadata=OMIT_IF_DEFAULT)
    duplex_bytes_per_us: float | None = attrs.field(
        default=None, validator=_positive_or_none, metadata=OMIT_IF_DEFAULT
    )

    @property
    def shared_bw(self) -> tuple[float, float]:
        """(h2d, d2h) bytes per us while both directions copy at once: the duplex total
        split fairly (max-min): half each, unless one direction is slower than half on its
        own, which then keeps its own rate and leaves the rest to the other. Without a
        duplex limit, or one at least the sum of the two, each keeps its own rate."""
        h2d, d2h, total = (
            self.h2d.bw_bytes_per_us,
            self.d2h.bw_bytes_per_us,
            self.duplex_bytes_per_us,
        )
        if total is None or total >= h2d + d2h:
            return h2d, d2h
        half = total / 2
        if h2d <= half:
            return h2d, total - h2d
        if d2h <= half:
            return total - d2h, d2h
        return half, half

    @property
    def duplex_limited(self) -> bool:
        """Whether copying both ways at once is slower than each way alone."""
        return self.shared_bw != (self.h2d.bw_bytes_per_us, self.d2h.bw_bytes_per_us)

    def collective_us(self, size_bytes: int) -> float:
        """How long a collective task that reduces ``size_bytes`` occupies the link."""
        if self.collective is None:
            raise ValueError("the program has collective tasks but no links.collective")
        return self.collective.transfer_us(size_bytes)


@attrs.frozen
class Budget:
    """Memory a program may use: ``fast_bytes`` on the device; ``slow_bytes`` (None = no
    limit) in pinned host memory."""

    fast_bytes: int
    slow_bytes: int | None = None


def _frozen_locations(value: Mapping[str, Any]) -> dict[str, Location]:
    return {str(key): Location(loc) for key, loc in value.items()}


@attrs.frozen
class Program:
    """A linear chain of tasks over named objects.

    ``final_locations`` says where named objects must be once the last task and every
    transfer it started are done (objects not named may be dropped). ``budget`` is
    optional: planners and the simulator can be handed one instead. ``prologue`` holds
    directives that fire at program start, before the first task. ``persistent`` names
    objects that outlive one run of the program (weights, optimizer state): when the
    program is one iteration of a loop, they carry from one iteration to the next (a
    cyclic plan chooses where each lives in between; docs/planning.md).
    """

    name: str
    objects: tuple[Obj, ...] = attrs.field(converter=tuple)
    tasks: tuple[Task, ...] = attrs.field(converter=tuple)
    final_locations: dict[str, Location] = attrs.field(
        factory=dict, converter=_frozen_locations, hash=False
    )
    budget: Budget | None = None
    links: Links = attrs.field(factory=Links)
    metadata: dict[str, Any] = attrs.field(factory=dict, hash=False)
    prologue: Prologue = attrs.field(factory=Prologue, metadata=OMIT_IF_DEFAULT)
    persistent: tuple[str, ...] = attrs.field(default=(), converter=tuple, metadata=OMIT_IF_DEFAULT)

    # -- lookups -------------------------------------------------------------------------
    @functools.cached_property
    def objects_by_id(self) -> dict[str, Obj]:
        return {obj.id: obj for obj in self.objects}

    @functools.cached_property
    def tasks_by_id(self) -> dict[str, Task]:
        return {task.id: task for task in self.tasks}

    @functools.cached_property
    def producers(self) -> dict[str, int]:
        """Object id -> index of the task that outputs it (first one, if several)."""
        produced: dict[str, int] = {}
        for index, task in enumerate(self.tasks):
            for obj in task.outputs:
                produced.setdefault(obj, index)
        return produced

    def obj(self, obj_id: str) -> Obj:
        try:
            return self.objects_by_id[obj_id]
        except KeyError:
            raise KeyError(f"program {self.name!r} has no object {obj_id!r}") from None

    def exists_at_start(self, obj_id: str) -> bool:
        """True when no task creates the object, so it is present (at its location) at start."""
        return obj_id not in self.producers

    @functools.cached_property
    def read_only_ids(self) -> frozenset[str]:
        """The persistent objects that no task changes (none mutates them): weights a
        step only reads (frozen ones, a LoRA base, an evaluation's). Each holds one value
        for the whole run, so a slow copy of it is current from the moment it is made."""
        changed = {obj for task in self.tasks for obj in task.mutates}
        return frozenset(
            obj
            for obj in self.persistent
            if obj not in changed and obj in self.objects_by_id and self.exists_at_start(obj)
        )

    @functools.cached_property
    def backed_ids(self) -> frozenset[str]:
        """The read-only persistent objects (``read_only_ids``) that start in fast memory
        and that the run ever holds in slow memory: some directive drops them, or they
        must end there. Their slow copy holds their start value from the start, so they
        start clean: dropping them is free, and no transfer ever writes them back
        (docs/execution_model.md, Object state)."""
        objects = self.objects_by_id
        fast = {o for o in self.read_only_ids if objects[o].location is Location.FAST}
        if not fast:
            return frozenset()
        dropped = {
            obj
            for issuer in (self.prologue, *self.tasks)
            for obj in (*issuer.releases, *issuer.offloads)
        }
        ending_slow = {o for o, where in self.final_locations.items() if where is Location.SLOW}
        return frozenset(fast & (dropped | ending_slow))

    def ever_slow_ids(self) -> set[str]:
        """The objects the run ever holds in slow memory: those that start there, the
        ``backed_ids`` and those some directive offloads (a run's slow pool holds one
        slice for each)."""
        slow = {
            obj.id
            for obj in self.objects
            if self.exists_at_start(obj.id) and obj.location is Location.SLOW
        }
        slow.update(self.backed_ids)
        for issuer in (self.prologue, *self.tasks):
            slow.update(issuer.offloads)
        return slow

    def duration_us(self, task: Task) -> float:
        """How long ``task`` runs: its ``cost_us`` on compute; on the collective link, the
        link's time for the bytes it reduces (its mutates)."""
        if not task.collective:
            return task.cost_us
        sizes = self.objects_by_id
        return self.links.collective_us(sum(sizes[obj].size_bytes for obj in task.mutates))

    # -- changes -------------------------------------------------------------------------
    def with_budget(self, fast_bytes: int, slow_bytes: int | None = None) -> Program:
        return attrs.evolve(self, budget=Budget(fast_bytes=fast_bytes, slow_bytes=slow_bytes))

    def bare(self) -> Program:
        """The same chain with every directive removed (the prologue's too)."""
        prologue = self.prologue
        if not (prologue.releases or prologue.offloads or prologue.prefetches) and not any(
            task.releases or task.offloads or task.prefetches for task in self.tasks
        ):
            return self
        return attrs.evolve(
            self,
            tasks=tuple(task.without_directives() for task in self.tasks),
            prologue=Prologue(),
        )

    # -- wire form -----------------------------------------------------------------------
    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Program:
        return program_from_dict(cls, data)

    @classmethod
    def from_json(cls, text_or_path: str | Path) -> Program:
        """Read a program from JSON text or from a path to a JSON file."""
        return program_from_json(cls, text_or_path)

    def to_dict(self) -> dict[str, Any]:
        return program_to_dict(self)

    def to_json(self, *, indent: int | None = 1) -> str:
        return program_to_json(self, indent=indent)
