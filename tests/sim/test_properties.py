"""Properties of every run, over random annotated chains (dataflow.testing.strategies)."""

from __future__ import annotations

from collections import defaultdict

from hypothesis import HealthCheck, given, settings

from dataflow.schema import Location, Program, validate
from dataflow.sim import SimResult, simulate
from dataflow.testing.strategies import annotated_chains, bare_chains

SETTINGS = settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])


@SETTINGS
@given(annotated_chains())
def test_fast_memory_never_exceeds_the_budget(program: Program) -> None:
    result = simulate(program)
    values = [value for _, value in result.fast_memory]
    assert result.fast_peak_bytes == max(values)
    assert all(value >= 0 for value in values)
    if program.budget is not None:
        assert result.fast_peak_bytes <= program.budget.fast_bytes
    assert result.slow_peak_bytes == max(value for _, value in result.slow_memory)


@SETTINGS
@given(annotated_chains())
def test_no_task_starts_before_its_inputs_are_resident(program: Program) -> None:
    result = simulate(program)
    arrivals, departures = _residency_events(program, result)
    for index, timing in enumerate(result.tasks):
        task = program.tasks[index]
        start = timing.start_us
        for obj in task.inputs + task.mutates:
            arrived = _until(arrivals[obj], start, index)
            assert arrived, f"{task.id} started before {obj} ever arrived"
            left = [time for time in _until(departures[obj], start, index) if time >= max(arrived)]
            assert not left, f"{task.id} started at {start} but {obj} left at {left}"


def _until(events: list, start_us: float, index: int) -> list[float]:
    """Times of events that happen before task ``index`` starts at ``start_us``."""
    return [time for time, by in events if time <= start_us and (by is None or by < index)]


def _residency_events(program: Program, result: SimResult):
    """When each object became resident and when it left, read off the timeline alone:
    per object, (time_us, index of the task whose end caused it, or None for a transfer).

    Only events of earlier tasks count for a task; at equal times an arrival precedes a
    departure (a release happens at a task's end, after whatever brought the object in),
    and a transfer's end precedes a task's start.
    """
    arrivals: dict[str, list] = defaultdict(list)
    departures: dict[str, list] = defaultdict(list)
    for obj in program.objects:
        if program.exists_at_start(obj.id) and obj.location is Location.FAST:
            arrivals[obj.id].append((0.0, None))
    written_back = {(t.enqueued_by, t.obj_id) for t in result.transfers if t.direction == "d2h"}
    for index, timing in enumerate(result.tasks):
        task = program.tasks[index]
        for obj in task.outputs:
            arrivals[obj].append((timing.end_us, index))
        for obj in task.releases:
            departures[obj].append((timing.end_us, index))
        for obj in task.offloads:
            if (task.id, obj) not in written_back:  # clean: dropped at once
                departures[obj].append((timing.end_us, index))
    for transfer in result.transfers:
        events = arrivals if transfer.direction == "h2d" else departures
        events[transfer.obj_id].append((transfer.end_us, None))
    return arrivals, departures


@SETTINGS
@given(annotated_chains())
def test_each_link_is_one_fifo(program: Program) -> None:
    result = simulate(program)
    for direction in ("h2d", "d2h"):
        link = getattr(program.links, direction)
        queue = [t for t in result.transfers if t.direction == direction]
        for before, after in zip(queue, queue[1:], strict=False):
            assert before.enqueue_us <= after.enqueue_us
            assert after.start_us >= before.end_us
        for transfer in queue:
            assert transfer.start_us >= transfer.enqueue_us
            expected_us = link.latency_us + transfer.size_bytes / link.bw_bytes_per_us
            assert abs(transfer.end_us - transfer.start_us - expected_us) <= 1e-9 * max(
                1.0, transfer.end_us
            )


@SETTINGS
@given(annotated_chains())
def test_makespan_is_at_least_every_lower_bound(program: Program) -> None:
    result = simulate(program)
    tolerance = 1e-9 * max(1.0, result.makespan_us)
    assert result.makespan_us + tolerance >= result.compute_busy_us
    for direction in ("h2d", "d2h"):
        stats = result.links[direction]
        link = getattr(program.links, direction)
        assert result.makespan_us + tolerance >= stats.busy_us
        assert stats.busy_us + tolerance >= stats.bytes / link.bw_bytes_per_us
        assert 0.0 <= stats.busy_fraction <= 1.0 + 1e-9
    if result.valid:
        assert result.compute_busy_us == sum(task.cost_us for task in program.tasks)
        assert len(result.tasks) == len(program.tasks)
        assert abs(result.compute_idle_us - (result.makespan_us - result.compute_busy_us)) < 1e-6


@SETTINGS
@given(annotated_chains())
def test_the_same_input_gives_the_identical_result(program: Program) -> None:
    first, second = simulate(program), simulate(program)
    assert first == second
    again = simulate(Program.from_json(program.to_json()))
    assert again == first


@SETTINGS
@given(annotated_chains())
def test_record_false_agrees_with_record_true(program: Program) -> None:
    full, quiet = simulate(program), simulate(program, record=False)
    assert quiet.recorded is False and quiet.tasks == () and quiet.fast_memory == ()
    for field in (
        "valid",
        "makespan_us",
        "fast_peak_bytes",
        "slow_peak_bytes",
        "error",
        "h2d",
        "d2h",
        "compute_busy_us",
        "compute_idle_us",
    ):
        assert getattr(quiet, field) == getattr(full, field), field


@settings(max_examples=100, deadline=None)
@given(annotated_chains())
def test_generated_programs_are_structurally_valid(program: Program) -> None:
    assert validate(program) == []


@settings(max_examples=100, deadline=None)
@given(bare_chains())
def test_bare_chains_are_structurally_valid_and_run_without_a_budget(program: Program) -> None:
    assert validate(program) == []
    assert all(not task.directives() for task in program.tasks)
    result = simulate(program)
    # Without directives nothing is ever fetched: a run fails only on a slow object.
    assert result.valid or result.error.kind == "not-resident"


def test_most_generated_programs_run() -> None:
    """Guard against vacuous properties: most programs must be valid runs, some not."""
    outcomes: list[bool] = []

    @settings(max_examples=200, deadline=None, database=None)
    @given(annotated_chains())
    def collect(program: Program) -> None:
        outcomes.append(simulate(program).valid)

    collect()
    assert sum(outcomes) >= 0.6 * len(outcomes), f"{sum(outcomes)} of {len(outcomes)} valid"
    assert sum(outcomes) < len(outcomes), "no failing run: budgets are never tight"
