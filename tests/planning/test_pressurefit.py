"""PressureFit: valid plans at every budget, determinism, infeasible budgets."""

from __future__ import annotations

import hashlib
import os
import random
import subprocess
import sys

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow.planning import InfeasibleBudget, PlanningError, lower_bound, minimal_budget, plan
from dataflow.planning.feasibility import floor_bytes
from dataflow.planning.intervals import build_chain, no_offload_peak_bytes
from dataflow.planning.pressurefit import ALTERNATIVES, PORTFOLIO, search
from dataflow.plugins import planners
from dataflow.schema import Location, Obj, Program, Task
from dataflow.testing.shapes import (
    SMALL_LINKS,
    MiB,
    mutate_and_reuse,
    tiny_streaming,
    tiny_training,
)
from dataflow.testing.strategies import bare_chains

SETTINGS = settings(
    max_examples=150,
    deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.function_scoped_fixture],
)


def test_pressurefit_is_registered_through_the_planner_hook() -> None:
    spec = planners().get("pressurefit")
    assert spec.name == "pressurefit" and spec.description


def test_a_budget_that_holds_everything_needs_only_loads_and_write_backs() -> None:
    program = tiny_training()
    planned = plan(program, sum(obj.size_bytes for obj in program.objects))
    assert planned.makespan_us == pytest.approx(planned.lower_bound_us, rel=1e-12)
    issuers = (planned.program.prologue, *planned.program.tasks)
    directives = {(d.value, obj) for task in issuers for d, obj in task.directives()}
    # slow objects come in, dirty final-slow ones go back, dead ones are released
    assert ("prefetch", "W0") in directives and ("offload", "O0") in directives
    assert ("release", "h0") in directives
    assert not any(d == "offload" and obj.startswith("h") for d, obj in directives)


@pytest.mark.parametrize("make", [tiny_training, tiny_streaming, mutate_and_reuse])
def test_every_budget_from_the_peak_to_the_minimum_plans_validly(make) -> None:
    program = make()
    chain = build_chain(program)
    low = minimal_budget(program)
    assert low >= floor_bytes(chain)[0]
    high = max(low, no_offload_peak_bytes(chain))
    for step in range(6):
        budget = low + (high - low) * step // 5
        planned = plan(program, budget)  # re-validated by the autouse fixture
        assert planned.sim.fast_peak_bytes <= budget
        assert planned.makespan_us >= planned.lower_bound_us


def test_mutated_object_is_offloaded_and_prefetched_back_clean() -> None:
    program = mutate_and_reuse()
    planned = plan(program, 16 * MiB)
    tasks = planned.program.tasks_by_id
    # acc (dirty after "add") must leave for "big" to fit, so it is written back...
    assert "acc" in tasks["add"].offloads
    # ...and, clean once back, needs no second write-back for its final location slow
    assert "acc" in tasks["read"].releases


def test_directives_in_the_input_are_dropped() -> None:
    program = tiny_training()
    first = plan(program, 26 * MiB).program
    again = plan(first, 26 * MiB).program
    assert again == first


def test_the_same_input_gives_the_same_plan() -> None:
    program = tiny_training()
    assert plan(program, 24 * MiB).program.to_json() == plan(program, 24 * MiB).program.to_json()


def test_plans_do_not_depend_on_hash_randomization() -> None:
    script = (
        "import hashlib, random\n"
        "from dataflow.planning.api import plan_pressurefit\n"
        "from dataflow.testing.shapes import random_chain\n"
        "p = random_chain(random.Random(7), tasks=60)\n"
        "print(hashlib.sha256(plan_pressurefit(p, 2**28).to_json().encode()).hexdigest())\n"
    )
    digests = set()
    for seed in ("1", "2"):
        env = {**os.environ, "PYTHONHASHSEED": seed}
        run = subprocess.run(
            [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True
        )
        digests.add(run.stdout.strip())
    from dataflow.planning.api import plan_pressurefit
    from dataflow.testing.shapes import random_chain

    here = plan_pressurefit(random_chain(random.Random(7), tasks=60), 2**28).to_json()
    assert digests == {hashlib.sha256(here.encode()).hexdigest()}


def test_an_infeasible_budget_names_the_minimum_and_the_forcing_task() -> None:
    program = tiny_training()
    with pytest.raises(InfeasibleBudget) as failure:
        plan(program, 10 * MiB)
    error = failure.value
    assert error.minimal_budget_bytes == minimal_budget(program)
    assert error.task_id == "opt0" and error.footprint_bytes == 16 * MiB
    assert f"smallest budget that works is 16 MiB ({16 * MiB} bytes)" in str(error)
    assert "task 'opt0' forces it" in str(error)
    plan(program, error.minimal_budget_bytes)
    with pytest.raises(InfeasibleBudget):
        plan(program, error.minimal_budget_bytes - 1)


def test_fast_objects_at_start_can_force_the_minimum() -> None:
    objects = [Obj(f"f{i}", 4 * MiB, "aux", "fast") for i in range(3)]
    tasks = [Task(f"t{i}", "k", "k", mutates=(f"f{i}",), cost_us=100.0) for i in range(3)]
    program = Program("all-fast", objects, tasks, links=SMALL_LINKS)
    with pytest.raises(InfeasibleBudget, match="every object that starts in fast memory") as err:
        plan(program, 6 * MiB)
    assert err.value.minimal_budget_bytes == 12 * MiB


def test_an_unplannable_chain_is_a_planning_error() -> None:
    program = tiny_training()
    head = attrs.evolve(program.tasks[2], inputs=("h1", "W1", "nope"))
    broken = attrs.evolve(program, tasks=(*program.tasks[:2], head, *program.tasks[3:]))
    with pytest.raises(PlanningError, match=r"\[unknown-object\] task 'head'.*'nope'"):
        plan(broken, 64 * MiB)


def test_a_chain_whose_first_task_reads_a_slow_object_plans() -> None:
    program = tiny_training()
    late = attrs.evolve(program, tasks=program.tasks[1:])  # W0 needed by the first task
    planned = plan(late, 64 * MiB)  # the prologue fetches it (re-validated by the fixture)
    assert "W0" in planned.program.prologue.prefetches


def test_a_slow_budget_too_small_for_the_slow_objects_is_a_planning_error() -> None:
    with pytest.raises(PlanningError, match="slow memory"):
        plan(tiny_training(), 64 * MiB, slow_budget_bytes=8 * MiB)


def test_a_slow_budget_that_fits_plans() -> None:
    program = tiny_training()
    needed = sum(obj.size_bytes for obj in program.objects if obj.location is Location.SLOW)
    planned = plan(program, 24 * MiB, slow_budget_bytes=needed + 8 * MiB)
    assert planned.sim.slow_peak_bytes <= needed + 8 * MiB


def test_search_stops_at_the_lower_bound() -> None:
    program = tiny_streaming()
    found = search(program, 64 * MiB)
    assert found.best is not None and found.simulated == 1
    assert found.best.sim.makespan_us == pytest.approx(found.lower_bound.best_us, rel=1e-12)
    assert str(found.best.strategy) == str(PORTFOLIO[0])


@st.composite
def plannable(draw: st.DrawFn) -> tuple[Program, int]:
    """A random bare chain with final locations, and a budget from the largest base up to
    a little over the no-offload peak."""
    program = draw(bare_chains(max_tasks=14))
    used = sorted({obj for task in program.tasks for obj in task.uses})
    chosen = draw(st.lists(st.sampled_from(used), max_size=3, unique=True))
    finals = {obj: draw(st.sampled_from([Location.FAST, Location.SLOW])) for obj in chosen}
    program = attrs.evolve(program, final_locations=finals)
    chain = build_chain(program)
    low = floor_bytes(chain)[0]
    high = max(low, no_offload_peak_bytes(chain)) + 50
    return program, draw(st.integers(low, high))


@SETTINGS
@given(plannable())
def test_random_chains_plan_validly_deterministically_or_say_why_not(case) -> None:
    program, budget = case
    try:
        first = plan(program, budget)
    except InfeasibleBudget as error:
        assert error.minimal_budget_bytes > budget
        plan(program, error.minimal_budget_bytes)  # the minimum it names does plan
        return
    assert first.makespan_us >= lower_bound(program, budget).best_us * (1 - 1e-12)
    assert plan(program, budget).program == first.program


@pytest.mark.parametrize("strategy", ALTERNATIVES, ids=str)
@pytest.mark.parametrize("make", [tiny_training, tiny_streaming, mutate_and_reuse])
def test_the_measured_alternatives_plan_validly_too(strategy, make) -> None:
    program = make()
    low = minimal_budget(program)
    for budget in (low + low // 8, 2 * low):
        found = search(program, budget, portfolio=[strategy])  # re-validated by the fixture
        assert found.best is not None and found.best.strategy == strategy


@SETTINGS
@given(plannable(), st.sampled_from(ALTERNATIVES))
def test_random_chains_with_the_alternatives_plan_validly_when_they_plan(case, strategy) -> None:
    program, budget = case
    search(program, budget, portfolio=[strategy])  # any plan found is re-validated


def test_a_tight_slow_budget_keeps_dirty_objects_in_fast_memory() -> None:
    program = tiny_training()
    slow_only = 24 * MiB  # exactly the weights and optimizer states
    planned = plan(program, 30 * MiB, slow_budget_bytes=slow_only)
    assert planned.sim.slow_peak_bytes <= slow_only
    offloaded = {obj for task in planned.program.tasks for obj in task.offloads}
    assert offloaded <= {"W0", "W1", "O0", "O1"}  # nothing else has slow space to go to
    with pytest.raises(InfeasibleBudget, match="the slow budget of 24 MiB limits"):
        plan(program, 17 * MiB, slow_budget_bytes=slow_only)


@SETTINGS
@given(plannable(), st.integers(0, 2000))
def test_random_chains_with_a_slow_budget_respect_it(case, spare_bytes) -> None:
    program, budget = case
    chain = build_chain(program)
    needed = sum(
        life.size_bytes
        for life in chain.objects
        if life.origin.value == "slow" or life.final is Location.SLOW
    )
    slow = needed + spare_bytes
    try:
        planned = plan(program, budget, slow_budget_bytes=slow)
    except InfeasibleBudget as error:
        assert error.minimal_budget_bytes > budget
        return
    assert planned.sim.slow_peak_bytes <= slow
    assert planned.program.budget.slow_bytes == slow


def test_a_search_below_the_largest_base_names_the_task_that_cannot_fit() -> None:
    program = tiny_training()
    chain = build_chain(program)
    floor, task = floor_bytes(chain)
    found = search(program, floor - 1)
    assert found.best is None and found.simulated == 0
    assert found.unfit_task == task and found.unfit_bytes >= 1


def test_a_candidate_the_simulator_rejects_is_swept_again_with_less_capacity(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dataflow.planning import pressurefit
    from dataflow.sim import SimError
    from dataflow.sim.failure import FailureKind

    real = pressurefit.Pricer.run
    calls: list[int] = []
    program = tiny_training()
    budget = 24 * MiB

    # every emission of the first sweep fails (windows fitted into the budget and into
    # what the cuts need, final write-backs in object order and largest first)
    first_sweep = search(program, budget, portfolio=PORTFOLIO[:1], repairs=0).simulated
    assert first_sweep >= 2

    def first_sweep_fails(self, found):
        outcome = real(self, found)
        calls.append(1)
        if len(calls) > first_sweep:
            return outcome
        error = SimError(FailureKind.DEADLOCK, "made to fail by the test", 0.0)
        return attrs.evolve(outcome, error=error)

    monkeypatch.setattr(pressurefit.Pricer, "run", first_sweep_fails)
    found = search(program, budget, portfolio=PORTFOLIO[:1])
    assert found.best is not None and found.simulated > first_sweep
    assert found.best.capacity_bytes < budget  # repaired: planned with more room to spare


def test_a_windows_first_sweep_keeps_a_huge_tied_embedding_resident() -> None:
    """At the no-offload peak of a tied-embedding chain the plain sweep fetches the
    embedding again after every use; delaying prefetch windows first keeps it resident,
    every task still fits, and the plan is faster."""
    from dataflow.planning.cuts import select_cuts
    from dataflow.planning.intervals import build_gaps
    from dataflow.planning.pressurefit import Strategy
    from dataflow.testing.shapes import tied_embedding

    program = tied_embedding(random.Random(1))
    chain = build_chain(program)
    gaps = build_gaps(chain)
    budget = no_offload_peak_bytes(chain)
    embedding = next(life.index for life in chain.objects if life.obj_id == "W_emb")

    def embedding_cuts(strategy: Strategy) -> int:
        selection = strategy.select(chain, gaps, budget, None)
        assert selection.failed_task is None
        return sum(1 for g, cut in enumerate(selection.cut) if cut and gaps.obj[g] == embedding)

    plain = Strategy("farthest", "jit", queue=True)
    first = Strategy("farthest", "jit", queue=True, windows_first=True)
    assert embedding_cuts(plain) >= 1
    assert embedding_cuts(first) == 0
    everything = frozenset(range(len(chain.objects)))
    pinned = select_cuts(chain, gaps, budget, queue=True, pinned=everything)
    assert pinned.cut == first.select(chain, gaps, budget, None).cut
    slow = search(program, budget, portfolio=[plain]).best
    fast = search(program, budget, portfolio=[first]).best
    assert slow is not None and fast is not None
    assert fast.sim.makespan_us < slow.sim.makespan_us


def test_rungs_whose_bound_the_plan_already_meets_are_not_swept() -> None:
    """The monotone ladder stops at the first rung whose lower bound the best plan meets
    (every smaller rung's bound is at least as large), and the plan is the same."""
    from dataflow.planning import pressurefit
    from dataflow.testing.shapes import training_linkbound

    program = training_linkbound(random.Random(3))
    chain = build_chain(program)
    ladder = pressurefit.monotone_capacities(chain)
    budget = ladder[-2]
    found = search(program, budget, chain=chain, below=ladder)
    original = pressurefit._rung_bound_us
    try:
        pressurefit._rung_bound_us = lambda bounds, rung: float("-inf")
        every = search(program, budget, chain=chain, below=ladder)
    finally:
        pressurefit._rung_bound_us = original
    assert found.best is not None and every.best is not None
    assert found.best.sim.makespan_us == every.best.sim.makespan_us
    assert found.simulated <= every.simulated
    at = pressurefit.ChainBounds(chain)
    bounds = [original(at, rung) for rung in ladder]
    assert bounds == sorted(bounds, reverse=True)  # the bounds only grow as budgets shrink


@pytest.mark.parametrize("shape", ["training", "tied-embedding", "random"])
def test_the_pricer_runs_candidates_as_the_simulator_runs_the_annotated_program(
    shape: str,
) -> None:
    """Candidates are priced without writing them into a Program; the run must be the one
    ``simulate`` gives of the annotated program (validity, makespan, peak, link bytes), at
    budgets where some candidates fail too."""
    from dataflow.planning.emit import annotate, directives, largest_first
    from dataflow.planning.intervals import build_gaps
    from dataflow.planning.prefetch import place_prefetches
    from dataflow.planning.pressurefit import Pricer
    from dataflow.sim import simulate
    from dataflow.testing.shapes import SHAPES

    failed = 0
    for seed in range(3):
        chain = build_chain(SHAPES[shape](random.Random(seed)))
        gaps = build_gaps(chain)
        floor = max(chain.base_bytes)
        peak = no_offload_peak_bytes(chain)
        for budget in (floor, (floor + peak) // 2, peak):
            # priced at less than the sweep's capacity: some of these fail
            pricer = Pricer(chain, budget - budget // 8, None)
            for strategy in PORTFOLIO:
                selection = strategy.select(chain, gaps, budget, None)
                if selection.failed_task is not None:
                    continue
                placement = place_prefetches(chain, gaps, selection.cut, budget)
                for found in (
                    directives(chain, gaps, selection.cut, placement),
                    largest_first(chain, directives(chain, gaps, selection.cut, placement))[0],
                ):
                    outcome = pricer.run(found)
                    sim = simulate(
                        annotate(chain, found, budget - budget // 8), record=False, check=False
                    )
                    assert (outcome.error is None) == sim.valid
                    failed += not sim.valid
                    if sim.valid:
                        assert outcome.makespan_us == sim.makespan_us
                        assert outcome.fast_peak_bytes == sim.fast_peak_bytes
                        assert outcome.link_bytes["h2d"] == sim.h2d.bytes
                        assert outcome.link_bytes["d2h"] == sim.d2h.bytes
    assert failed  # the comparison covered failing runs too


@pytest.mark.parametrize("shape", ["training-linkbound", "tied-embedding", "random", "streaming"])
def test_the_transfers_floor_of_a_set_of_cuts_is_below_every_plan_with_them(shape: str) -> None:
    """``transfers_floor_us`` (what the search skips rung candidates by) never exceeds the
    simulated makespan of a plan made of those cuts, and it is at least the compute."""
    from dataflow.planning.intervals import build_gaps
    from dataflow.planning.pressurefit import Strategy, transfers_floor_us
    from dataflow.testing.shapes import SHAPES

    tight = 0
    for seed in range(4):
        program = SHAPES[shape](random.Random(seed))
        chain = build_chain(program)
        gaps = build_gaps(chain)
        floor, peak = max(chain.base_bytes), no_offload_peak_bytes(chain)
        for budget in (floor, (3 * floor + peak) // 4, (floor + peak) // 2, peak):
            for strategy in (*PORTFOLIO, Strategy("clean", "early")):
                found = search(program, budget, portfolio=[strategy], repairs=0)
                if found.best is None:
                    continue
                selection = strategy.select(chain, gaps, found.best.capacity_bytes, None)
                floor_us = transfers_floor_us(chain, gaps, selection.cut)
                assert chain.start_us[-1] <= floor_us <= found.best.sim.makespan_us * (1 + 1e-12)
                tight += floor_us > found.lower_bound.compute_us * (1 + 1e-6)
    if shape in ("training-linkbound", "tied-embedding"):
        assert tight  # link-bound chains: the floor is more than the compute somewhere
