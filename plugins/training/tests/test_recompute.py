"""The recompute planner: never slower than PressureFit alone on a step that fits, makes
a step fit that does not, and leaves other programs to PressureFit."""

from __future__ import annotations

import attrs
import pytest
from dataflow_training.plan.recompute import RECOMPUTE, Rewriter, recompute_planner, search
from dataflow_training.step.config import TrainConfig
from dataflow_training.step.costs import RooflineCost
from dataflow_training.step.layout import StepLayout
from dataflow_training.step.lowering import lower
from dataflow_training.testing.toy import ToyFamily
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow import InfeasibleBudget, Link, Links, PlanningError, minimal_budget, plan, validate
from dataflow.testing import PlannerConformance, tiny_chain

TOY = ToyFamily()


def _step(seq_len=32, batch=4, rounds=2, family=TOY, preset="small"):
    return lower(family, preset, TrainConfig(seq_len=seq_len, batch=batch, rounds=rounds))


@settings(max_examples=15, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    seq_len=st.sampled_from([8, 16, 32]),
    batch=st.integers(1, 4),
    rounds=st.integers(1, 3),
    where=st.floats(0.0, 1.0),
    family=st.sampled_from(["toy", "toy_moe"]),
)
def test_it_never_makes_a_step_that_fits_slower(seq_len, batch, rounds, where, family) -> None:
    from dataflow_training.step.family import load_family

    fam = TOY if family == "toy" else load_family(family)
    preset = "small" if family == "toy" else next(iter(fam.presets))
    step = _step(seq_len, batch, rounds, fam, preset)
    program = step.program
    peak = plan(program, 2**40).sim.fast_peak_bytes
    budget = int(peak * (0.25 + 0.75 * where))
    try:
        alone = plan(program, budget)
    except InfeasibleBudget:
        return  # the other test's case
    choice = search(Rewriter(step), budget)
    assert choice.step_us <= alone.makespan_us * (1 + 1e-9)
    # what the registered planner hands back passes the simulator's own check
    again = plan(program, budget, planner=recompute_planner(family=fam))
    assert again.sim.valid and again.makespan_us == pytest.approx(choice.step_us)
    assert validate(again.program) == []


def test_it_makes_a_step_fit_a_backing_budget_it_does_not_fit_alone() -> None:
    program = _step().program
    budget = minimal_budget(program)
    fits = plan(program, budget).sim.slow_peak_bytes
    backing = fits - 4 * program.obj("A_0_0_0").size_bytes
    with pytest.raises(InfeasibleBudget):
        plan(program, budget, slow_budget_bytes=backing)
    planner = recompute_planner(family=TOY)
    planned = plan(program, budget, planner=planner, slow_budget_bytes=backing)
    assert planned.sim.valid and planned.sim.slow_peak_bytes <= backing
    rec = [t for t in planned.program.tasks if t.kind == "rec"]
    assert rec
    # the recomputed step's layout rides along: every rec task has its slot
    slots = StepLayout.of(planned.program).tasks
    assert all(slots[t.id].kind == "rec" for t in rec)
    # below what even every unit recomputed needs, the error says so
    with pytest.raises(PlanningError, match="more than the slow budget"):
        plan(program, budget, planner=planner, slow_budget_bytes=backing // 4)


def test_a_step_with_time_to_spare_is_left_as_it_is() -> None:
    step = _step()
    program = step.program
    choice = search(Rewriter(step), 2**40)
    assert choice.units == frozenset()
    assert choice.step_us == plan(program, 2**40).makespan_us
    # a step already as fast as its compute: no candidate can win, none is planned
    instant = Links(h2d=Link(1e15), d2h=Link(1e15))
    compute_bound = attrs.evolve(program, links=instant)
    assert search(Rewriter(step.with_program(compute_bound)), 2**40).candidates == 1


def test_steady_state_candidates_try_the_homes_of_the_first_plan(monkeypatch) -> None:
    """In a steady-state search the first plan that fits tries every set of fast homes;
    later candidates try only the set it chose, and a winner planned so is planned again
    with every set. The answer is never slower than the step planned alone."""
    from dataflow_training.plan import recompute

    seen: list = []  # per candidate planned: the homes it tried, None for every set
    made: list = []  # (spec, homes) of each narrowed planner made
    real_plan, real_within = recompute.plan, recompute._quick_within

    def within(homes):
        spec = real_within(homes)
        made.append((spec, homes))
        return spec

    def recording(program, budget_bytes, *, planner, **options):
        seen.append(next((h for spec, h in made if spec is planner), None))
        return real_plan(program, budget_bytes, planner=planner, **options)

    monkeypatch.setattr(recompute, "_quick_within", within)
    monkeypatch.setattr(recompute, "plan", recording)
    step = _step(rounds=3)
    program = step.program
    peak = plan(program, 2**40, cyclic=True).sim.fast_peak_bytes
    narrowed = 0
    for share in (0.3, 0.5, 0.7, 0.9):
        budget = int(peak * share)
        try:
            alone = plan(program, budget, cyclic=True).cycle.iteration_us
        except InfeasibleBudget:
            alone = None
        seen.clear()
        try:
            choice = search(Rewriter(step), budget, cyclic=True)
        except InfeasibleBudget:
            continue  # below what every unit recomputed needs
        assert choice.plan.cycle is not None and choice.plan.cycle.valid
        if alone is not None:
            assert choice.step_us <= alone * (1 + 1e-9)
        first = next(i for i, homes in enumerate(seen) if homes is None)
        later = seen[first + 1 :]
        assert all(homes is None or isinstance(homes, frozenset) for homes in later)
        if any(homes is not None for homes in later):
            narrowed += 1
            assert later[-1] is None  # the winner, with every set
    assert narrowed


def test_a_candidate_is_what_the_lowering_makes_of_its_units() -> None:
    step = _step()
    program = step.program
    rewriter = Rewriter(step)
    units = [(1, 0), (0, 2)]
    spliced = rewriter.candidate(units)
    lowered = lower(TOY, "small", TrainConfig(seq_len=32, batch=4, rounds=2), recompute=units)
    strip = lambda p: [attrs.evolve(t, cost_us=0.0) for t in p.tasks]  # noqa: E731
    assert strip(spliced.program) == strip(lowered.program)
    assert spliced.layout.tasks == lowered.layout.tasks
    # the layout written out with it is the same, read back as the program's readers do
    assert StepLayout.of(spliced.program).tasks == lowered.layout.tasks
    # given costs are kept; a rec task is priced as its forward
    scaled = attrs.evolve(program, tasks=[attrs.evolve(t, cost_us=7.0) for t in program.tasks])
    candidate = Rewriter(step.with_program(scaled)).candidate(units)
    costs = {t.id: t.cost_us for t in candidate.program.tasks}
    assert costs["rec_0_1_0"] == pytest.approx(7.0) and costs["bwd_0_1_0"] == 7.0


class TestRecomputePlanner(PlannerConformance):
    distribution = "dataflow-training"
    expected_names = ("recompute",)


def test_other_programs_go_to_pressurefit() -> None:
    program = tiny_chain()
    budget = minimal_budget(program)
    assert plan(program, budget, planner=RECOMPUTE).program == plan(program, budget).program


def test_a_recomputed_step_trains_exactly_as_the_saving_one() -> None:
    """On the engine (CPU): the planner's recomputed step gives the losses and weights of
    the step that keeps every A (forward is recompute plus one op, so bitwise equal)."""
    import torch
    from dataflow_training.drive.run import TrainingRun

    pytest.importorskip("dataflow_family_gpt2")
    pytest.importorskip("dataflow_resolver_torch")
    train = TrainConfig(seq_len=16, batch=2, rounds=2)
    saving = TrainingRun.of("gpt2", "gpt2_tiny", train, recompute=False, cost=RooflineCost())
    # half the saving step's peak: tight enough that re-deriving activations beats
    # offloading them, priced by the declared costs (at 0.7 PressureFit's plan of the
    # saving step is the faster one; a CPU's measured costs may offload instead)
    budget = int(0.5 * saving.compiled.plan.sim.fast_peak_bytes)
    recomputing = TrainingRun.of(
        "gpt2", "gpt2_tiny", train, budget_bytes=budget, cost=RooflineCost()
    )
    assert any(t.kind == "rec" for t in recomputing.compiled.program.tasks)
    generator = torch.Generator().manual_seed(0)
    for _ in range(2):
        batches = [(torch.randint(0, 256, (2, 16), generator=generator),) * 2 for _ in range(2)]
        a, b = saving.step(batches), recomputing.step(batches)
        assert a.losses == b.losses
    theirs = recomputing.state()[0]
    for name, tensor in saving.state()[0].items():
        assert torch.equal(tensor, theirs[name]), name
