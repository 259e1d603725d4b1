"""``Plan``: a planned program and what the simulator says of it; ``Planner``: what plans.

``plan`` (``api.py``) makes a ``Plan``; placement, arena and the engine read it. A planner
is a ``PlannerSpec`` or a plain callable ``fn(program, budget_bytes, **options)``
(``as_planner_spec``); ``PlannerRun`` is what a spec's optional ``run`` returns.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from dataflow.planning.cycle import CycleCheck
from dataflow.planning.lower_bound import ChainBounds, LowerBound
from dataflow.registry import PlannerSpec
from dataflow.schema import Program
from dataflow.sim import SimResult

#: What ``plan`` accepts as a planner: a spec, or ``fn(program, budget_bytes, **options)``.
Planner = PlannerSpec | Callable[..., Program]


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
class PlannerRun:
    """A planned program and what its planner worked out on the way (``PlannerSpec.run``).

    ``bounds`` are the bare chain's lower bounds at any budget (``ChainBounds``; None when
    the planner did not bound the chain); ``checked``: the program is well formed by
    construction (its chain was validated before planning and the directives written are
    well formed), so ``plan`` simulates it without ``validate``.
    """

    program: Program
    bounds: ChainBounds | None = attrs.field(default=None, eq=False, repr=False)
    checked: bool = False


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
    spec: PlannerSpec = attrs.field(eq=False, repr=False)
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
