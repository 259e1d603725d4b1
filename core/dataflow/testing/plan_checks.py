"""Checks a planner's output must pass, for dataflow's tests and planner plugins' tests."""

from __future__ import annotations

import attrs

from dataflow.planning import lower_bound
from dataflow.schema import Program
from dataflow.sim import simulate


def check_plan(bare: Program, planned: Program, budget_bytes: int) -> None:
    """Assert that ``planned`` runs ``bare``'s chain validly within ``budget_bytes`` (a full
    simulation, structural checks included), never faster than the lower bound, and
    changes nothing of the chain but its directives and its budget."""
    result = simulate(planned, budget_bytes=budget_bytes)
    assert result.valid, result.error
    assert result.fast_peak_bytes <= budget_bytes
    assert planned.budget is not None and planned.budget.fast_bytes == budget_bytes
    assert attrs.evolve(planned.bare(), budget=None) == attrs.evolve(bare.bare(), budget=None)
    bound = lower_bound(bare, budget_bytes)
    assert result.makespan_us >= bound.best_us * (1 - 1e-12), (result.makespan_us, bound)
