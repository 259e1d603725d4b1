"""Tasks: one unit of compute in the chain, and the directives that fire when it ends."""

from __future__ import annotations

import enum
from typing import Any

import attrs

from dataflow.schema.converter import OMIT_IF_DEFAULT


class Directive(enum.StrEnum):
    """What a task may ask for on completion, enqueued in this order."""

    RELEASE = "release"  # drop the fast copy (no write-back)
    OFFLOAD = "offload"  # copy fast -> slow when dirty, then drop the fast copy
    PREFETCH = "prefetch"  # copy slow -> fast once room for it can be reserved


class Resource(enum.StrEnum):
    """Where a task runs (docs/execution_model.md#resources)."""

    COMPUTE = "compute"  # the one compute resource, one task at a time, in chain order
    #: the collective link: an all-reduce of the objects the task mutates, over the fleet;
    #: timed by ``Links.collective``, overlapped with the compute tasks after it
    COLLECTIVE = "collective"


def _ids(value: Any) -> tuple[str, ...]:
    return tuple(value)


def _in_firing_order(issuer: Task | Prologue) -> tuple[tuple[Directive, str], ...]:
    return (
        tuple((Directive.RELEASE, obj) for obj in issuer.releases)
        + tuple((Directive.OFFLOAD, obj) for obj in issuer.offloads)
        + tuple((Directive.PREFETCH, obj) for obj in issuer.prefetches)
    )


@attrs.frozen
class Task:
    """One task of the chain.

    ``inputs`` are read, ``mutates`` changed in place, ``outputs`` created; each must be
    resident in fast memory while the task runs. ``workspace_bytes`` is extra fast memory
    held from the task's start to its end. ``releases`` / ``offloads`` / ``prefetches`` are
    the directives, fired when the task completes. ``resource`` is where it runs:
    ``compute`` (the default) or ``collective`` (an all-reduce of its ``mutates`` on the
    collective link, priced by ``Links.collective``; its ``cost_us`` is 0).
    """

    id: str
    kind: str
    compute_key: str
    params: dict[str, Any] = attrs.field(factory=dict, hash=False)
    inputs: tuple[str, ...] = attrs.field(default=(), converter=_ids)
    mutates: tuple[str, ...] = attrs.field(default=(), converter=_ids)
    outputs: tuple[str, ...] = attrs.field(default=(), converter=_ids)
    workspace_bytes: int = 0
    cost_us: float = 0.0
    releases: tuple[str, ...] = attrs.field(default=(), converter=_ids)
    offloads: tuple[str, ...] = attrs.field(default=(), converter=_ids)
    prefetches: tuple[str, ...] = attrs.field(default=(), converter=_ids)
    label: str = ""
    resource: Resource = attrs.field(
        default=Resource.COMPUTE, converter=Resource, metadata=OMIT_IF_DEFAULT
    )

    @property
    def collective(self) -> bool:
        """Whether the task runs on the collective link rather than on compute."""
        return self.resource is Resource.COLLECTIVE

    @property
    def uses(self) -> tuple[str, ...]:
        """Every object that must be resident while the task runs, in declaration order."""
        return self.inputs + self.mutates + self.outputs

    def directives(self) -> tuple[tuple[Directive, str], ...]:
        """The task's directives in firing order: releases, then offloads, then prefetches."""
        return _in_firing_order(self)

    def without_directives(self) -> Task:
        if not (self.releases or self.offloads or self.prefetches):
            return self
        return attrs.evolve(self, releases=(), offloads=(), prefetches=())


#: The name the prologue goes by where a task id would be (``TransferTiming.enqueued_by``,
#: error messages); no task may take it.
PROLOGUE = "<prologue>"


@attrs.frozen
class Prologue:
    """Directives that fire at program start, before the first task is dispatched, in the
    order of a task's completion: releases, then offloads, then prefetches. With it, an
    object that starts slow can be fetched for the very first task."""

    releases: tuple[str, ...] = attrs.field(default=(), converter=_ids)
    offloads: tuple[str, ...] = attrs.field(default=(), converter=_ids)
    prefetches: tuple[str, ...] = attrs.field(default=(), converter=_ids)

    id = PROLOGUE

    def directives(self) -> tuple[tuple[Directive, str], ...]:
        """The directives in firing order: releases, then offloads, then prefetches."""
        return _in_firing_order(self)

    def __bool__(self) -> bool:
        return bool(self.releases or self.offloads or self.prefetches)
