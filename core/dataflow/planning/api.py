"""``plan``: a chain and a budget in, a simulated Plan out, through the planner registry.

The planner is looked up by name in the plugin registry (``dataflow_planners`` hook), the
core's PressureFit like any third-party planner. Whatever the planner returns is re-run by
the simulator before it is handed back: ``plan`` never returns a plan that fails.
"""

from __future__ import annotations

import time

import attrs

from dataflow.planning.intervals import PlanningError
from dataflow.planning.lower_bound import LowerBound, lower_bound
from dataflow.schema import Program
from dataflow.sim import SimResult, simulate

DEFAULT_PLANNER = "pressurefit"


@attrs.frozen
class Plan:
    """A planned program and what the simulator says of it.

    ``program`` is the annotated program (its budget set to ``budget_bytes``); ``sim`` its
    recorded simulation; ``lower_bound`` the bounds no plan of the chain can beat;
    ``planning_s`` the planner's wall time.
    """

    program: Program
    sim: SimResult
    lower_bound: LowerBound
    budget_bytes: int
    slow_budget_bytes: int | None
    planner: str
    planning_s: float

    @property
    def lower_bound_us(self) -> float:
        """The best (largest) lower bound: compute-only, link-aware or volume."""
        return self.lower_bound.best_us

    @property
    def makespan_us(self) -> float:
        return self.sim.makespan_us

    @property
    def makespan_ratio(self) -> float:
        """Makespan over the lower bound (1.0 = provably optimal)."""
        bound = self.lower_bound_us
        return self.makespan_us / bound if bound > 0 else 1.0

    @property
    def moved_bytes(self) -> int:
        return self.sim.h2d.bytes + self.sim.d2h.bytes


def plan(
    program: Program,
    budget_bytes: int,
    *,
    planner: str = DEFAULT_PLANNER,
    slow_budget_bytes: int | None = None,
) -> Plan:
    """Plan ``program`` for a fast-memory budget of ``budget_bytes``.

    PressureFit plans the bare chain: directives already in ``program`` are dropped.
    Raises ``InfeasibleBudget`` (with the smallest budget that works and the task that
    forces it) when no plan fits, ``PlanningError`` when the chain cannot be planned at all
    or a planner returns a plan the simulator rejects, and ``UnknownNameError`` for a
    planner no plugin registers.
    """
    from dataflow.plugins import planners

    spec = planners().get(planner)
    options = {} if slow_budget_bytes is None else {"slow_budget_bytes": slow_budget_bytes}
    started = time.perf_counter()
    planned = spec.plan(program, budget_bytes, **options)
    planning_s = time.perf_counter() - started
    sim = simulate(planned, budget_bytes=budget_bytes, slow_budget_bytes=slow_budget_bytes)
    if not sim.valid:
        raise PlanningError(
            f"planner {planner!r} returned a plan of {program.name!r} that fails in the "
            f"simulator at a budget of {budget_bytes} bytes: {sim.error}"
        )
    return Plan(
        program=planned,
        sim=sim,
        lower_bound=lower_bound(planned.bare(), budget_bytes),
        budget_bytes=budget_bytes,
        slow_budget_bytes=slow_budget_bytes,
        planner=planner,
        planning_s=planning_s,
    )
