"""The budget sweep: from the smallest budget that plans to the no-offload peak."""

from __future__ import annotations

import pytest
from dataflow_viewer.metrics import step_work
from dataflow_viewer.run import planner_spec
from dataflow_viewer.sweep import UNBOUNDED_BYTES, sweep

from dataflow import minimal_budget, plan


def test_sweep_spans_minimum_to_no_offload_peak(tiny_program) -> None:
    points = sweep(tiny_program, step_work(tiny_program), "pressurefit", points=4)
    roomy = plan(tiny_program, UNBOUNDED_BYTES, planner=planner_spec("pressurefit"))
    assert points[0].budget_bytes == minimal_budget(tiny_program)
    assert points[-1].budget_bytes == roomy.sim.fast_peak_bytes
    assert len(points) == 4 and all(p.step_s is not None for p in points)
    # at the no-offload peak the step runs as if memory were unbounded
    assert points[-1].step_s == pytest.approx(roomy.sim.makespan_us / 1e6)
    assert points[0].step_s >= points[-1].step_s
    tokens = 8 * 64
    assert all(p.tok_s == pytest.approx(tokens / p.step_s) for p in points)


def test_a_planner_s_own_minimum_starts_it(tiny_program) -> None:
    spec = planner_spec("recompute")
    points = sweep(tiny_program, None, "recompute", points=2)
    assert points[0].budget_bytes == spec.minimal_budget(tiny_program)
    assert points[0].tok_s is None  # no step work given: no tokens/s


def test_bad_sweeps_say_why(tiny_program) -> None:
    with pytest.raises(ValueError, match="at least 2 points"):
        sweep(tiny_program, None, points=1)
    with pytest.raises(ValueError, match="planner: no planner named 'nope'; known: .*pressurefit"):
        sweep(tiny_program, None, "nope")
