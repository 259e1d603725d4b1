"""A neutral timeline: what ran when, on which resource, and memory over time.

Predicted runs (the simulator) and measured runs (the engine) both convert to a
``Timeline``, so one writer shows either, or both side by side. Nothing here knows where
a timeline came from.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import attrs

#: The transfer directions, each one track: slow -> fast and fast -> slow.
DIRECTIONS = ("h2d", "d2h")


def _frozen_args(value: Mapping[str, Any]) -> dict[str, Any]:
    return dict(value)


@attrs.frozen
class TaskSpan:
    """One task on the compute track. ``args`` are shown with the span (names, sizes);
    ``inputs``, ``mutates`` and ``outputs`` there (object -> bytes), where a timeline
    carries them, say what the task read and wrote (flows and stalls are drawn from
    them)."""

    task_id: str
    start_us: float
    end_us: float
    kind: str = ""
    args: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_args, hash=False)

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@attrs.frozen
class TransferSpan:
    """One transfer of ``obj_id`` on the ``direction`` track (``h2d`` or ``d2h``).

    ``enqueue_us`` and ``enqueued_by`` (the task whose directive asked for it) are optional:
    a measured run may not know them.
    """

    obj_id: str
    direction: str = attrs.field(validator=attrs.validators.in_(DIRECTIONS))
    size_bytes: int
    start_us: float
    end_us: float
    enqueue_us: float | None = None
    enqueued_by: str | None = None

    @property
    def duration_us(self) -> float:
        return self.end_us - self.start_us


@attrs.frozen
class Counter:
    """A value over time, a step function: ``points`` are (time_us, value) in time order,
    each value holding until the next point. ``limit`` (a budget) is shown with it."""

    name: str
    points: tuple[tuple[float, float], ...] = attrs.field(converter=tuple)
    unit: str = "bytes"
    limit: float | None = None

    @property
    def peak(self) -> float:
        return max((value for _, value in self.points), default=0)


@attrs.frozen
class Instant:
    """A moment on a track (``compute`` by default): a stall, say, with what it waited for
    in ``args``."""

    name: str
    time_us: float
    track: str = "compute"
    args: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_args, hash=False)


@attrs.frozen
class Timeline:
    """One run: task spans, transfer spans, counters (fast and slow memory) and instants.

    ``name`` labels the run in a viewer (``"predicted"``, ``"measured"``, a plan's name).
    """

    name: str
    tasks: tuple[TaskSpan, ...] = attrs.field(default=(), converter=tuple)
    transfers: tuple[TransferSpan, ...] = attrs.field(default=(), converter=tuple)
    counters: tuple[Counter, ...] = attrs.field(default=(), converter=tuple)
    metadata: dict[str, Any] = attrs.field(factory=dict, converter=_frozen_args, hash=False)
    instants: tuple[Instant, ...] = attrs.field(default=(), converter=tuple)

    @property
    def end_us(self) -> float:
        """The last moment anything happens on the timeline."""
        ends = [span.end_us for span in self.tasks] + [span.end_us for span in self.transfers]
        ends += [time_us for counter in self.counters for time_us, _ in counter.points]
        return max(ends, default=0.0)

    def counter(self, name: str) -> Counter | None:
        """The counter named ``name`` (None when there is none)."""
        return next((c for c in self.counters if c.name == name), None)

    def transfers_on(self, direction: str) -> tuple[TransferSpan, ...]:
        return tuple(span for span in self.transfers if span.direction == direction)
