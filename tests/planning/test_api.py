"""``plan`` takes its planner (a spec or a callable), looks nothing up, and never returns a
plan that fails."""

from __future__ import annotations

import random

import pytest

from dataflow import hookimpl
from dataflow.planning import (
    PRESSUREFIT,
    Plan,
    PlanningError,
    lower_bound,
    minimal_budget,
    plan,
)
from dataflow.planning.intervals import build_chain, no_offload_peak_bytes
from dataflow.registry import PlannerSpec, UnknownNameError
from dataflow.schema import Program, validate
from dataflow.sim import simulate
from dataflow.testing.shapes import SHAPES, MiB, tiny_streaming


class _Planners:
    """A third-party plugin with one honest planner and one that returns nonsense."""

    @hookimpl
    def dataflow_planners(self) -> list[PlannerSpec]:
        return [
            PlannerSpec("as-is", lambda program, budget_bytes, **options: program.bare()),
            PlannerSpec("delegate", _delegate),
        ]


def _delegate(program: Program, budget_bytes: int, **options: object) -> Program:
    from dataflow.planning.api import plan_pressurefit

    return plan_pressurefit(program, budget_bytes, **options)


def test_plan_fields() -> None:
    planned = plan(tiny_streaming(), 20 * MiB)
    assert isinstance(planned, Plan)
    assert planned.planner == "pressurefit" and planned.budget_bytes == 20 * MiB
    assert planned.sim.valid and planned.sim.recorded
    assert planned.program.budget.fast_bytes == 20 * MiB
    assert planned.lower_bound_us == planned.lower_bound.best_us > 0
    assert planned.makespan_ratio >= 1.0 and planned.planning_s >= 0.0
    assert planned.moved_bytes == planned.sim.h2d.bytes + planned.sim.d2h.bytes


def test_a_planner_spec_from_the_registry_is_passed_in(isolated_plugin_manager) -> None:
    manager = isolated_plugin_manager(_Planners())
    planned = plan(tiny_streaming(), 20 * MiB, planner=manager.planners().get("delegate"))
    assert planned.planner == "delegate" and planned.sim.valid


def test_a_plain_callable_is_a_planner() -> None:
    planned = plan(tiny_streaming(), 20 * MiB, planner=_delegate)
    assert planned.planner == "_delegate" and planned.sim.valid
    assert planned.spec.plan is _delegate


def test_plan_does_no_registry_lookup(monkeypatch: pytest.MonkeyPatch) -> None:
    import dataflow.plugins

    def refuse(*args, **kwargs):
        raise AssertionError("plan() looked a planner up in the registry")

    monkeypatch.setattr(dataflow.plugins, "planners", refuse)
    monkeypatch.setattr(dataflow.plugins, "get_plugin_manager", refuse)
    assert plan(tiny_streaming(), 20 * MiB).planner == "pressurefit"


def test_a_name_is_not_a_planner() -> None:
    with pytest.raises(TypeError, match="planners\\(\\).get"):
        plan(tiny_streaming(), 20 * MiB, planner="pressurefit")


def test_the_registered_pressurefit_is_the_default() -> None:
    from dataflow.plugins import planners

    assert planners().get("pressurefit") is PRESSUREFIT
    assert PRESSUREFIT.minimal_budget(tiny_streaming()) == minimal_budget(tiny_streaming())


def test_a_plan_that_fails_in_the_simulator_is_never_returned() -> None:
    def as_is(program: Program, budget_bytes: int, **options: object) -> Program:
        return program.bare()

    with pytest.raises(PlanningError, match="planner 'as_is' returned a plan .* that fails"):
        plan(tiny_streaming(), 20 * MiB, planner=as_is)  # slow weights never prefetched


def test_an_unknown_planner_name_in_the_registry_lists_the_known_ones() -> None:
    from dataflow.plugins import planners

    with pytest.raises(UnknownNameError, match="pressurefit"):
        planners().get("no-such-planner")


@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_plan_matches_a_plan_validated_and_bounded_from_scratch(shape: str) -> None:
    """PressureFit's ``plan`` validates the bare chain once and reuses its search's chain
    and bounds: what it returns passes the full structural check, and its simulation and
    lower bound equal those made from scratch from the planned program."""
    program = SHAPES[shape](random.Random(3))
    chain = build_chain(program)
    floor, peak = max(chain.base_bytes), no_offload_peak_bytes(chain)
    for budget in (peak, floor + (peak - floor) // 2):
        planned = plan(program, budget)
        assert validate(planned.program) == [], (shape, budget)
        assert planned.sim == simulate(planned.program, budget_bytes=budget)
        assert planned.lower_bound == lower_bound(planned.program, budget)


@pytest.mark.parametrize("enabled", [True, False])
def test_plan_pauses_the_garbage_collector_and_restores_it(
    enabled: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    import gc

    import dataflow.planning.api as api

    seen: list[bool] = []
    original = api._run_planner

    def spying(*args, **kwargs):
        seen.append(gc.isenabled())
        return original(*args, **kwargs)

    monkeypatch.setattr(api, "_run_planner", spying)
    (gc.enable if enabled else gc.disable)()
    try:
        plan(tiny_streaming(), 20 * MiB)
        assert seen == [False] and gc.isenabled() is enabled
        with pytest.raises(PlanningError):
            plan(tiny_streaming(), 1)  # restored when planning fails too
        assert gc.isenabled() is enabled
    finally:
        gc.enable()
