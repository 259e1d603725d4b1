"""SimResult: what one simulated run of a Program gives, and its conversion to a Timeline."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs

from dataflow.schema import Program
from dataflow.sim.failure import FailureKind, SimError
from dataflow.sim.records import LinkStats, TaskTiming, TransferTiming
from dataflow.timeline import Counter, TaskSpan, Timeline, TransferSpan
from dataflow.timeline.chrome import chrome_trace, write_trace_document

FAST_MEMORY = "fast memory"
SLOW_MEMORY = "slow memory"


@attrs.frozen
class SimResult:
    """One run of a Program under the execution model (docs/execution_model.md).

    Totals are always filled: ``valid``; ``makespan_us`` (the end of the run, or the moment
    of failure); fast and slow peaks; compute busy and idle time; per-link stats. On
    failure ``error`` says why (``valid`` is then False).

    The per-event timeline is filled only when simulated with ``record=True`` (the
    default): ``tasks`` (in chain order, the tasks that ended), ``transfers`` (in the order
    they ended), ``fast_memory`` and ``slow_memory`` as (time_us, bytes in use) after
    every change, starting at time 0. With ``record=False`` they are empty and
    ``recorded`` is False; everything else is identical. ``resident_at_end`` and
    ``slow_current_at_end`` say where every object's value is when the run ends.
    """

    program_name: str
    valid: bool
    makespan_us: float
    fast_budget_bytes: int | None
    slow_budget_bytes: int | None
    fast_peak_bytes: int
    slow_peak_bytes: int
    compute_busy_us: float
    compute_idle_us: float
    h2d: LinkStats
    d2h: LinkStats
    error: SimError | None = None
    #: the collective link: its ``transfers`` are the collective tasks that ended, its
    #: ``bytes`` what they reduced
    collective: LinkStats = attrs.field(factory=lambda: LinkStats("collective", 0, 0, 0.0, 0.0))
    recorded: bool = True
    #: objects resident in fast memory, and those whose slow copy is current, at the end
    #: (or the failure), in declaration order
    resident_at_end: tuple[str, ...] = ()
    slow_current_at_end: tuple[str, ...] = ()
    tasks: tuple[TaskTiming, ...] = ()
    transfers: tuple[TransferTiming, ...] = ()
    fast_memory: tuple[tuple[float, int], ...] = ()
    slow_memory: tuple[tuple[float, int], ...] = ()
    #: the simulated program (for names, kinds and sizes in timelines); not compared
    program: Program | None = attrs.field(default=None, eq=False, repr=False)

    @property
    def deadlock(self) -> SimError | None:
        """The error when the run deadlocked, else None."""
        if self.error is not None and self.error.kind is FailureKind.DEADLOCK:
            return self.error
        return None

    @property
    def compute_idle_fraction(self) -> float:
        return self.compute_idle_us / self.makespan_us if self.makespan_us > 0 else 0.0

    @property
    def links(self) -> dict[str, LinkStats]:
        return {"h2d": self.h2d, "d2h": self.d2h}

    @property
    def collective_exposed_us(self) -> float:
        """Time the collective link was busy while compute was idle (needs ``record=True``):
        the part of the all-reduces that the step waits for. The rest
        (``collective.busy_us`` minus this) ran under compute, hidden."""
        if not self.recorded:
            raise ValueError("this result was simulated with record=False: it has no timeline")
        tasks_by_id = self.program.tasks_by_id if self.program is not None else {}
        on_link, computing = [], []
        for timing in self.tasks:
            task = tasks_by_id.get(timing.task_id)
            spans = on_link if task is not None and task.collective else computing
            spans.append((timing.start_us, timing.end_us))
        return exposed_us(on_link, computing)

    def to_timeline(self, name: str | None = None) -> Timeline:
        """The run as a neutral Timeline (needs ``record=True``)."""
        if not self.recorded:
            raise ValueError("this result was simulated with record=False: it has no timeline")
        tasks_by_id = self.program.tasks_by_id if self.program is not None else {}
        sizes = (
            {obj.id: obj.size_bytes for obj in self.program.objects}
            if self.program is not None
            else {}
        )
        task_spans = []
        for timing in self.tasks:
            task = tasks_by_id.get(timing.task_id)
            args: dict[str, Any] = {}
            kind = ""
            if task is not None:
                kind = task.kind
                args = _task_args(task, sizes)
            track = "collective" if task is not None and task.collective else "compute"
            task_spans.append(
                TaskSpan(timing.task_id, timing.start_us, timing.end_us, kind, args, track=track)
            )
        transfer_spans = [
            TransferSpan(
                obj_id=t.obj_id,
                direction=t.direction,
                size_bytes=t.size_bytes,
                start_us=t.start_us,
                end_us=t.end_us,
                enqueue_us=t.enqueue_us,
                enqueued_by=t.enqueued_by,
            )
            for t in self.transfers
        ]
        counters = [
            Counter(FAST_MEMORY, self.fast_memory, limit=self.fast_budget_bytes),
            Counter(SLOW_MEMORY, self.slow_memory, limit=self.slow_budget_bytes),
        ]
        metadata: dict[str, Any] = {
            "source": "dataflow.sim",
            "program": self.program_name,
            "valid": self.valid,
            "makespan_us": self.makespan_us,
        }
        if self.error is not None:
            metadata["error"] = str(self.error)
        return Timeline(
            name=name or f"{self.program_name} (predicted)",
            tasks=task_spans,
            transfers=transfer_spans,
            counters=counters,
            metadata=metadata,
        )

    def to_chrome_trace(
        self, path: str | Path | None = None, *, name: str | None = None
    ) -> dict[str, Any]:
        """The Chrome trace-event document of this run; also written to ``path`` if given.

        To put several runs side by side, convert each with ``to_timeline`` and pass them
        all to ``dataflow.timeline.write_chrome_trace``.
        """
        document = chrome_trace(self.to_timeline(name))
        if path is not None:
            write_trace_document(path, document)
        return document


def exposed_us(spans: list[tuple[float, float]], cover: list[tuple[float, float]]) -> float:
    """How much of ``spans`` (start, end) no span of ``cover`` overlaps."""
    merged: list[list[float]] = []
    for start, end in sorted(cover):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], end)
        else:
            merged.append([start, end])
    total = 0.0
    for start, end in spans:
        covered = sum(max(0.0, min(end, b) - max(start, a)) for a, b in merged)
        total += (end - start) - covered
    return total


def _task_args(task, sizes: dict[str, int]) -> dict[str, Any]:
    args: dict[str, Any] = {"cost_us": task.cost_us}
    if task.label:
        args["label"] = task.label
    for field in ("inputs", "mutates", "outputs"):
        names = getattr(task, field)
        if names:
            args[field] = {obj: sizes.get(obj) for obj in names}
    if task.workspace_bytes:
        args["workspace_bytes"] = task.workspace_bytes
    for field in ("releases", "offloads", "prefetches"):
        names = getattr(task, field)
        if names:
            args[field] = list(names)
    return args
