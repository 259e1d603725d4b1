"""Which budgets a chain can be planned for, and the error that says so.

No plan fits below the largest *base* of a task: its own footprint (inputs + mutates +
outputs + workspace), plus, for task 0, every object that starts in fast memory, and, at
the end, every object whose final location is ``fast`` (``floor_bytes``). Above that,
whether a budget works is what the planner finds: ``smallest_plannable`` bisects for the
smallest budget a given test accepts, ``raised_to_place`` raises it until static
placement also fits it (fragmentation), and ``infeasible_budget`` says what forces the
minimum. The tests themselves (a planner search, a placement) are the caller's
(``api.py``): this module only knows the chain.
"""

from __future__ import annotations

from collections.abc import Callable

import attrs

from dataflow.planning.intervals import Chain, Origin, PlanningError, build_chain
from dataflow.schema import Location, Program, validate
from dataflow.units import format_size


class InfeasibleBudget(PlanningError):
    """No plan runs ``program_name`` within ``budget_bytes``.

    ``minimal_budget_bytes`` is the smallest budget the planner found to work (by search);
    ``task_id`` is the task whose own footprint (inputs + mutates + outputs + workspace,
    ``footprint_bytes``) is the largest: when the two are equal, that task forces the
    minimum. ``reason`` says what forces the minimum.
    """

    def __init__(
        self,
        program_name: str,
        budget_bytes: int,
        minimal_budget_bytes: int,
        task_id: str | None,
        footprint_bytes: int,
        reason: str,
    ):
        self.program_name = program_name
        self.budget_bytes = budget_bytes
        self.minimal_budget_bytes = minimal_budget_bytes
        self.task_id = task_id
        self.footprint_bytes = footprint_bytes
        self.reason = reason
        super().__init__(
            f"program {program_name!r} cannot run within a fast budget of "
            f"{format_size(budget_bytes)} ({budget_bytes} bytes): the smallest budget that "
            f"works is {format_size(minimal_budget_bytes)} ({minimal_budget_bytes} bytes); "
            f"{reason}"
        )


def check_plannable(
    bare: Program,
    budget_bytes: int,
    slow_budget_bytes: int | None,
    homed: frozenset[str] = frozenset(),
) -> Chain:
    """The chain of a structurally valid bare program; raise ``PlanningError`` naming each
    problem otherwise (budget-dependent problems are left to the search). ``homed``: objects
    whose start and end the planner chooses (a cyclic plan's persistent objects), left out
    of the slow memory that objects starting or ending there need."""
    if budget_bytes < 1:
        raise ValueError(f"budget_bytes must be >= 1, got {budget_bytes}")
    problems = validate(attrs.evolve(bare, budget=None))
    if problems:
        listing = "\n".join(f"  - [{problem.code}] {problem.message}" for problem in problems)
        raise PlanningError(f"program {bare.name!r} cannot be planned:\n{listing}")
    chain = build_chain(bare)
    if slow_budget_bytes is not None:
        needed = sum(
            life.size_bytes
            for life in chain.objects
            if life.obj_id not in homed
            and (life.origin is Origin.SLOW or life.final is Location.SLOW)
        )
        if needed > slow_budget_bytes:
            raise PlanningError(
                f"program {bare.name!r} needs {format_size(needed)} ({needed} bytes) of slow "
                "memory for the objects that start or end there, more than the slow budget "
                f"of {format_size(slow_budget_bytes)} ({slow_budget_bytes} bytes)"
            )
    return chain


def floor_bytes(chain: Chain) -> tuple[int, int]:
    """(bytes, task index 0..n) of the largest base: no budget below it can work."""
    best = max(range(chain.n_tasks + 1), key=lambda t: (chain.base_bytes[t], -t))
    return chain.base_bytes[best], best


def smallest_plannable(
    chain: Chain, works: Callable[[int], bool], high: int, slow_budget_bytes: int | None = None
) -> int:
    """The smallest budget from the floor (``floor_bytes``) up that ``works`` accepts: the
    floor if it works, else doubling from ``high`` until one works (8 times at most), then
    bisection to the byte between the last that failed and the first that worked."""
    low, _ = floor_bytes(chain)
    if works(low):
        return low
    for _ in range(8):
        if works(high):
            break
        low, high = high, 2 * high
    else:
        within = (
            ""
            if slow_budget_bytes is None
            else f" within the slow budget of {format_size(slow_budget_bytes)} "
            f"({slow_budget_bytes} bytes)"
        )
        raise PlanningError(
            f"program {chain.program.name!r}: no fast budget up to {format_size(high)} "
            f"({high} bytes) gives a valid plan{within}"
        )
    return bisect_budget(works, low, high, 1)


def bisect_budget(works, failed: int, works_at: int, tolerance: int, steps: int = 64) -> int:
    """A budget that ``works``, within ``tolerance`` of one that did not (at most ``steps``
    halvings between ``failed`` and ``works_at``)."""
    for _ in range(steps):
        if works_at - failed <= tolerance:
            break
        middle = (failed + works_at) // 2
        if works(middle):
            works_at = middle
        else:
            failed = middle
    return works_at


#: Steps above the plannable minimum tried for placement: ``minimum * (1 + k / STEPS)``
#: for k = 1 .. STEPS (then bisection back down between the last that failed and the first
#: that placed).
PLACEMENT_STEPS = 32


def raised_to_place(chain: Chain, minimum_bytes: int, places: Callable[[int], bool]) -> int:
    """The smallest budget from ``minimum_bytes`` up that ``places`` accepts (a plan at it
    packs into one arena of the budget, re-plans included): near the minimum,
    fragmentation can leave no arena that small. Steps up by
    ``minimum / PLACEMENT_STEPS``, then bisects between the last step that failed and the
    first that placed (placement is not monotone in the budget, so the result is one that
    was checked, not necessarily the least)."""
    if places(minimum_bytes):
        return minimum_bytes
    failed = minimum_bytes
    for step in range(1, PLACEMENT_STEPS + 1):
        budget = minimum_bytes + minimum_bytes * step // PLACEMENT_STEPS
        if places(budget):
            break
        failed = budget
    else:
        raise PlanningError(
            f"program {chain.program.name!r}: no budget from {format_size(minimum_bytes)} to "
            f"{format_size(budget)} packs into one arena of its size"
        )
    return bisect_budget(places, failed, budget, max(1, minimum_bytes // 1024), steps=6)


def infeasible_budget(
    chain: Chain,
    budget_bytes: int,
    plannable: int,
    minimum: int,
    slow_budget_bytes: int | None,
) -> InfeasibleBudget:
    """The ``InfeasibleBudget`` for ``budget_bytes``: plans fit from ``plannable``, and
    place from ``minimum``; the reason names what forces the minimum."""
    name = chain.program.name
    if chain.n_tasks == 0:
        return InfeasibleBudget(name, budget_bytes, minimum, None, 0, "there are no tasks")
    largest = max(range(chain.n_tasks), key=lambda t: (chain.footprint_bytes[t], -t))
    task_id = chain.task_ids[largest]
    footprint = chain.footprint_bytes[largest]
    needs = (
        f"{format_size(footprint)} ({footprint} bytes) resident at once "
        "(inputs + mutates + outputs + workspace)"
    )
    floor, where = floor_bytes(chain)
    if minimum == footprint:
        reason = f"task {task_id!r} forces it: it needs {needs}"
    elif minimum == floor and where == 0:
        reason = (
            f"task {chain.task_ids[0]!r} forces it: it runs while every object that starts "
            f"in fast memory is resident ({format_size(floor)}); the largest footprint of a "
            f"task is that of task {task_id!r}, {needs}"
        )
    elif minimum == floor and where == chain.n_tasks:
        reason = (
            f"the objects whose final location is fast force it ({format_size(floor)}); the "
            f"largest footprint of a task is that of task {task_id!r}, {needs}"
        )
    else:
        reason = (
            f"the largest footprint of a task is that of task {task_id!r}, {needs}; above "
            "it, objects that must stay in fast memory between their uses, or come back in "
            "time, force the rest"
        )
        if slow_budget_bytes is not None:
            reason += (
                f" (the slow budget of {format_size(slow_budget_bytes)} limits which objects "
                "can be written back)"
            )
    if minimum > plannable:
        reason = (
            f"plans fit from {format_size(plannable)} ({plannable} bytes), but packing one "
            f"into a single arena takes {format_size(minimum)} (fragmentation); " + reason
        )
    return InfeasibleBudget(name, budget_bytes, minimum, task_id, footprint, reason)
