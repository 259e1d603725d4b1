"""``plan``: a chain, a budget and a planner in, a simulated Plan out.

``plan`` is pure: it is handed the planner (a ``PlannerSpec`` or a plain callable; the
default is the core's PressureFit) and never looks one up in a plugin registry. Whatever
the planner returns is re-run by the simulator before it is handed back: ``plan`` never
returns a plan that fails (a cyclic plan is also re-run over two iterations).
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator
from typing import Any

import attrs

from dataflow.planning.cycle import CycleCheck, check_cycle
from dataflow.planning.intervals import PlanningError
from dataflow.planning.lower_bound import ChainBounds, LowerBound, lower_bound
from dataflow.registry import PlannerSpec
from dataflow.schema import Program
from dataflow.sim import SimResult, simulate

DEFAULT_PLANNER = "pressurefit"

#: What ``plan`` accepts as a planner: a spec, or ``fn(program, budget_bytes, **options)``.
Planner = PlannerSpec | Callable[..., Program]


def _plan_pressurefit(program: Program, budget_bytes: int, **options: Any) -> Program:
    from dataflow.planning.pressurefit import plan_pressurefit

    return plan_pressurefit(program, budget_bytes, **options)


def _run_planner(
    spec: PlannerSpec, program: Program, budget_bytes: int, options: dict[str, Any]
) -> tuple[Program, ChainBounds | None, bool]:
    """The planned program, the chain's bounds when the planner worked them out, and
    whether the planned program still needs ``validate`` before it is simulated.

    PressureFit validated the bare chain before planning it, and the directives it writes
    are well formed by construction (a test validates its plans of every shape), so its
    plan of one run is not validated twice; its search's bounds are reused. Any other
    planner's plan, and a cyclic plan (its objects homed anew), is validated in full."""
    if spec.plan is not _plan_pressurefit:
        return spec.plan(program, budget_bytes, **options), None, True
    from dataflow.planning.pressurefit import pressurefit

    found = pressurefit(program, budget_bytes, **options)
    return found.program, found.bounds, bool(options.get("cyclic"))


def _minimal_pressurefit(program: Program, **options: Any) -> int:
    from dataflow.planning.feasibility import minimal_budget

    return minimal_budget(program, **options)


#: The core's planner; the builtins plugin registers this very record.
PRESSUREFIT = PlannerSpec(
    DEFAULT_PLANNER,
    _plan_pressurefit,
    "cut residency where memory is over budget, prefetch just in time (the core's)",
    minimal_budget=_minimal_pressurefit,
)


def as_planner_spec(planner: Planner) -> PlannerSpec:
    """``planner`` as a spec: a callable is named after its ``__name__``."""
    if isinstance(planner, PlannerSpec):
        return planner
    if not callable(planner):
        raise TypeError(
            f"planner must be a PlannerSpec or a callable, got {type(planner).__name__} "
            f"{planner!r} (resolve a planner name with dataflow.plugins.planners().get(NAME))"
        )
    name = "".join(getattr(planner, "__name__", "planner").split()) or "planner"
    return PlannerSpec(name, planner)


@attrs.frozen
class Plan:
    """A planned program and what the simulator says of it.

    ``program`` is the annotated program (its budget set to ``budget_bytes``); ``sim`` its
    recorded simulation; ``lower_bound`` the bounds no plan of the chain can beat;
    ``planner`` the planner's name and ``spec`` the planner itself; ``planning_s`` the
    planner's wall time. ``cycle`` is the two-iteration check of a cyclic plan (None when
    not cyclic).
    """

    program: Program
    sim: SimResult
    lower_bound: LowerBound
    budget_bytes: int
    slow_budget_bytes: int | None
    planner: str
    planning_s: float
    spec: PlannerSpec = attrs.field(default=PRESSUREFIT, eq=False, repr=False)
    cycle: CycleCheck | None = None

    @property
    def cyclic(self) -> bool:
        return self.cycle is not None

    @property
    def lower_bound_us(self) -> float:
        """The best (largest) lower bound: compute-only, link-aware, volume or handoff."""
        return self.lower_bound.best_us

    @property
    def makespan_us(self) -> float:
        return self.sim.makespan_us

    @property
    def makespan_ratio(self) -> float:
        """Makespan over the lower bound (1.0 = provably optimal); for a cyclic plan, the
        steady-state iteration time over it."""
        bound = self.lower_bound_us
        measured = self.cycle.iteration_us if self.cycle is not None else self.makespan_us
        return measured / bound if bound > 0 else 1.0

    @property
    def moved_bytes(self) -> int:
        return self.sim.h2d.bytes + self.sim.d2h.bytes


def plan(
    program: Program,
    budget_bytes: int,
    *,
    planner: Planner = PRESSUREFIT,
    slow_budget_bytes: int | None = None,
    cyclic: bool = False,
) -> Plan:
    """Plan ``program`` for a fast-memory budget of ``budget_bytes`` with ``planner``.

    PressureFit plans the bare chain: directives already in ``program`` are dropped. With
    ``cyclic`` the program is planned as one iteration of a loop (see docs/planning.md,
    Steady-state plans): its ``persistent`` objects get a home between iterations, and the
    plan is checked over two consecutive iterations (``Plan.cycle``).

    Raises ``InfeasibleBudget`` (with the smallest budget that works and the task that
    forces it) when no plan fits, and ``PlanningError`` when the chain cannot be planned at
    all or the planner returns a plan the simulator rejects.

    Python's cyclic garbage collector is paused while it plans (``collector_paused``).
    """
    with collector_paused():
        return _plan(program, budget_bytes, planner, slow_budget_bytes, cyclic)


@contextlib.contextmanager
def collector_paused() -> Iterator[None]:
    """Pause Python's cyclic garbage collector, and restore it as it was.

    Planning allocates hundreds of thousands of small lists and tuples (per task, per
    gap, per candidate) that die by reference counting; each allocation burst also counts
    towards the collector's thresholds, whose full passes then walk every container the
    process holds: the chain itself (a Task and its tuples per task) and whatever the
    caller holds (a model, a dataset), so that 15-20 % of a 10,000-task plan went to them
    on an otherwise empty interpreter. The little cyclic garbage planning leaves (nested
    functions of a search) is collected once the collector runs again."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _plan(
    program: Program,
    budget_bytes: int,
    planner: Planner,
    slow_budget_bytes: int | None,
    cyclic: bool,
) -> Plan:
    spec = as_planner_spec(planner)
    options: dict[str, Any] = {}
    if slow_budget_bytes is not None:
        options["slow_budget_bytes"] = slow_budget_bytes
    if cyclic:
        options["cyclic"] = True
    started = time.perf_counter()
    planned, bounds, check = _run_planner(spec, program, budget_bytes, options)
    planning_s = time.perf_counter() - started
    sim = simulate(
        planned, budget_bytes=budget_bytes, slow_budget_bytes=slow_budget_bytes, check=check
    )
    if not sim.valid:
        raise PlanningError(
            f"planner {spec.name!r} returned a plan of {program.name!r} that fails in the "
            f"simulator at a budget of {budget_bytes} bytes: {sim.error}"
        )
    cycle = None
    if cyclic:
        cycle = check_cycle(planned, budget_bytes, slow_budget_bytes)
        if not cycle.valid:
            raise PlanningError(
                f"planner {spec.name!r} returned a cyclic plan of {program.name!r} that does "
                f"not repeat at a budget of {budget_bytes} bytes: {cycle.problem}"
            )
    if bounds is None:
        bound = lower_bound(planned, budget_bytes, cyclic=cyclic)  # directives ignored
    else:
        bound = bounds.at(budget_bytes)
    return Plan(
        program=planned,
        sim=sim,
        lower_bound=bound,
        budget_bytes=budget_bytes,
        slow_budget_bytes=slow_budget_bytes,
        planner=spec.name,
        planning_s=planning_s,
        spec=spec,
        cycle=cycle,
    )
