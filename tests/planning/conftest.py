"""Every plan any planning test produces is re-validated by the simulator: the autouse
fixture wraps ``pressurefit.search`` (which ``plan``, the registered planner and the
minimal-budget search all go through) and re-runs each best candidate with a full
structural check and a recorded timeline, asserting it is valid, within its budget, and
no faster than the lower bound.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from dataflow.planning import pressurefit
from dataflow.schema import Program
from dataflow.testing.plan_checks import check_plan


@pytest.fixture(autouse=True)
def revalidate_every_plan(monkeypatch: pytest.MonkeyPatch) -> Iterator[list[int]]:
    """Re-simulate the best candidate of every search the test runs; yields how many."""
    checked: list[int] = []
    original = pressurefit.search

    def checked_search(program: Program, budget_bytes: int, **options):
        found = original(program, budget_bytes, **options)
        if found.best is not None:
            check_plan(program, found.best.program, budget_bytes)
            checked.append(budget_bytes)
        return found

    monkeypatch.setattr(pressurefit, "search", checked_search)
    yield checked
