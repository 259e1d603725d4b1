"""Steady-state (cyclic) plans: persistent objects get homes, the plan repeats."""

from __future__ import annotations

import random

import attrs
import pytest

from dataflow.engine import Engine
from dataflow.planning import check_cycle, lower_bound, minimal_budget, plan, unroll
from dataflow.planning.cyclic import with_homes
from dataflow.schema import Location, Obj, Program, Prologue, Task, validate
from dataflow.sim import simulate
from dataflow.testing.shapes import MiB, tied_embedding, tiny_training, training


def _persistent(program: Program) -> Program:
    """Weights and optimizer state outlive the step; they start slow."""
    keep = tuple(obj.id for obj in program.objects if obj.id.startswith(("W", "O")))
    objects = tuple(
        attrs.evolve(obj, location=Location.SLOW) if obj.id in keep else obj
        for obj in program.objects
    )
    return attrs.evolve(program, objects=objects, persistent=keep)


def _state(sim, objects):
    return {o: (o in sim.resident_at_end, o in sim.slow_current_at_end) for o in objects}


@pytest.mark.parametrize(
    "make",
    [
        tiny_training,
        lambda: training(random.Random(2), layers=6),
        lambda: tied_embedding(random.Random(1), layers=6),
    ],
    ids=["tiny-training", "training", "tied-embedding"],
)
def test_a_cyclic_plan_repeats(make) -> None:
    program = _persistent(make())
    low = minimal_budget(program)
    peak = plan(program, 2**40).sim.fast_peak_bytes
    for budget in (low + (peak - low) // 3, peak):
        planned = plan(program, budget, cyclic=True)
        cycle = planned.cycle
        assert cycle is not None and cycle.valid, cycle.problem
        assert cycle.sim.valid and cycle.sim.fast_peak_bytes <= budget
        # every persistent object ends where it starts: its home
        for obj in program.persistent:
            home = planned.program.obj(obj).location
            assert planned.program.final_locations[obj] is home
        # a third iteration ends as the second did: the state has closed. simulate checks
        # the unrolled program's structure here (check_cycle leaves that to unroll)
        three = simulate(unroll(planned.program, 3), budget_bytes=budget)
        assert three.valid
        assert _state(three, program.persistent) == _state(cycle.sim, program.persistent)
        bound = lower_bound(planned.program, budget, cyclic=True)
        assert cycle.iteration_us >= bound.best_us * (1 - 1e-12)
        assert planned.makespan_ratio == cycle.iteration_us / planned.lower_bound_us


def test_a_tail_prefetch_overlaps_the_next_iteration() -> None:
    """With room to spare, a weight needed first is fetched by the previous iteration's
    tail: the second iteration's first task does not wait for it."""
    program = _persistent(tiny_training())
    planned = plan(program, 40 * MiB, cyclic=True)
    one_iteration = planned.sim.makespan_us
    assert planned.cycle.iteration_us <= one_iteration
    homes = {obj: planned.program.obj(obj).location for obj in program.persistent}
    assert Location.FAST in homes.values()


def test_unroll_renames_and_links_iterations() -> None:
    program = _persistent(tiny_training())
    two = unroll(program, 2)
    assert validate(two) == []
    ids = [task.id for task in two.tasks]
    assert ids[: len(program.tasks)] == [f"{task.id}@1" for task in program.tasks]
    assert "start@2" in ids and ids[-1] == f"{program.tasks[-1].id}@2"
    names = {obj.id for obj in two.objects}
    assert "W0" in names and "x@1" in names and "x@2" in names and "W0@1" not in names
    start = two.tasks[ids.index("start@2")]
    assert start.outputs == ("x@2",)  # fed fast data appears at the boundary


def test_a_cycle_that_does_not_close_is_reported() -> None:
    # w is homed slow (it starts slow) but the iteration leaves it in fast memory: the
    # next iteration's prologue cannot fetch what is already there.
    program = Program(
        "open",
        [Obj("w", 8, "param", "slow"), Obj("y", 8, "activation")],
        [Task("t0", "k", "k", inputs=("w",), outputs=("y",), cost_us=5.0, releases=("y",))],
        final_locations={"w": "fast"},
        prologue=Prologue(prefetches=("w",)),
        persistent=("w",),
    )
    assert simulate(program).valid
    check = check_cycle(program)
    assert not check.valid and "prefetch" in check.problem


def test_a_persistent_object_that_ends_away_from_its_start_does_not_repeat() -> None:
    # w starts fast but is written back and left slow: one iteration runs, the next finds
    # it away with nothing to fetch it.
    program = Program(
        "drift",
        [Obj("w", 8, "param", "fast"), Obj("x", 8, "data", "fast")],
        [
            Task("t0", "k", "k", mutates=("w",), cost_us=5.0, offloads=("w",)),
            Task("t1", "k", "k", inputs=("x",), cost_us=5.0),
        ],
        final_locations={"w": "slow"},
        persistent=("w",),
    )
    assert simulate(program).valid
    check = check_cycle(program)
    assert not check.valid and "2 consecutive iterations fail" in check.problem
    assert "'t0@2'" in check.problem


def test_the_virtual_engine_runs_the_unrolled_cycle_as_simulated() -> None:
    program = _persistent(tiny_training())
    planned = plan(program, 30 * MiB, cyclic=True)
    two = unroll(planned.program, 2)
    engine = Engine("virtual", budget_bytes=30 * MiB)
    engine.load(two)
    trace = engine.run().steps[0]
    assert trace.makespan_us == planned.cycle.sim.makespan_us


def test_homes_are_written_into_locations_and_finals() -> None:
    program = _persistent(tiny_training())
    homed = with_homes(program, frozenset({"W0"}))
    assert homed.obj("W0").location is Location.FAST
    assert homed.final_locations["W0"] is Location.FAST
    assert homed.obj("W1").location is Location.SLOW
    assert homed.final_locations["W1"] is Location.SLOW


def test_a_miss_at_the_budget_falls_back_to_a_smaller_capacity(monkeypatch) -> None:
    """The search is a heuristic: where it finds no home set's plan at the budget but
    one at the smallest budget that works (as the one-run planner falls back), that plan
    is the steady state; with ``explain=False`` the miss fails at once."""
    from dataflow.planning import PlanningError, cyclic
    from dataflow.planning.api import plan_pressurefit

    program = _persistent(training(random.Random(2), layers=6))
    low = minimal_budget(program)
    peak = plan(program, 2**40).sim.fast_peak_bytes
    budget = (low + peak) // 2
    real = cyclic.search

    def misses_above_the_minimum(chain_program, capacity, **options):
        found = real(chain_program, capacity, **options)
        return attrs.evolve(found, best=None) if capacity > low else found

    monkeypatch.setattr(cyclic, "search", misses_above_the_minimum)
    planned = plan_pressurefit(program, budget, cyclic=True)
    cycle = check_cycle(planned, budget)
    assert cycle.valid, cycle.problem
    assert planned.budget.fast_bytes == budget
    assert simulate(planned, budget_bytes=budget).fast_peak_bytes <= budget
    # every persistent object homed slow: the fallback plans the one-run chain
    assert all(planned.obj(obj).location is Location.SLOW for obj in program.persistent)
    with pytest.raises(PlanningError, match="explain=False"):
        plan_pressurefit(program, budget, cyclic=True, explain=False)


def test_a_slow_budget_holds_one_iteration_of_the_cycle() -> None:
    """A run's slow pool has one slice per object, reused by every iteration: a plan whose
    one iteration fits the slow budget exactly repeats within it, although the unrolled
    iterations' offloaded activations are named apart."""
    from dataflow.planning.cycle import repeated_slow_bytes

    program = _persistent(training(random.Random(2), layers=6))
    low = minimal_budget(program)
    budget = low + (plan(program, 2**40).sim.fast_peak_bytes - low) // 4
    once = plan(program, budget)
    assert repeated_slow_bytes(once.program) > 0, "the budget should offload activations"
    slow = once.sim.slow_peak_bytes  # exactly what one iteration takes
    cycle = check_cycle(once.program, budget, slow)
    assert cycle.valid, cycle.problem
    assert not check_cycle(once.program, budget, slow - 1).valid  # one byte less: no
    assert plan(program, budget, slow_budget_bytes=slow, cyclic=True).cycle.valid


def test_given_homes_are_the_only_sets_tried() -> None:
    """``homes`` replaces the planner's own sets of fast homes: each plan homes exactly
    the set it was given, and it fits and repeats; a name that is not persistent, or
    homes for a plan that is not cyclic, is refused by name."""
    from dataflow.planning import PlanningError
    from dataflow.planning.api import plan_cyclic, plan_pressurefit
    from dataflow.planning.cyclic import fast_homes

    program = _persistent(tiny_training())
    budget = plan(program, 2**40).sim.fast_peak_bytes
    for fast in (frozenset(), frozenset({"W0"}), frozenset(program.persistent)):
        planned = plan_cyclic(program.bare(), budget, homes=[fast])
        assert fast_homes(planned) == fast
        assert check_cycle(planned, budget).valid
    chosen = plan(program, budget, cyclic=True).program
    again = plan_cyclic(program.bare(), budget, homes=[fast_homes(chosen)])
    assert check_cycle(again, budget).iteration_us == pytest.approx(
        check_cycle(chosen, budget).iteration_us
    )
    with pytest.raises(PlanningError, match="'h0'"):
        plan_cyclic(program.bare(), budget, homes=[frozenset({"h0", "W0"})])
    with pytest.raises(PlanningError, match="cyclic plans only"):
        plan_pressurefit(program, budget, homes=[frozenset()])


def test_a_program_checked_again_gets_its_last_answer() -> None:
    """``check_cycle`` remembers its latest checks by the program object: the same object
    under the same budgets is not simulated again; other budgets, or an equal but distinct
    program, are."""
    program = _persistent(training(random.Random(3), layers=4))
    planned = plan(program, 2**40, cyclic=True).program
    first = check_cycle(planned, 2**40)
    assert check_cycle(planned, 2**40) is first
    assert check_cycle(planned, 2**40 - 1) is not first
    copy = attrs.evolve(planned)
    again = check_cycle(copy, 2**40)
    assert again is not first and again == first
