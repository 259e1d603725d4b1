"""Cyclic plans, checked: a program run as consecutive iterations of one loop.

A program's ``persistent`` objects carry from one iteration to the next; every other object
that exists at start is fed anew at each iteration's start, at its declared location, and
what tasks create lives for one iteration. ``unroll(program, k)`` writes ``k`` consecutive
iterations as one Program the simulator (and the engine) can run:

- iteration ``i``'s tasks and non-persistent objects are renamed ``{id}@{i}``; persistent
  objects keep their names and are shared by every iteration;
- between iterations ``i`` and ``i+1`` two zero-cost boundary tasks: ``end@{i}`` reads
  iteration ``i``'s non-persistent objects whose final location is fast (it waits for them,
  as the run's end would) and releases them; ``start@{i+1}`` creates iteration ``i+1``'s
  fed objects that start fast, and carries iteration ``i+1``'s prologue (it fires when
  ``start@{i+1}`` ends, as a prologue fires before the first task);
- fed objects that start slow exist in slow memory from the start;
- final locations: the persistent objects' and the last iteration's, plus every
  iteration's non-persistent objects whose final location is slow.

``check_cycle`` runs two iterations: the run must be valid (no object lost, the fast
budget held at every instant, every transfer ends), and the persistent objects must end
the second iteration as they end the first (resident or not, slow copy current or not),
so every later iteration starts in the same state. ``iteration_us`` is the steady-state
time of one iteration: from the first task of iteration 1 to the first task of
iteration 2 (the first iteration starts from the declared locations, the second from the
first's tail, which may already have fetched what it needs).
"""

from __future__ import annotations

from collections import OrderedDict

import attrs

from dataflow.schema import Location, Obj, Program, Prologue, Task
from dataflow.sim import SimResult, simulate

#: Iterations ``check_cycle`` runs.
ITERATIONS = 2


@attrs.frozen
class CycleCheck:
    """The check of a cyclic plan over ``iterations`` consecutive iterations.

    ``sim`` is the unrolled run; ``iteration_us`` the steady-state time of one iteration;
    ``problem`` says why the cycle does not repeat (empty when ``valid``).
    """

    valid: bool
    iterations: int
    iteration_us: float
    sim: SimResult = attrs.field(repr=False)
    problem: str = ""


def _renamer(program: Program, iteration: int):
    persistent = set(program.persistent)

    def name(obj_id: str) -> str:
        return obj_id if obj_id in persistent else f"{obj_id}@{iteration}"

    return name


def unroll(program: Program, iterations: int = ITERATIONS) -> Program:
    """``iterations`` consecutive iterations of ``program`` as one Program (module doc)."""
    if iterations < 1:
        raise ValueError(f"iterations must be >= 1, got {iterations}")
    persistent = set(program.persistent)
    fed = [
        obj
        for obj in program.objects
        if program.exists_at_start(obj.id) and obj.id not in persistent
    ]
    fed_fast = [obj.id for obj in fed if obj.location is Location.FAST]
    finals = program.final_locations
    fast_finals = [
        o for o, where in finals.items() if where is Location.FAST and o not in persistent
    ]
    objects: list[Obj] = [obj for obj in program.objects if obj.id in persistent]
    tasks: list[Task] = []
    final_locations: dict[str, Location] = {
        obj: where for obj, where in finals.items() if obj in persistent
    }
    prologue = Prologue()
    for iteration in range(1, iterations + 1):
        name = _renamer(program, iteration)
        objects += [
            attrs.evolve(obj, id=name(obj.id))
            for obj in program.objects
            if obj.id not in persistent
        ]
        own_prologue = Prologue(
            releases=tuple(map(name, program.prologue.releases)),
            offloads=tuple(map(name, program.prologue.offloads)),
            prefetches=tuple(map(name, program.prologue.prefetches)),
        )
        if iteration == 1:
            prologue = own_prologue
        else:
            before = _renamer(program, iteration - 1)
            if fast_finals:
                held = tuple(map(before, fast_finals))
                tasks.append(
                    Task(f"end@{iteration - 1}", "boundary", "boundary", inputs=held, releases=held)
                )
            if fed_fast or own_prologue:
                tasks.append(
                    Task(
                        f"start@{iteration}",
                        "boundary",
                        "boundary",
                        outputs=tuple(map(name, fed_fast)),
                        releases=own_prologue.releases,
                        offloads=own_prologue.offloads,
                        prefetches=own_prologue.prefetches,
                    )
                )
        tasks += [
            attrs.evolve(
                task,
                id=f"{task.id}@{iteration}",
                inputs=tuple(map(name, task.inputs)),
                mutates=tuple(map(name, task.mutates)),
                outputs=tuple(map(name, task.outputs)),
                releases=tuple(map(name, task.releases)),
                offloads=tuple(map(name, task.offloads)),
                prefetches=tuple(map(name, task.prefetches)),
            )
            for task in program.tasks
        ]
        for obj, where in finals.items():
            if obj not in persistent and (where is Location.SLOW or iteration == iterations):
                final_locations[name(obj)] = where
    return attrs.evolve(
        program,
        name=f"{program.name} x{iterations}",
        objects=tuple(objects),
        tasks=tuple(tasks),
        final_locations=final_locations,
        prologue=prologue,
    )


def _persistent_state(sim: SimResult, persistent: tuple[str, ...]) -> dict[str, tuple[bool, bool]]:
    resident, current = set(sim.resident_at_end), set(sim.slow_current_at_end)
    return {obj: (obj in resident, obj in current) for obj in persistent}


def repeated_slow_bytes(program: Program) -> int:
    """Bytes of the objects one iteration of ``program`` puts in slow memory anew: the
    non-persistent objects that start there (fed) or are ever offloaded."""
    slow = program.ever_slow_ids() - set(program.persistent)
    return sum(program.obj(obj).size_bytes for obj in slow)


#: How many of the latest checks ``check_cycle`` remembers: every home set one
#: steady-state search tries (none, and one per share of ``cyclic.FILLS``), so that the
#: plan it returns is not unrolled and simulated again by ``plan``.
RECENT_CHECKS = 3
_recent: OrderedDict[int, tuple[Program, tuple, CycleCheck]] = OrderedDict()


def check_cycle(
    program: Program,
    budget_bytes: int | None = None,
    slow_budget_bytes: int | None = None,
    *,
    iterations: int = ITERATIONS,
    one: SimResult | None = None,
) -> CycleCheck:
    """Run ``iterations`` consecutive iterations of ``program`` (see the module doc).

    ``one`` is the program's own (one-iteration) run, when the caller has it. The slow
    budget holds one iteration (``one``'s run checks it): slow space is never given back
    within a run, and a run's slow pool has one slice per object, which every iteration
    reuses, but the unrolled program names each iteration's objects apart; so the
    unrolled run may take, on top of the budget, the slow objects of the iterations after
    the first (``repeated_slow_bytes``).

    A program checked again under the same budgets (the very object, which is frozen) gets
    the answer of its last check (``RECENT_CHECKS``)."""
    key = (budget_bytes, slow_budget_bytes, iterations)
    remembered = _recent.get(id(program))
    if remembered is not None and remembered[0] is program and remembered[1] == key:
        _recent.move_to_end(id(program))
        return remembered[2]
    check = _check_cycle(program, budget_bytes, slow_budget_bytes, iterations, one)
    _recent[id(program)] = (program, key, check)
    _recent.move_to_end(id(program))
    while len(_recent) > RECENT_CHECKS:
        _recent.popitem(last=False)
    return check


def _check_cycle(
    program: Program,
    budget_bytes: int | None,
    slow_budget_bytes: int | None,
    iterations: int,
    one: SimResult | None,
) -> CycleCheck:
    if one is None:
        one = simulate(
            program, budget_bytes=budget_bytes, slow_budget_bytes=slow_budget_bytes, record=False
        )
    unrolled = unroll(program, iterations)
    unrolled_slow = None
    if slow_budget_bytes is not None:
        unrolled_slow = slow_budget_bytes + (iterations - 1) * repeated_slow_bytes(program)
    # no structural check of the unrolled program: unroll renames a program that is valid
    # (``one`` was simulated from it: checked, or a planner's own output) into iterations
    # whose every name is created, visible and directed as in the program itself, and
    # checking thousands of tasks again took a fifth of a recompute planner's time
    sim = simulate(
        unrolled, budget_bytes=budget_bytes, slow_budget_bytes=unrolled_slow, check=False
    )
    first = program.tasks[0].id if program.tasks else None
    starts = {timing.task_id: timing.start_us for timing in sim.tasks}
    iteration_us = sim.makespan_us / iterations
    if first is not None and f"{first}@2" in starts:
        iteration_us = starts[f"{first}@2"] - starts[f"{first}@1"]
    problem = ""
    if not one.valid:
        problem = f"one iteration fails: {one.error}"
    elif not sim.valid:
        problem = f"{iterations} consecutive iterations fail: {sim.error}"
    else:
        after_one = _persistent_state(one, program.persistent)
        after_all = _persistent_state(sim, program.persistent)
        changed = sorted(obj for obj in program.persistent if after_one[obj] != after_all[obj])
        if changed:
            problem = (
                f"persistent objects end iteration {iterations} otherwise than iteration 1: "
                + ", ".join(
                    f"{obj!r} (resident, slow copy current: {after_one[obj]} then {after_all[obj]})"
                    for obj in changed
                )
            )
    return CycleCheck(not problem, iterations, iteration_us, sim, problem)
