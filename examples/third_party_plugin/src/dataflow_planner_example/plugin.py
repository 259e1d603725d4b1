"""The module the ``dataflow`` entry point names: it only registers records.

Kept tiny on purpose: dataflow imports it whenever it builds a plugin manager (every CLI
call), so the planner's code is imported only when the planner runs.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from dataflow import PlannerSpec, hookimpl

if TYPE_CHECKING:
    from dataflow import Program


def _plan_keep_all(program: Program, budget_bytes: int, **options: object) -> Program:
    from dataflow_planner_example.keep_all import plan_keep_all

    return plan_keep_all(program, budget_bytes, **options)


@hookimpl
def dataflow_planners() -> list[PlannerSpec]:
    return [
        PlannerSpec(
            name="keep-all",
            plan=_plan_keep_all,
            description="keep every object resident; fails when that does not fit the budget",
        )
    ]
