"""The simulator is fast enough for a planner's inner loop (benchmarks/sim_speed.py)."""

from __future__ import annotations

import time

import attrs
import pytest

from dataflow.sim import simulate
from dataflow.testing.chains import stream_all, training_chain

BUDGET_BYTES = 120 * 2**20


@pytest.fixture(scope="module")
def step():
    program = stream_all(training_chain(1427, 3))
    assert len(program.tasks) == 10_000
    return program


def test_ten_thousand_tasks_simulate_in_under_a_second(step) -> None:
    times = []
    for _ in range(3):
        start = time.perf_counter()
        result = simulate(step, budget_bytes=BUDGET_BYTES, record=False, check=False)
        times.append(time.perf_counter() - start)
    assert result.valid
    assert min(times) < 1.0, times


def test_record_false_totals_equal_record_true_on_a_large_program(step) -> None:
    quiet = simulate(step, budget_bytes=BUDGET_BYTES, record=False, check=False)
    full = simulate(step, budget_bytes=BUDGET_BYTES)
    assert attrs.evolve(full, recorded=False, tasks=(), transfers=(), fast_memory=(),
                        slow_memory=()) == quiet  # fmt: skip
    assert len(full.tasks) == 10_000
    assert len(full.transfers) == full.h2d.transfers + full.d2h.transfers > 30_000
    assert full.fast_peak_bytes <= BUDGET_BYTES
    # The budget binds: transfers wait for room, so it runs slower than unbounded.
    unbounded = simulate(step, record=False, check=False)
    assert unbounded.valid and unbounded.makespan_us < full.makespan_us
