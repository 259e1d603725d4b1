"""``dataflow trace`` writes predicted and measured timelines side by side."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest
from click.testing import CliRunner

from dataflow.cli.main import cli

chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")


def _annotated(tmp_path: Path) -> Path:
    program = chain.build_program(layers=2, dim=8, batch=4)
    objects = tuple(
        attrs.evolve(o, location="fast") if o.id.startswith("W_") else o for o in program.objects
    )
    last = attrs.evolve(program.tasks[-1], offloads=("dW_0", "dW_1"))
    program = attrs.evolve(program, objects=objects, tasks=(*program.tasks[:-1], last))
    path = tmp_path / "planned.json"
    path.write_text(program.to_json())
    return path


def test_trace_has_predicted_and_measured_processes(tmp_path: Path) -> None:
    out = tmp_path / "trace.json"
    result = CliRunner().invoke(
        cli, ["trace", str(_annotated(tmp_path)), "--resolver", "matmul-chain", "-o", str(out)]
    )
    assert result.exit_code == 0, result.output
    assert "predicted" in result.output and "measured" in result.output
    document = json.loads(out.read_text())
    names = [t["name"] for t in document["otherData"]["timelines"]]
    assert len(names) == 2 and "predicted" in names[0] and "measured" in names[1]
    pids = {event["pid"] for event in document["traceEvents"] if event.get("ph") == "X"}
    assert pids == {1, 2}


def test_trace_with_an_unknown_resolver_names_it(tmp_path: Path) -> None:
    result = CliRunner().invoke(
        cli, ["trace", str(_annotated(tmp_path)), "--resolver", "nope", "-o", str(tmp_path / "t")]
    )
    assert result.exit_code != 0
    assert "no resolver named 'nope'" in result.output
