"""``plan`` goes through the planner registry and never returns a plan that fails."""

from __future__ import annotations

import pytest

from dataflow import hookimpl
from dataflow.planning import Plan, PlanningError, plan
from dataflow.registry import PlannerSpec, UnknownNameError
from dataflow.schema import Program
from dataflow.testing.shapes import MiB, tiny_streaming


class _Planners:
    """A third-party plugin with one honest planner and one that returns nonsense."""

    @hookimpl
    def dataflow_planners(self) -> list[PlannerSpec]:
        return [
            PlannerSpec("as-is", lambda program, budget_bytes, **options: program.bare()),
            PlannerSpec("delegate", _delegate),
        ]


def _delegate(program: Program, budget_bytes: int, **options: object) -> Program:
    from dataflow.planning.pressurefit import plan_pressurefit

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


def test_a_third_party_planner_is_found_by_name(isolated_plugin_manager) -> None:
    isolated_plugin_manager(_Planners())
    planned = plan(tiny_streaming(), 20 * MiB, planner="delegate")
    assert planned.planner == "delegate" and planned.sim.valid


def test_a_plan_that_fails_in_the_simulator_is_never_returned(isolated_plugin_manager) -> None:
    isolated_plugin_manager(_Planners())
    with pytest.raises(PlanningError, match="planner 'as-is' returned a plan .* that fails"):
        plan(tiny_streaming(), 20 * MiB, planner="as-is")  # slow weights never prefetched


def test_an_unknown_planner_lists_the_known_ones() -> None:
    with pytest.raises(UnknownNameError, match="pressurefit"):
        plan(tiny_streaming(), 20 * MiB, planner="no-such-planner")
