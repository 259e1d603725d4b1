"""``dataflow simulate``: the summary, the exit code, and the Chrome trace it writes."""

from __future__ import annotations

import json
from pathlib import Path

from click.testing import CliRunner

from dataflow.cli.main import cli

GOLDEN = Path(__file__).parents[1] / "sim" / "golden"


def _program_file(tmp_path: Path, case: str) -> Path:
    path = tmp_path / f"{case}.json"
    path.write_text(json.dumps(json.loads((GOLDEN / f"{case}.json").read_text())["program"]))
    return path


def test_simulate_prints_a_summary_and_writes_a_trace(tmp_path: Path) -> None:
    program = _program_file(tmp_path, "dirty_offload")
    trace = tmp_path / "out" / "trace.json"
    outcome = CliRunner().invoke(cli, ["simulate", str(program), "--trace", str(trace)])
    assert outcome.exit_code == 0, outcome.output
    for words in ("valid", "makespan", "36 us", "fast peak", "h2d link", "compute idle"):
        assert words in outcome.output
    document = json.loads(trace.read_text())
    events = document["traceEvents"]
    threads = {e["args"]["name"]: e["tid"] for e in events if e["name"] == "thread_name"}
    assert set(threads) == {"compute", "h2d", "d2h"}
    spans = [e for e in events if e["ph"] == "X"]
    by_track = {
        name: [e["name"] for e in spans if e["tid"] == tid] for name, tid in threads.items()
    }
    assert by_track == {"compute": ["t0", "t1", "t2"], "h2d": ["y"], "d2h": ["y"]}
    h2d = next(e for e in spans if e["tid"] == threads["h2d"])
    assert (h2d["ts"], h2d["dur"]) == (20.0, 6.0)
    assert h2d["args"]["size_bytes"] == 50 and h2d["args"]["enqueued_by"] == "t1"
    counters = {e["name"] for e in events if e["ph"] == "C"}
    assert counters == {"fast memory", "slow memory"}


def test_a_failing_program_exits_1_naming_the_error(tmp_path: Path) -> None:
    program = _program_file(tmp_path, "deadlock")
    trace = tmp_path / "trace.json"
    outcome = CliRunner().invoke(cli, ["simulate", str(program), "--trace", str(trace)])
    assert outcome.exit_code == 1
    assert "deadlock" in outcome.output and "'t1' waits for 'W2'" in outcome.output
    assert json.loads(trace.read_text())["traceEvents"]  # the run up to the failure


def test_budget_option_takes_sizes_and_overrides_the_program(tmp_path: Path) -> None:
    program = _program_file(tmp_path, "deadlock")
    wide = CliRunner().invoke(cli, ["simulate", str(program), "--budget", "1KiB"])
    assert wide.exit_code == 0, wide.output
    assert "of 1 KiB" in wide.output
    bad = CliRunner().invoke(cli, ["simulate", str(program), "--budget", "lots"])
    assert bad.exit_code == 2 and "not a size" in bad.output


def test_structurally_invalid_program_exits_1_listing_problems(tmp_path: Path) -> None:
    document = json.loads((GOLDEN / "overlap.json").read_text())["program"]
    document["tasks"][1]["inputs"].append("ghost")
    path = tmp_path / "bad.json"
    path.write_text(json.dumps(document))
    outcome = CliRunner().invoke(cli, ["simulate", str(path)])
    assert outcome.exit_code == 1
    assert "unknown-object" in outcome.output and "ghost" in outcome.output
