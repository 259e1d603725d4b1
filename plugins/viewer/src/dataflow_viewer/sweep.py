"""A budget sweep: the predicted step at a handful of fast budgets, from the smallest one
the chain plans for (``dataflow.planning.minimal_budget``) to the no-offload peak (what
the step holds when planned into a budget nothing has to leave: above it, a bigger budget
changes nothing)."""

from __future__ import annotations

from typing import Any

import attrs

from dataflow import PlanningError, Program, minimal_budget, plan
from dataflow_viewer.metrics import StepWork
from dataflow_viewer.run import planner_spec

#: a budget no single-device step reaches: planning into it releases but never offloads
UNBOUNDED_BYTES = 1 << 50


@attrs.frozen
class SweepPoint:
    budget_bytes: int
    step_s: float | None  # None: the planner found no plan at this budget
    tok_s: float | None
    reason: str = ""


def no_offload_peak_bytes(program: Program, planner: Any) -> int:
    """The fast peak of ``program`` planned into an unbounded budget."""
    return plan(program, UNBOUNDED_BYTES, planner=planner).sim.fast_peak_bytes


def sweep(
    program: Program, work: StepWork | None, planner: str = "pressurefit", points: int = 6
) -> list[SweepPoint]:
    """``points`` budgets evenly spaced from the minimum (the planner's own
    ``minimal_budget`` where it has one, else PressureFit's) to the no-offload peak, each
    planned with ``planner`` and simulated. A budget the planner cannot plan is a point
    with ``step_s`` None and the planner's reason."""
    if points < 2:
        raise ValueError(f"a sweep needs at least 2 points, not {points}")
    spec = planner_spec(planner)
    bare = program.bare()
    low = spec.minimal_budget(bare) if spec.minimal_budget else minimal_budget(bare)
    high = max(no_offload_peak_bytes(bare, spec), low)
    budgets = sorted({low + (high - low) * i // (points - 1) for i in range(points)})
    found = []
    for budget in budgets:
        try:
            planned = plan(bare, budget, planner=spec)
        except PlanningError as exc:
            found.append(SweepPoint(budget, None, None, " ".join(str(exc).split())))
            continue
        step_s = planned.sim.makespan_us / 1e6
        found.append(SweepPoint(budget, step_s, work.tokens / step_s if work else None))
    return found
