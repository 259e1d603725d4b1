"""``dataflow plan``: the summary, the planned program, the trace, and infeasible budgets."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from dataflow.cli.main import cli
from dataflow.schema import Program
from dataflow.sim import simulate
from dataflow.testing.shapes import tiny_training


def _write(tmp_path: Path) -> Path:
    path = tmp_path / "chain.json"
    path.write_text(tiny_training().to_json())
    return path


def test_plan_prints_the_summary_and_writes_the_plan_and_trace(tmp_path: Path) -> None:
    source = _write(tmp_path)
    planned_path, trace_path = tmp_path / "planned.json", tmp_path / "trace.json"
    result = CliRunner().invoke(
        cli,
        [
            "plan",
            str(source),
            "--budget",
            "20MiB",
            "-o",
            str(planned_path),
            "--trace",
            str(trace_path),
            "--place",
        ],
    )
    assert result.exit_code == 0, result.output
    for words in (
        "makespan",
        "over the lower bound",
        "fast peak",
        "moved",
        "compute idle",
        "directives",
        "arena",
        "pressurefit, budget 20 MiB",
    ):
        assert words in result.output
    planned = Program.from_json(planned_path)
    assert planned.budget.fast_bytes == 20 * 2**20
    assert simulate(planned).valid
    trace = json.loads(trace_path.read_text())
    assert trace["traceEvents"]


def test_an_infeasible_budget_prints_the_minimum_and_the_task_and_exits_1(tmp_path) -> None:
    result = CliRunner().invoke(cli, ["plan", str(_write(tmp_path)), "--budget", "10MiB"])
    assert result.exit_code == 1
    assert "the smallest budget that works is 16 MiB (16777216 bytes)" in result.output
    assert "task 'opt0' forces it" in result.output


def test_a_bad_size_is_a_usage_error(tmp_path: Path) -> None:
    result = CliRunner().invoke(cli, ["plan", str(_write(tmp_path)), "--budget", "lots"])
    assert result.exit_code == 2 and "is not a size" in result.output


def test_a_program_with_persistent_objects_is_planned_as_a_cycle_unless_once(
    tmp_path: Path,
) -> None:
    import attrs

    program = tiny_training()
    weights = tuple(o.id for o in program.objects if o.role == "param")
    assert weights
    source = tmp_path / "loop.json"
    source.write_text(attrs.evolve(program, persistent=weights).to_json())
    cyclic = CliRunner().invoke(cli, ["plan", str(source), "--budget", "20MiB"])
    assert cyclic.exit_code == 0, cyclic.output
    assert "steady state" in cyclic.output
    once = CliRunner().invoke(cli, ["plan", str(source), "--budget", "20MiB", "--once"])
    assert once.exit_code == 0, once.output
    assert "steady state" not in once.output
    plain = CliRunner().invoke(cli, ["plan", str(_write(tmp_path)), "--budget", "20MiB"])
    assert plain.exit_code == 0 and "steady state" not in plain.output
