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


SHIPPED = Path(__file__).parents[2] / "examples" / "programs" / "training_step.json"
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


@pytest.mark.parametrize("device", DEVICES)
def test_the_shipped_example_program_traces_with_the_synthetic_resolver(tmp_path, device) -> None:
    planned, out = tmp_path / "planned.json", tmp_path / "trace.json"
    runner = CliRunner()
    made = runner.invoke(cli, ["plan", str(SHIPPED), "--budget", "300MiB", "-o", str(planned)])
    assert made.exit_code == 0, made.output
    args = ["trace", str(planned), "--resolver", "synthetic", "--steps", "2", "-o", str(out)]
    result = runner.invoke(cli, [*args, "--device", device])
    assert result.exit_code == 0, result.output
    document = json.loads(out.read_text())
    spans = [e for e in document["traceEvents"] if e.get("ph") == "X" and e["pid"] == 2]
    tasks = json.loads(planned.read_text())["tasks"]
    measured = {e["name"]: e["dur"] for e in spans if e["name"] in {t["id"] for t in tasks}}
    assert set(measured) == {t["id"] for t in tasks}
    # each synthetic task takes at least its declared cost (it waits for it)
    assert all(measured[t["id"]] >= 0.95 * t["cost_us"] for t in tasks)


def test_steps_after_the_first_get_fresh_inputs(tmp_path: Path) -> None:
    """The matmul chain keeps nothing between steps (no final location for h_0 or W_i): the
    command feeds them, so a second step runs."""
    source = tmp_path / "chain.json"
    source.write_text(chain.build_program(layers=3, dim=8, batch=4).to_json())
    planned = tmp_path / "planned.json"
    runner = CliRunner()
    made = runner.invoke(cli, ["plan", str(source), "--budget", "4KiB", "-o", str(planned)])
    assert made.exit_code == 0, made.output
    out = tmp_path / "trace.json"
    args = ["trace", str(planned), "--resolver", "matmul-chain", "--steps", "2", "-o", str(out)]
    result = runner.invoke(cli, args)
    assert result.exit_code == 0, result.output
    assert "measured" in result.output
