"""Building a bundle from a placed plan, and a measured timeline from engine runs.

``predicted_timeline(placement)`` is the plan's simulated step (``SimResult.to_timeline``)
with more counters and the stalls:

- fast memory by role (``fast memory: params``, ``grads``, ``optimizer state``,
  ``activations``, ``aux``, ``other``, ``workspace``), from the placement's blocks: every
  object's bytes counted under its ``Obj.role`` while it holds fast memory;
- each link's rate (``h2d GB/s``, ...): a transfer's bytes over its time while it runs;
- an instant wherever compute waited (``Instant`` named ``stall``): the task that waited,
  for how long, and for what (``objects`` whose copy into fast memory ended in the gap,
  ``memory`` when a write-back freed room there, else ``dispatch``).

``measured_timeline(program, steps, predicted)`` turns per-step engine timelines into one
measured Timeline: the spans of the last step that has them (a step replayed from a CUDA
graph has none), each task's args those of the predicted task plus ``measured_us`` and
the median over the steps (``median_us``), the link rates and stalls computed the same
way, the predicted fast memory by role moved onto the measured clock
(``warped_role_counters``), and every step's makespan in the metadata.
"""

from __future__ import annotations

import bisect
import itertools
import statistics
from collections.abc import Iterable, Mapping, Sequence
from typing import Any

import attrs

from dataflow.bundle.records import (
    Bundle,
    Directives,
    PlacedBlock,
    PlacementRecord,
    PlanRecord,
    Summary,
)
from dataflow.schema import PROLOGUE, Program, Role
from dataflow.timeline import Counter, Timeline
from dataflow.timeline.records import Instant

#: fast-memory counters by role: counter suffix -> the object roles it sums
ROLE_GROUPS: dict[str, tuple[Role, ...]] = {
    "params": (Role.PARAM,),
    "grads": (Role.GRAD,),
    "optimizer state": (Role.OPT_STATE,),
    "activations": (Role.ACTIVATION,),
    "aux": (Role.AUX, Role.AUX_TEMP),
    "other": (Role.DATA, Role.SCRATCH, Role.OUTPUT),
}
WORKSPACE = "workspace"
FAST_PREFIX = "fast memory: "
#: gaps on the compute track shorter than this are not stalls (float noise)
STALL_MIN_US = 1e-3


def role_counters(program: Program, blocks: Iterable[Any]) -> list[Counter]:
    """One fast-memory counter per role group (and task workspace), from placement
    blocks (anything with ``start_us``, ``end_us``, ``size_bytes``, ``obj_id``,
    ``task_id``). The budget is the total ``fast memory`` counter's limit."""
    group_of = {role: name for name, roles in ROLE_GROUPS.items() for role in roles}
    roles = {obj.id: group_of[obj.role] for obj in program.objects}
    changes: dict[str, list[tuple[float, int]]] = {name: [] for name in [*ROLE_GROUPS, WORKSPACE]}
    for block in blocks:
        group = roles[block.obj_id] if block.obj_id is not None else WORKSPACE
        changes[group] += [(block.start_us, block.size_bytes), (block.end_us, -block.size_bytes)]
    return [
        Counter(f"{FAST_PREFIX}{name}", step_points(deltas)) for name, deltas in changes.items()
    ]


def step_points(deltas: Iterable[tuple[float, float]]) -> list[tuple[float, float]]:
    """A step function from ``(time, change)`` pairs: one point per instant, the value
    after every change at it, starting at ``(0, 0)``."""
    totals: dict[float, float] = {0.0: 0.0}
    for time_us, change in deltas:
        totals[time_us] = totals.get(time_us, 0.0) + change
    points, value = [], 0.0
    for time_us in sorted(totals):
        value += totals[time_us]
        points.append((time_us, value))
    return points


def link_counters(timeline: Timeline) -> list[Counter]:
    """Each link's rate over time in GB/s (``<link> GB/s``): bytes over duration while a
    transfer runs, 0 between them."""
    links = sorted({span.direction for span in timeline.transfers})
    counters = []
    for link in links:
        rates: dict[float, float] = {0.0: 0.0}
        for span in sorted(timeline.transfers_on(link), key=lambda s: s.start_us):
            rates.setdefault(span.end_us, 0.0)  # a transfer that starts here overrides it
            if span.duration_us > 0:
                rates[span.start_us] = span.size_bytes / span.duration_us / 1e3
        counters.append(Counter(f"{link} GB/s", sorted(rates.items()), unit="GB/s"))
    return counters


def stalls(timeline: Timeline, program: Program) -> list[Instant]:
    """An ``Instant`` at the start of every task that started after the one before it
    ended (the first: after time 0): what it waited for (module docstring)."""
    tasks = program.tasks_by_id
    spans = sorted(timeline.tasks, key=lambda s: s.start_us)
    instants = []
    previous_end = 0.0
    for span in spans:
        gap = span.start_us - previous_end
        if gap > STALL_MIN_US and span.task_id in tasks:
            instants.append(_stall(timeline, tasks[span.task_id], span.start_us, previous_end))
        previous_end = max(previous_end, span.end_us)
    return instants


def _stall(timeline: Timeline, task: Any, start_us: float, since_us: float) -> Instant:
    def ended_in_gap(direction: str) -> list[str]:
        return [
            t.obj_id
            for t in timeline.transfers_on(direction)
            if since_us - STALL_MIN_US < t.end_us <= start_us + STALL_MIN_US
        ]

    wanted = set(task.inputs) | set(task.mutates)
    objects = [obj for obj in ended_in_gap("h2d") if obj in wanted]
    written_back = ended_in_gap("d2h")
    reason = "inputs" if objects else "memory" if written_back else "dispatch"
    args: dict[str, Any] = {
        "task": task.id,
        "waited_us": start_us - since_us,
        "reason": reason,
        "objects": objects or written_back,
    }
    listed = ", ".join(args["objects"][:3])
    what = {
        "inputs": listed,
        "memory": f"room (write-back of {listed})",
        "dispatch": "the host",
    }[reason]
    return Instant(f"stall: {task.id} waits for {what}", start_us, args=args)


def predicted_timeline(placement: Any, name: str = "predicted") -> Timeline:
    """The placed plan's simulated step with role and link counters and its stalls."""
    planned = placement.plan
    base = planned.sim.to_timeline(name)
    counters = [
        *base.counters,
        *role_counters(planned.program, placement.blocks),
        *link_counters(base),
    ]
    metadata = {**base.metadata, "budget_bytes": planned.budget_bytes, "planner": planned.planner}
    return attrs.evolve(
        base, counters=counters, instants=stalls(base, planned.program), metadata=metadata
    )


def measured_timeline(
    program: Program,
    steps: Sequence[Timeline],
    predicted: Timeline | None = None,
    *,
    name: str = "measured",
    metadata: Mapping[str, Any] | None = None,
) -> Timeline:
    """One measured Timeline of ``steps`` (``RunResult.to_timeline`` of each; module
    docstring). Raises ``ValueError`` when no step has task spans."""
    timed = [step for step in steps if step.tasks]
    if not timed:
        raise ValueError(
            "no measured step has task spans (steps replayed from a CUDA graph have none): "
            "trace a dispatched step"
        )
    base = timed[-1]
    known = {span.task_id: span.args for span in predicted.tasks} if predicted else {}
    durations: dict[str, list[float]] = {}
    for step in timed:
        for span in step.tasks:
            durations.setdefault(span.task_id, []).append(span.duration_us)
    tasks = [
        attrs.evolve(
            span,
            args={
                **known.get(span.task_id, {}),
                **span.args,
                "measured_us": span.duration_us,
                "median_us": statistics.median(durations[span.task_id]),
            },
        )
        for span in base.tasks
    ]
    timeline = attrs.evolve(base, name=name, tasks=tasks)
    makespans = [step.metadata.get("makespan_us") for step in steps]
    info = {
        **base.metadata,
        "steps": len(steps),
        "step_makespans_us": makespans,
        "replayed_steps": [i for i, step in enumerate(steps) if not step.tasks],
        **dict(metadata or {}),
    }
    roles = warped_role_counters(predicted, timeline) if predicted is not None else []
    return attrs.evolve(
        timeline,
        counters=[*base.counters, *roles, *link_counters(timeline)],
        instants=stalls(timeline, program),
        metadata=info,
    )


def warped_role_counters(predicted: Timeline, measured: Timeline) -> list[Counter]:
    """The predicted fast-memory-by-role counters on the measured clock. The engine's
    ledger counts bytes, not roles, but it holds exactly the plan's objects in the plan's
    order, so each predicted instant is moved to the measured time it corresponds to:
    linearly between the nearest task starts and ends, as both runs timed them. Between
    two task boundaries the measured order of transfers may differ slightly; the total
    ``fast memory`` counter of the measured run is the ledger's own."""
    measured_spans = {span.task_id: span for span in measured.tasks}
    anchors = sorted(
        (at_predicted, at_measured)
        for span in predicted.tasks
        if (other := measured_spans.get(span.task_id)) is not None
        for at_predicted, at_measured in (
            (span.start_us, other.start_us),
            (span.end_us, other.end_us),
        )
    )
    if len(anchors) < 2:
        return []
    xs = [x for x, _ in anchors]
    ys = list(itertools.accumulate((y for _, y in anchors), max))  # a clock never runs back
    return [
        attrs.evolve(counter, points=[(_interpolate(xs, ys, t), v) for t, v in counter.points])
        for counter in predicted.counters
        if counter.name.startswith(FAST_PREFIX)
    ]


def _interpolate(xs: Sequence[float], ys: Sequence[float], x: float) -> float:
    """Piecewise-linear ``y(x)`` through the points (``xs`` sorted), flat beyond them."""
    i = bisect.bisect_right(xs, x)
    if i == 0:
        return ys[0]
    if i == len(xs):
        return ys[-1]
    x0, x1, y0, y1 = xs[i - 1], xs[i], ys[i - 1], ys[i]
    return y0 if x1 == x0 else y0 + (y1 - y0) * (x - x0) / (x1 - x0)


def plan_record(placement: Any, recomputed: Sequence[str] = ()) -> PlanRecord:
    """``plan.json``'s record of a placement and the plan it packed."""
    planned = placement.plan
    program = planned.program
    directives = {}
    for holder in (program.prologue, *program.tasks):
        if holder.releases or holder.offloads or holder.prefetches:
            key = PROLOGUE if holder is program.prologue else holder.id
            directives[key] = Directives(holder.releases, holder.offloads, holder.prefetches)
    blocks = tuple(
        PlacedBlock(b.offset_bytes, b.size_bytes, b.start_us, b.end_us, b.obj_id, b.task_id)
        for b in placement.blocks
    )
    return PlanRecord(
        planner=planned.planner,
        budget_bytes=placement.budget_bytes,
        planned_budget_bytes=planned.budget_bytes,
        slow_budget_bytes=planned.slow_budget_bytes,
        cyclic=planned.cyclic,
        step_us=step_us(planned),
        makespan_us=planned.sim.makespan_us,
        lower_bound_us=planned.lower_bound_us,
        directives=directives,
        placement=PlacementRecord(
            placement.arena_bytes,
            placement.peak_bytes,
            placement.workspace_outside_bytes,
            blocks,
        ),
        recomputed=tuple(recomputed),
    )


def step_us(planned: Any) -> float:
    """One step of a plan: a cyclic plan's steady-state iteration, else the makespan."""
    return planned.cycle.iteration_us if planned.cycle is not None else planned.sim.makespan_us


def plan_summary(placement: Any, pricing: str, **fields: Any) -> Summary:
    """The summary of a placed plan from its simulation alone; ``fields`` add or
    override (a training export gives tokens, FLOP rates, preset and shape)."""
    planned = placement.plan
    sim = planned.sim
    step = step_us(planned)
    links = sim.links
    base: dict[str, Any] = {
        "step_s": step / 1e6,
        "fast_peak_bytes": sim.fast_peak_bytes,
        "backing_peak_bytes": sim.slow_peak_bytes,
        "budget_bytes": placement.budget_bytes,
        "backing_budget_bytes": planned.slow_budget_bytes,
        "moved_bytes": {name: stats.bytes for name, stats in links.items()},
        "link_busy_pct": {name: 100 * stats.busy_us / step for name, stats in links.items()}
        if step > 0
        else {name: 0.0 for name in links},
        "compute_idle_pct": 100 * sim.compute_idle_fraction,
        "recompute_pct": 0.0,
        "lower_bound_s": planned.lower_bound_us / 1e6,
        "planner": planned.planner,
        "pricing": pricing,
    }
    return Summary(**(base | fields))


def bundle_of(
    placement: Any,
    summary: Summary,
    *,
    recomputed: Sequence[str] = (),
    measured: Timeline | None = None,
) -> Bundle:
    """The bundle of a placed plan (``dataflow.planning.place``'s Placement)."""
    return Bundle(
        program=placement.plan.program,
        plan=plan_record(placement, recomputed),
        timeline=predicted_timeline(placement),
        summary=summary,
        measured=measured,
    )
