"""``RunResult``: what an engine run measured, in the simulator's event form."""

from __future__ import annotations

import statistics
from pathlib import Path
from typing import Any

import attrs

from dataflow.engine.dispatcher import DispatchTrace
from dataflow.schema import Program
from dataflow.timeline import (
    Counter,
    TaskSpan,
    Timeline,
    TransferSpan,
    chrome_trace,
    write_trace_document,
)


@attrs.frozen
class RunResult:
    """Measured run of ``steps`` steps.

    ``steps`` holds each step's trace (task spans, transfers, fast/slow memory from the
    ledger). ``makespan_us`` is the median step makespan; ``fast_peak_bytes`` the largest
    ledger peak; ``allocator_peak_bytes`` the device allocator's own peak (CUDA only;
    None elsewhere). ``predicted_makespan_us`` is the plan's simulated makespan when the
    loaded plan carried one.
    """

    program: Program = attrs.field(repr=False, eq=False)
    backend: str
    steps: tuple[DispatchTrace, ...]
    budget_bytes: int | None
    predicted: Any = attrs.field(default=None, repr=False, eq=False)
    allocator_peak_bytes: int | None = None
    #: per step, host microseconds spent launching each task (empty on the virtual backend)
    launch_host_us: tuple[tuple[float, ...], ...] = ()

    @classmethod
    def from_traces(
        cls,
        program: Program,
        backend: str,
        traces: list[DispatchTrace],
        budget_bytes: int | None,
        *,
        predicted: Any = None,
        allocator_peak_bytes: int | None = None,
        launch_host_us: tuple[tuple[float, ...], ...] = (),
    ) -> RunResult:
        return cls(
            program,
            backend,
            tuple(traces),
            budget_bytes,
            predicted,
            allocator_peak_bytes,
            launch_host_us,
        )

    def task_gaps_us(self, step: int = -1) -> list[float]:
        """Compute idle time between consecutive tasks of one step: the next task's start
        minus the previous one's end. On a real backend this is what dispatch costs the
        device (waiting for inputs or memory shows here too)."""
        spans = sorted((t.start_us, t.end_us) for t in self.steps[step].tasks)
        return [nxt[0] - cur[1] for cur, nxt in zip(spans, spans[1:], strict=False)]

    @property
    def makespan_us(self) -> float:
        return statistics.median(trace.makespan_us for trace in self.steps)

    @property
    def fast_peak_bytes(self) -> int:
        return max(trace.fast_peak_bytes for trace in self.steps)

    @property
    def slow_peak_bytes(self) -> int:
        return max(trace.slow_peak_bytes for trace in self.steps)

    @property
    def predicted_makespan_us(self) -> float | None:
        return None if self.predicted is None else self.predicted.makespan_us

    @property
    def measured_over_predicted(self) -> float | None:
        predicted = self.predicted_makespan_us
        return None if not predicted else self.makespan_us / predicted

    def to_timeline(self, step: int = -1, name: str | None = None) -> Timeline:
        """One step as a neutral Timeline, comparable with ``SimResult.to_timeline``."""
        trace = self.steps[step]
        tasks = self.program.tasks_by_id
        budget = self.budget_bytes
        return Timeline(
            name=name or f"{self.program.name} (measured, {self.backend})",
            tasks=[
                TaskSpan(
                    record.task,
                    record.start_us,
                    record.end_us,
                    kind=tasks[record.task].kind,
                    args={
                        "cost_us": tasks[record.task].cost_us,
                        "measured_us": record.end_us - record.start_us,
                    },
                    track="collective" if tasks[record.task].collective else "compute",
                )
                for record in trace.tasks
            ],
            transfers=[
                TransferSpan(
                    t.obj,
                    t.direction,
                    t.size_bytes,
                    t.start_us,
                    t.end_us,
                    enqueue_us=t.enqueue_us,
                    enqueued_by=t.by_task,
                )
                for t in trace.transfers
                if t.start_us is not None and t.end_us is not None
            ],
            counters=[
                Counter("fast memory", trace.fast_counter, limit=budget),
                Counter("slow memory", trace.slow_counter),
            ],
            metadata={
                "source": "dataflow.engine",
                "backend": self.backend,
                "makespan_us": trace.makespan_us,
            },
        )

    def to_chrome_trace(
        self, path: str | Path | None = None, *, step: int = -1, with_prediction: bool = True
    ) -> dict[str, Any]:
        """The trace-event document of one step; with the plan's prediction beside it as a
        second process when the loaded plan carried a recorded simulation."""
        timelines = [self.to_timeline(step)]
        predicted = self.predicted
        if with_prediction and predicted is not None and getattr(predicted, "recorded", False):
            timelines.insert(0, predicted.to_timeline(f"{self.program.name} (predicted)"))
        document = chrome_trace(*timelines)
        if path is not None:
            write_trace_document(path, document)
        return document
