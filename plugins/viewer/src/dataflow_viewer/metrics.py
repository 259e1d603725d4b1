"""Figures worked out from a Timeline (and its program): a step's summary, the tasks whose
measured time deviates most from the prediction, what the compute stream waited for (by
object), and each link's use over time.

Predicted and measured timelines go through the same functions, so their figures compare
like with like.
"""

from __future__ import annotations

from collections import defaultdict
from typing import Any

import attrs

from dataflow import Counter, Program, Timeline, link_counters, stalls

FAST_MEMORY = "fast memory"


@attrs.frozen
class StepWork:
    """What one step of a lowered training program does: tokens and model FLOPs."""

    tokens: int
    model_flops: float


def step_work(program: Program) -> StepWork | None:
    """Tokens and model FLOPs of a program ``dataflow-training`` lowered; None for any
    other program (a hand-written chain has neither)."""
    from dataflow_training import Lowered, StepLayout, step_flops

    from dataflow import UnknownNameError

    if StepLayout.METADATA_KEY not in program.metadata:
        return None
    try:
        step = Lowered.read(program)
    except UnknownNameError:
        return None  # the family is not installed here: no FLOPs, the timeline still shows
    train = step.layout.train
    model, _executed = step_flops(step)
    return StepWork(tokens=train.batch * train.seq_len * train.rounds, model_flops=model)


def busy_us(spans: list[tuple[float, float]]) -> float:
    """The length of the union of ``(start, end)`` intervals."""
    total, end = 0.0, float("-inf")
    for start, stop in sorted(spans):
        if stop <= end:
            continue
        total += stop - max(start, end)
        end = stop
    return total


def summary(
    timeline: Timeline, work: StepWork | None, step_s: float | None = None
) -> dict[str, float | None]:
    """A step's figures (the report's cards); None where the timeline cannot say.

    ``step_s`` replaces the timeline's length as the step time (tokens/s and TFLOP/s
    follow it): a cyclic plan's steady-state iteration, or the median of measured steps;
    idle and recompute shares stay those of the traced step."""
    step_us = timeline.end_us
    compute_us = busy_us([(span.start_us, span.end_us) for span in timeline.tasks])
    recompute_us = sum(span.duration_us for span in timeline.tasks if span.kind == "rec")
    fast = [counter for counter in timeline.counters if counter.name == FAST_MEMORY]
    traced = step_us > 0
    step_s = step_s if step_s is not None else step_us / 1e6 if traced else None
    figures: dict[str, float | None] = {
        "step_s": step_s,
        "tok_s": work.tokens / step_s if work and step_s else None,
        "tflops": work.model_flops / step_s / 1e12 if work and step_s else None,
        "fast_peak_bytes": fast[0].peak if fast else None,
        "h2d_bytes": float(sum(t.size_bytes for t in timeline.transfers_on("h2d"))),
        "d2h_bytes": float(sum(t.size_bytes for t in timeline.transfers_on("d2h"))),
        "compute_idle_pct": 100 * (step_us - compute_us) / step_us if traced else None,
        "recompute_pct": 100 * recompute_us / step_us if traced else None,
    }
    return figures


@attrs.frozen
class Deviation:
    """One task's measured time against its predicted time (µs)."""

    task_id: str
    kind: str
    predicted_us: float
    measured_us: float

    @property
    def diff_us(self) -> float:
        return self.measured_us - self.predicted_us

    @property
    def ratio(self) -> float | None:
        return self.measured_us / self.predicted_us if self.predicted_us > 0 else None


def deviations(predicted: Timeline, measured: Timeline, top: int = 20) -> list[Deviation]:
    """The ``top`` tasks whose measured duration differs most from the predicted one (by
    absolute difference; ties by task id). Tasks only one side ran are left out."""
    measured_us: dict[str, float] = defaultdict(float)
    for span in measured.tasks:
        measured_us[span.task_id] += span.duration_us
    found = [
        Deviation(span.task_id, span.kind, span.duration_us, measured_us[span.task_id])
        for span in predicted.tasks
        if span.task_id in measured_us
    ]
    found.sort(key=lambda d: (-abs(d.diff_us), d.task_id))
    return found[:top]


def stall_instants(timeline: Timeline, program: Program) -> list[Any]:
    """The timeline's stall instants (``dataflow.bundle.stalls``); worked out from its
    spans when it carries none (a timeline written before they existed)."""
    found = [instant for instant in timeline.instants if instant.args.get("waited_us")]
    return found or stalls(timeline, program)


def stalls_by_object(timeline: Timeline, program: Program) -> list[tuple[str, float, int]]:
    """``(what, waited µs, times)``, most waited first: each stall's wait shared evenly by
    the objects it waited for (their copies in, or the write-backs that freed room), or
    put under ``(memory)``/``(dispatch)`` when it names none."""
    total: dict[str, float] = defaultdict(float)
    count: dict[str, int] = defaultdict(int)
    for instant in stall_instants(timeline, program):
        waited = float(instant.args["waited_us"])
        objects = list(instant.args.get("objects") or [f"({instant.args.get('reason', '?')})"])
        for obj in objects:
            total[obj] += waited / len(objects)
            count[obj] += 1
    return sorted(((k, total[k], count[k]) for k in total), key=lambda row: (-row[1], row[0]))


def link_rates(timeline: Timeline) -> dict[str, Counter]:
    """Each link's GB/s over time by link (``dataflow.bundle.link_counters``), the
    timeline's own counters where it has them."""
    found = {c.name.removesuffix(" GB/s"): c for c in timeline.counters if c.unit == "GB/s"}
    return found or {c.name.removesuffix(" GB/s"): c for c in link_counters(timeline)}


def budget_limit(timeline: Timeline) -> float | None:
    """The fast budget the timeline's fast-memory counter carries."""
    for counter in timeline.counters:
        if counter.name == FAST_MEMORY:
            return counter.limit
    return None
