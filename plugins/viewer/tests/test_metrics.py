"""The figures of a timeline, checked against the simulator's own totals and against
brute-force recounts."""

from __future__ import annotations

import pytest
from dataflow_viewer.metrics import (
    busy_us,
    deviations,
    link_rates,
    stall_instants,
    stalls_by_object,
    step_work,
    summary,
)
from dataflow_viewer.run import planner_spec
from hypothesis import given
from hypothesis import strategies as st

from dataflow import Timeline, TransferSpan, plan


@given(st.lists(st.tuples(st.integers(0, 200), st.integers(1, 50)), max_size=30))
def test_busy_us_is_the_union_length(pairs) -> None:
    spans = [(float(start), float(start + length)) for start, length in pairs]
    covered = {t for start, stop in spans for t in range(int(start), int(stop))}
    assert busy_us(spans) == pytest.approx(len(covered))


def test_summary_agrees_with_the_simulator(tiny_program, tiny_run) -> None:
    sim = plan(tiny_program, tiny_run.budget_bytes, planner=planner_spec("pressurefit")).sim
    work = step_work(tiny_run.program)
    figures = summary(tiny_run.predicted, work)
    assert work.tokens == 8 * 64  # batch x seq_len x one round
    assert figures["step_s"] == pytest.approx(sim.makespan_us / 1e6)
    assert figures["tok_s"] == pytest.approx(work.tokens / figures["step_s"])
    assert figures["tflops"] == pytest.approx(work.model_flops / figures["step_s"] / 1e12)
    assert figures["fast_peak_bytes"] == sim.fast_peak_bytes
    assert figures["h2d_bytes"] == sim.h2d.bytes
    assert figures["d2h_bytes"] == sim.d2h.bytes
    assert figures["compute_idle_pct"] == pytest.approx(100 * sim.compute_idle_fraction)
    assert figures["recompute_pct"] == 0  # PressureFit never recomputes


def test_summary_takes_a_better_step_time(tiny_run) -> None:
    work = step_work(tiny_run.program)
    figures = summary(tiny_run.predicted, work, step_s=1.0)
    assert figures["step_s"] == 1.0
    assert figures["tok_s"] == pytest.approx(work.tokens)


def test_a_hand_written_program_has_no_step_work() -> None:
    from dataflow.testing import tiny_chain

    assert step_work(tiny_chain()) is None


def test_deviations_rank_the_slowed_tasks_first(measured_run, slowdowns) -> None:
    found = deviations(measured_run.predicted, measured_run.measured, top=20)
    predicted = {span.task_id: span.duration_us for span in measured_run.predicted.tasks}
    extra = {task: predicted[task] * (factor - 1) for task, factor in slowdowns.items()}
    expected = sorted(extra, key=lambda task: -extra[task])
    assert [d.task_id for d in found[: len(expected)]] == expected
    for d in found[: len(expected)]:
        assert d.diff_us == pytest.approx(extra[d.task_id])
        assert d.ratio == pytest.approx(slowdowns[d.task_id])
    assert all(d.diff_us == pytest.approx(0, abs=1e-9) for d in found[len(expected) :])
    assert len(deviations(measured_run.predicted, measured_run.measured, top=2)) == 2


def test_stall_attribution_accounts_for_every_gap(tiny_run) -> None:
    spans = sorted(tiny_run.predicted.tasks, key=lambda s: s.start_us)
    gaps, end = 0.0, 0.0
    for span in spans:
        gaps += max(0.0, span.start_us - end)
        end = max(end, span.end_us)
    attributed = stalls_by_object(tiny_run.predicted, tiny_run.program)
    assert attributed, "a 2 MiB plan of GPT-2 tiny waits for its transfers"
    assert sum(wait for _, wait, _ in attributed) == pytest.approx(gaps)
    assert [w for _, w, _ in attributed] == sorted((w for _, w, _ in attributed), reverse=True)


def test_stalls_are_worked_out_when_a_timeline_has_none(tiny_run) -> None:
    bare = Timeline("old", tasks=tiny_run.predicted.tasks, transfers=tiny_run.predicted.transfers)
    assert stall_instants(bare, tiny_run.program) == list(tiny_run.predicted.instants)


def test_link_rates_integrate_to_the_bytes_moved(tiny_run) -> None:
    rates = link_rates(tiny_run.predicted)
    assert set(rates) == {"h2d", "d2h"}
    for direction, counter in rates.items():
        points = [*counter.points, (tiny_run.predicted.end_us, 0.0)]
        gb = (
            sum(rate * (t1 - t0) for (t0, rate), (t1, _) in zip(points, points[1:], strict=False))
            / 1e6
        )
        moved = sum(s.size_bytes for s in tiny_run.predicted.transfers_on(direction))
        assert gb * 1e9 == pytest.approx(moved, rel=1e-9)


def test_link_rates_of_a_timeline_without_counters() -> None:
    timeline = Timeline("t", transfers=[TransferSpan("x", "h2d", 4000, 0.0, 2.0)])
    (counter,) = link_rates(timeline).values()
    assert counter.points[0] == (0.0, 2.0)  # 4000 bytes in 2 µs: 2 GB/s
