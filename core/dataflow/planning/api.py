"""``plan``: a chain, a budget and a planner in, a simulated Plan out.

``plan`` is pure: it is handed the planner (a ``PlannerSpec`` or a plain callable; the
default is the core's PressureFit) and never looks one up in a plugin registry. Whatever
the planner returns is re-run by the simulator before it is handed back: ``plan`` never
returns a plan that fails (a cyclic plan is also re-run over two iterations).

This is planning's one orchestration module; the algorithms import only downward and
never call back up. Here alone they meet: PressureFit (``PRESSUREFIT``: its search, its
steady-state plans, and, when no plan fits, the smallest budget that works: bisection
over the search, then over placement), ``plan``, and ``place``, which hands the packer
the planner's own re-planner.
"""

from __future__ import annotations

import contextlib
import gc
import time
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import attrs

from dataflow.planning.cycle import check_cycle
from dataflow.planning.cyclic import steady_state, with_homes
from dataflow.planning.feasibility import (
    InfeasibleBudget,
    check_plannable,
    floor_bytes,
    infeasible_budget,
    raised_to_place,
    smallest_plannable,
)
from dataflow.planning.intervals import Chain, PlanningError, build_chain, no_offload_peak_bytes
from dataflow.planning.lower_bound import ChainBounds, lower_bound
from dataflow.planning.placement import REPLANS, Placement, Replan, pack_or_replan, pack_plan
from dataflow.planning.plans import Plan, Planner, PlannerRun, as_planner_spec
from dataflow.planning.pressurefit import best_plan, finds_plan
from dataflow.registry import PlannerSpec
from dataflow.schema import Budget, Program
from dataflow.sim import simulate

DEFAULT_PLANNER = "pressurefit"


# -- PressureFit ---------------------------------------------------------------------------


def plan_pressurefit(
    program: Program,
    budget_bytes: int,
    *,
    slow_budget_bytes: int | None = None,
    cyclic: bool = False,
    explain: bool = True,
    homes: Sequence[frozenset[str]] | None = None,
) -> Program:
    """The registered planner: ``program``'s bare chain with PressureFit's directives and
    the budget written in. Raises ``InfeasibleBudget`` (with the smallest budget that
    works) when no plan fits ``budget_bytes``; with ``explain=False`` a plain
    ``PlanningError`` instead, at once (searching for that smallest budget can take far
    longer than planning: callers that try many candidates and only need to know which
    fit, such as the training plugin's recompute planner, ask for this).

    Monotone in the budget: besides ``budget_bytes`` it sweeps at every rung of a fixed
    capacity ladder below it (``pressurefit.monotone_capacities``) and keeps the fastest,
    so a larger budget never gets a slower plan than those rungs give. With ``cyclic`` it
    plans one iteration of a loop (``plan_cyclic``; ``homes``: the sets of fast homes it
    tries, default its own)."""
    return run_pressurefit(
        program,
        budget_bytes,
        slow_budget_bytes=slow_budget_bytes,
        cyclic=cyclic,
        explain=explain,
        homes=homes,
    ).program


def run_pressurefit(
    program: Program,
    budget_bytes: int,
    *,
    slow_budget_bytes: int | None = None,
    cyclic: bool = False,
    explain: bool = True,
    homes: Sequence[frozenset[str]] | None = None,
) -> PlannerRun:
    """``plan_pressurefit``, with the bounds its search worked out (``PRESSUREFIT.run``):
    a one-run plan is well formed by construction (a test validates its plans of every
    shape), a cyclic one (its objects homed anew) is validated by ``plan``."""
    if homes is not None and not cyclic:
        raise PlanningError("homes (sets of fast homes) is an option of cyclic plans only")
    bare = program.bare()
    if slow_budget_bytes is None and program.budget is not None:
        slow_budget_bytes = program.budget.slow_bytes
    if cyclic:
        return PlannerRun(
            plan_cyclic(
                bare,
                budget_bytes,
                slow_budget_bytes=slow_budget_bytes,
                explain=explain,
                homes=homes,
            )
        )
    chain = check_plannable(bare, budget_bytes, slow_budget_bytes)
    bounds = ChainBounds(chain)
    planned = best_plan(chain, budget_bytes, slow_budget_bytes, bounds)
    if planned is None:
        if not explain:
            raise PlanningError(
                f"PressureFit found no plan of {program.name!r} within {budget_bytes} bytes "
                "(the smallest budget that works was not searched for: explain=False)"
            )
        planned = _at_the_minimum(
            chain,
            budget_bytes,
            slow_budget_bytes,
            lambda found: simulate(found, record=False, check=False).valid,
            bounds,
        )
    return PlannerRun(planned, bounds, checked=True)


def plan_cyclic(
    bare: Program,
    budget_bytes: int,
    *,
    slow_budget_bytes: int | None = None,
    explain: bool = True,
    homes: Sequence[frozenset[str]] | None = None,
) -> Program:
    """The steady-state plan of ``bare`` (one iteration, its persistent objects homed:
    ``cyclic.steady_state``; ``homes``: the sets of fast homes to try).

    When no home set plans at ``budget_bytes``, the search (a heuristic) may still plan at
    a smaller capacity, as the one-run planner finds: the smallest budget that works for
    one run is searched for, and the every-home-slow plan made there, if it repeats within
    ``budget_bytes``, is the answer; else the smallest budget a steady-state plan is found
    and placed at, and the plan made there if that is within ``budget_bytes``; else
    ``InfeasibleBudget`` names it. ``explain=False`` skips that and fails at once with a
    plain ``PlanningError``."""
    # a persistent object homed fast needs no slow memory: the search holds each home set
    # to the slow budget
    chain = check_plannable(
        with_homes(bare, frozenset()),
        budget_bytes,
        slow_budget_bytes,
        homed=frozenset(bare.persistent),
    )
    found = steady_state(bare, chain, budget_bytes, slow_budget_bytes, homes)
    if found is not None:
        return found
    if not explain:
        raise PlanningError(
            f"PressureFit found no steady-state plan of {bare.name!r} within {budget_bytes} "
            "bytes (the smallest budget that works was not searched for: explain=False)"
        )

    def repeats(found: Program) -> bool:
        return check_cycle(found, budget_bytes, slow_budget_bytes).valid

    try:
        return _at_the_minimum(chain, budget_bytes, slow_budget_bytes, repeats)
    except InfeasibleBudget:
        pass  # the one-run minimum is not the steady state's: search for that
    plannable, minimum = _cyclic_minimum(bare, chain, slow_budget_bytes)
    if minimum <= budget_bytes:
        found = steady_state(bare, chain, minimum, slow_budget_bytes)
        if found is not None:
            found = attrs.evolve(found, budget=Budget(budget_bytes, slow_budget_bytes))
            if repeats(found):
                return found
    raise infeasible_budget(chain, budget_bytes, plannable, minimum, slow_budget_bytes)


def _at_the_minimum(
    chain: Chain,
    budget_bytes: int,
    slow_budget_bytes: int | None,
    runs: Callable[[Program], bool],
    bounds: ChainBounds | None = None,
) -> Program:
    """For a chain the search found no plan of at ``budget_bytes``: the search is a
    heuristic, and the smallest budget that works is found by sweeping at it, so the plan
    made at that smaller capacity, with ``budget_bytes`` written in, when ``runs`` accepts
    it (it runs within the larger budget). Raises the ``InfeasibleBudget`` otherwise.
    ``bounds`` are ``chain``'s when the caller has them."""
    error = infeasible(chain, budget_bytes, slow_budget_bytes)
    if error.minimal_budget_bytes <= budget_bytes:
        smaller = best_plan(
            chain, error.minimal_budget_bytes, slow_budget_bytes, bounds, ladder=False
        )
        if smaller is not None:
            program = attrs.evolve(smaller, budget=Budget(budget_bytes, slow_budget_bytes))
            if runs(program):
                return program
    raise error


def _pressurefit_at(
    program: Program,
    budget_bytes: int,
    *,
    slow_budget_bytes: int | None = None,
    cyclic: bool = False,
    fit_below: int | None = None,
) -> Plan | None:
    """PressureFit's plan at ``budget_bytes``, as ``plan`` would return it, or None when
    its search finds none (``PRESSUREFIT.replan``: no minimal-budget search behind it).
    With ``fit_below``, when none is found, budgets halfway up towards ``fit_below`` are
    tried too (a few)."""
    bare = program.bare()
    bounds = None
    if cyclic:
        chain = build_chain(with_homes(bare, frozenset()))
    else:
        chain = build_chain(bare)
        bounds = ChainBounds(chain)  # whatever the budget: shared by the tries below
    floor = max(chain.base_bytes, default=0)
    for _ in range(4):
        started = time.perf_counter()
        planned = None
        if budget_bytes >= floor:
            planned = (
                steady_state(
                    bare, chain, budget_bytes, slow_budget_bytes, packable=fit_below is not None
                )
                if cyclic
                else best_plan(chain, budget_bytes, slow_budget_bytes, bounds)
            )
        if planned is not None:
            run = PlannerRun(planned, bounds, checked=not cyclic)
            planning_s = time.perf_counter() - started
            return _simulated(
                PRESSUREFIT, program.name, run, budget_bytes, slow_budget_bytes, cyclic, planning_s
            )
        if fit_below is None or fit_below - budget_bytes <= 1:
            return None
        budget_bytes = max(floor, (budget_bytes + fit_below) // 2)
    return None


# -- The minimal budget --------------------------------------------------------------------


def minimal_budget(
    program: Program, *, slow_budget_bytes: int | None = None, cyclic: bool = False
) -> int:
    """The smallest fast budget PressureFit plans ``program``'s bare chain for, and whose
    plan static placement packs into one arena of that size; with ``cyclic``, as a
    steady-state plan (``plan(..., cyclic=True)``), its persistent objects homed."""
    bare = program.bare()
    if cyclic:
        chain = check_plannable(
            with_homes(bare, frozenset()), 1, slow_budget_bytes, homed=frozenset(bare.persistent)
        )
        return _cyclic_minimum(bare, chain, slow_budget_bytes)[1]
    chain = check_plannable(bare, 1, slow_budget_bytes)
    return minimal_budget_bytes(chain, slow_budget_bytes)


def minimal_budget_bytes(chain: Chain, slow_budget_bytes: int | None = None) -> int:
    """The smallest budget the planner finds a valid plan for (bisection), raised until
    static placement fits it too (``placeable_budget_bytes``)."""
    plannable = plannable_budget_bytes(chain, slow_budget_bytes)
    return placeable_budget_bytes(chain, plannable, slow_budget_bytes)


def plannable_budget_bytes(chain: Chain, slow_budget_bytes: int | None = None) -> int:
    """The smallest budget the planner finds a valid plan for (bisection)."""
    bounds = ChainBounds(chain)  # one for every budget tried
    low, _ = floor_bytes(chain)
    return smallest_plannable(
        chain,
        lambda budget: finds_plan(chain, budget, slow_budget_bytes, bounds),
        max(bounds.peak_held, low + 1),
        slow_budget_bytes,
    )


def placeable_budget_bytes(
    chain: Chain, minimum_bytes: int, slow_budget_bytes: int | None = None
) -> int:
    """The smallest budget from ``minimum_bytes`` up at which a plan also packs into one
    arena of the budget (``placed_within``, re-plans included)."""
    return raised_to_place(
        chain, minimum_bytes, lambda budget: placed_within(chain, budget, slow_budget_bytes)
    )


def infeasible(chain: Chain, budget_bytes: int, slow_budget_bytes: int | None) -> InfeasibleBudget:
    """The ``InfeasibleBudget`` for ``budget_bytes``, with the minimum found by search."""
    plannable = plannable_budget_bytes(chain, slow_budget_bytes)
    minimum = placeable_budget_bytes(chain, plannable, slow_budget_bytes)
    return infeasible_budget(chain, budget_bytes, plannable, minimum, slow_budget_bytes)


def _cyclic_minimum(bare: Program, chain: Chain, slow_budget_bytes: int | None) -> tuple[int, int]:
    """(plannable, placeable): the smallest budget at which a steady-state plan of ``bare``
    is found (``steady_state``, bisection), and the smallest from there up at which it
    also places (``placed_within``). ``chain``: ``bare``'s with every home slow."""
    low, _ = floor_bytes(chain)
    plannable = smallest_plannable(
        chain,
        lambda budget: steady_state(bare, chain, budget, slow_budget_bytes) is not None,
        max(no_offload_peak_bytes(chain), low + 1),
        slow_budget_bytes,
    )
    minimum = raised_to_place(
        chain,
        plannable,
        lambda budget: placed_within(chain, budget, slow_budget_bytes, cyclic=True),
    )
    return plannable, minimum


def placed_within(
    chain: Chain,
    budget_bytes: int,
    slow_budget_bytes: int | None = None,
    *,
    cyclic: bool = False,
    replans: int = REPLANS,
) -> bool:
    """Whether PressureFit's plan of ``chain`` at ``budget_bytes`` packs into one arena of
    that size, re-planning as ``place`` does (what ``minimal_budget`` checks). It never
    calls ``plan``, so it never asks for a minimal budget itself."""
    first = _pressurefit_at(
        chain.program, budget_bytes, slow_budget_bytes=slow_budget_bytes, cyclic=cyclic
    )
    if first is None:
        return False

    def replan(current: Plan, capacity: int) -> Plan | None:
        return _pressurefit_at(
            chain.program,
            capacity,
            slow_budget_bytes=slow_budget_bytes,
            cyclic=cyclic,
            fit_below=current.budget_bytes,
        )

    placement, _ = pack_or_replan(first, budget_bytes, 0, replans, replan, refine=False)
    return placement is not None


#: The core's planner; the builtins plugin registers this very record.
PRESSUREFIT = PlannerSpec(
    DEFAULT_PLANNER,
    plan_pressurefit,
    "cut residency where memory is over budget, prefetch just in time (the core's)",
    minimal_budget=minimal_budget,
    run=run_pressurefit,
    replan=_pressurefit_at,
)


# -- plan ----------------------------------------------------------------------------------


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
    spec = as_planner_spec(planner)
    options: dict[str, Any] = {}
    if slow_budget_bytes is not None:
        options["slow_budget_bytes"] = slow_budget_bytes
    if cyclic:
        options["cyclic"] = True
    with collector_paused():
        started = time.perf_counter()
        run = _run_planner(spec, program, budget_bytes, options)
        planning_s = time.perf_counter() - started
        return _simulated(
            spec, program.name, run, budget_bytes, slow_budget_bytes, cyclic, planning_s
        )


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


def _run_planner(
    spec: PlannerSpec, program: Program, budget_bytes: int, options: dict[str, Any]
) -> PlannerRun:
    """The planner's run: its ``run`` where it declares one (PressureFit: the chain's
    bounds from its search, and no second validation of a one-run plan), else ``plan``
    (validated in full)."""
    if spec.run is None:
        return PlannerRun(spec.plan(program, budget_bytes, **options))
    return spec.run(program, budget_bytes, **options)


def _simulated(
    spec: PlannerSpec,
    name: str,
    run: PlannerRun,
    budget_bytes: int,
    slow_budget_bytes: int | None,
    cyclic: bool,
    planning_s: float,
) -> Plan:
    """``run``'s program simulated (and, when ``cyclic``, checked over two iterations) and
    bounded, as a ``Plan``; ``PlanningError`` when the simulator rejects it."""
    planned = run.program
    sim = simulate(
        planned,
        budget_bytes=budget_bytes,
        slow_budget_bytes=slow_budget_bytes,
        check=not run.checked,
    )
    if not sim.valid:
        raise PlanningError(
            f"planner {spec.name!r} returned a plan of {name!r} that fails in the "
            f"simulator at a budget of {budget_bytes} bytes: {sim.error}"
        )
    cycle = None
    if cyclic:
        cycle = check_cycle(planned, budget_bytes, slow_budget_bytes)
        if not cycle.valid:
            raise PlanningError(
                f"planner {spec.name!r} returned a cyclic plan of {name!r} that does "
                f"not repeat at a budget of {budget_bytes} bytes: {cycle.problem}"
            )
    if run.bounds is None:
        bound = lower_bound(planned, budget_bytes, cyclic=cyclic)  # directives ignored
    else:
        bound = run.bounds.at(budget_bytes)
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


# -- Placement -----------------------------------------------------------------------------


def place(
    planned: Plan,
    *,
    replans: int = REPLANS,
    workspace_in_arena: bool = True,
    workspace_beside_bytes: int = 0,
) -> Placement:
    """Pack ``planned`` into one arena no larger than its budget.

    With ``workspace_in_arena=False`` tasks' workspace is not packed: their kernels take it
    from the device allocator (temporaries of framework ops), so the arena must leave the
    largest task workspace free beside it: ``arena_bytes + workspace_outside_bytes`` stays
    within the budget.

    Such a plan must hold its objects within the budget less that workspace at every
    instant, which a plan that counts each task's workspace within the budget only while
    the task runs does not: plan the program with its tasks' workspace taken out
    (``without_workspace``) at the budget less the largest, and pass that largest as
    ``workspace_beside_bytes``; the placement's budget is then the plan's plus it.

    When fragmentation makes the arena larger than the budget, re-plan (same planner) at
    the plan's live peak less the excess, and pack again (a planner that declares
    ``replan``, as PressureFit does: when it finds no plan there, halfway back up; any
    other: through ``plan``, never below the smallest budget it reports when a capacity is
    infeasible); once a capacity packs, bisect between it and the smallest that did not,
    and keep the fastest placement. Raises ``PlanningError`` naming the budget and the
    smallest arena found when ``replans`` re-plans do not make it fit.
    """
    return pack_plan(
        planned,
        _replanner(planned),
        replans=replans,
        workspace_in_arena=workspace_in_arena,
        workspace_beside_bytes=workspace_beside_bytes,
    )


def _replanner(planned: Plan) -> Replan:
    """How ``place`` re-plans ``planned`` at a smaller capacity: with its planner's
    ``replan`` where it declares one, else through ``plan``."""
    spec = planned.spec
    options: dict[str, Any] = {"cyclic": True} if planned.cyclic else {}
    if spec.replan is not None:

        def declared(current: Plan, capacity: int) -> Plan | None:
            return spec.replan(
                planned.program,
                capacity,
                slow_budget_bytes=planned.slow_budget_bytes,
                fit_below=current.budget_bytes,
                **options,
            )

        return declared
    floor = [1]

    def through_plan(current: Plan, capacity: int) -> Plan | None:
        capacity = max(floor[0], capacity)
        try:
            return plan(
                planned.program,
                capacity,
                planner=spec,
                slow_budget_bytes=planned.slow_budget_bytes,
                **options,
            )
        except InfeasibleBudget as exc:
            floor[0] = exc.minimal_budget_bytes
            if floor[0] >= current.budget_bytes:
                return None
            return plan(
                planned.program,
                floor[0],
                planner=spec,
                slow_budget_bytes=planned.slow_budget_bytes,
                **options,
            )

    return through_plan
