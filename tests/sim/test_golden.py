"""Golden programs with hand-computed timelines (tests/sim/golden/*.json).

Each file holds a program, the budget inside it, and the run worked out by hand from
docs/execution_model.md: every task and transfer time, fast and slow memory after every
change, link totals, and for failures the error. A change to the simulator that alters
any of them must say why.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow.schema import Program, validate
from dataflow.sim import simulate

GOLDEN = Path(__file__).parent / "golden"
CASES = sorted(GOLDEN.glob("*.json"))


def _load(path: Path) -> tuple[Program, dict]:
    document = json.loads(path.read_text())
    return Program.from_dict(document["program"]), document["expected"]


@pytest.mark.parametrize("path", CASES, ids=[path.stem for path in CASES])
def test_golden_timeline(path: Path) -> None:
    program, expected = _load(path)
    result = simulate(program)
    assert result.valid is expected["valid"]
    assert result.makespan_us == expected["makespan_us"]
    assert result.fast_peak_bytes == expected["fast_peak_bytes"]
    assert result.slow_peak_bytes == expected["slow_peak_bytes"]
    assert result.compute_busy_us == expected["compute_busy_us"]
    assert result.compute_idle_us == expected["compute_idle_us"]
    for direction in ("h2d", "d2h"):
        stats = result.links[direction]
        assert [stats.transfers, stats.bytes, stats.busy_us] == [
            expected[direction]["transfers"],
            expected[direction]["bytes"],
            expected[direction]["busy_us"],
        ], direction
    assert [[t.task_id, t.start_us, t.end_us] for t in result.tasks] == expected["tasks"]
    assert [
        [t.obj_id, t.direction, t.size_bytes, t.enqueued_by, t.enqueue_us, t.start_us, t.end_us]
        for t in result.transfers
    ] == expected["transfers"]
    assert [list(point) for point in result.fast_memory] == expected["fast_memory"]
    assert [list(point) for point in result.slow_memory] == expected["slow_memory"]
    _check_error(result.error, expected["error"])


def _check_error(error, expected: dict | None) -> None:
    if expected is None:
        assert error is None
        return
    assert error is not None
    for field in ("kind", "time_us", "task", "fast_bytes_in_use", "fast_budget_bytes"):
        assert getattr(error, field) == expected[field], field
    for field in ("objects", "resident", "incoming"):
        assert list(getattr(error, field)) == expected[field], field
    for text in expected["message_mentions"]:
        assert text in error.message


@pytest.mark.parametrize("path", CASES, ids=[path.stem for path in CASES])
def test_golden_record_false_agrees(path: Path) -> None:
    program, expected = _load(path)
    quiet = simulate(program, record=False)
    assert quiet.valid is expected["valid"]
    assert quiet.makespan_us == expected["makespan_us"]
    assert quiet.fast_peak_bytes == expected["fast_peak_bytes"]
    assert quiet.tasks == () and quiet.transfers == () and quiet.fast_memory == ()


def test_golden_programs_are_structurally_valid() -> None:
    assert len(CASES) >= 4
    for path in CASES:
        program, _ = _load(path)
        assert validate(program) == [], path.name
