"""``none`` as a budget of ``dataflow simulate`` and ``dataflow plan``: no limit, not even
the program's own (as their ``--help`` says), on a program whose slow budget of 10 bytes
is too small for the 50 bytes it offloads."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow.schema import Program
from dataflow.testing import assert_one_line_error, invoke

GOLDEN = Path(__file__).parents[1] / "sim" / "golden"


@pytest.fixture
def planned(tmp_path: Path) -> Path:
    """dirty_offload (offloads 50 bytes of ``y``) with a budget of 1000 fast, 10 slow."""
    program = json.loads((GOLDEN / "dirty_offload.json").read_text())["program"]
    program["budget"] = {"fast_bytes": 1000, "slow_bytes": 10}
    path = tmp_path / "planned.json"
    path.write_text(json.dumps(program))
    return path


def test_simulate_slow_budget_none_lifts_the_programs_slow_budget(planned: Path) -> None:
    assert_one_line_error(invoke("simulate", planned), 1, "slow-budget", "slow budget 10")
    unbounded = invoke("simulate", planned, "--slow-budget", "none")
    assert unbounded.exit_code == 0, unbounded.output
    slow = next(line for line in unbounded.output.splitlines() if "slow peak" in line)
    assert "50 B" in slow and "no budget" in slow
    fast = next(line for line in unbounded.output.splitlines() if "fast peak" in line)
    assert "of 1000 B" in fast  # the other limit stays the program's


def test_simulate_budget_none_lifts_the_fast_budget_alone(planned: Path) -> None:
    result = invoke("simulate", planned, "--budget", "None")
    assert_one_line_error(result, 1, "slow budget 10", "of no budget")
    result = invoke("simulate", planned, "--budget", "none", "--slow-budget", "none")
    assert result.exit_code == 0, result.output


def test_plan_slow_budget_none_plans_without_the_programs(planned: Path, tmp_path) -> None:
    bare = tmp_path / "bare.json"
    bare.write_text(Program.from_json(planned.read_text()).bare().to_json())
    refused = invoke("plan", bare, "--budget", "1KiB")
    assert_one_line_error(refused, 1, "more than the slow budget of 10 B")
    out = tmp_path / "out.json"
    result = invoke("plan", bare, "--budget", "1KiB", "--slow-budget", "none", "-o", out)
    assert result.exit_code == 0, result.output
    assert Program.from_json(out.read_text()).budget.slow_bytes is None
