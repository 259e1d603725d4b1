"""Fixtures shared by the training plugin's tests."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import pytest


def _forced(units: frozenset, partial: Mapping | None = None):
    """A planner that plans the step with ``units`` ((round, block) pairs) re-derived and
    ``partial`` saved partially (the recompute rewriter's candidate), whatever the budget."""
    from dataflow_training.plan.recompute import Rewriter
    from dataflow_training.step.lowering import Lowered

    from dataflow import PRESSUREFIT, PlannerSpec

    def forced(program, budget_bytes, **options):
        candidate = Rewriter(Lowered.read(program)).candidate(units, partial or {})
        return PRESSUREFIT.plan(candidate.program, budget_bytes, **options)

    return PlannerSpec("forced", forced)


@pytest.fixture
def forced_planner() -> Callable:
    """``forced_planner(units, partial=None)``: a ``PlannerSpec`` that re-derives
    ``units`` whatever the budget (``_forced``)."""
    return _forced
