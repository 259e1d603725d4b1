"""Pricing any program by measurement (``dataflow.engine.measure``) and ``dataflow plan
--measured``: the example matmul chain, priced on this CPU, predicts its traced step."""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from click.testing import CliRunner

from dataflow import Engine, minimal_budget, plan
from dataflow.cli.main import cli
from dataflow.engine import MissingValueError, ResolverError
from dataflow.engine.measure import measure_tasks, priced_by_measurement, signature

chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")
matmul = pytest.importorskip("dataflow_resolver_matmul_chain.resolver")


def test_tasks_of_one_signature_are_timed_once_and_share_the_cost() -> None:
    program = chain.build_program(layers=3, dim=32, batch=16)
    costs = measure_tasks(program, matmul.build(program), repeats=3)
    assert set(costs) == {task.id for task in program.tasks}
    assert costs["fwd_0"] == costs["fwd_1"] == costs["fwd_2"] > 0
    assert costs["bwd_0"] == costs["bwd_2"] and costs["loss"] > 0
    keys = {signature(program, task) for task in program.tasks}
    assert len(keys) == 3  # forward, loss, backward


def test_an_unknown_key_and_a_missing_value_are_named() -> None:
    program = chain.build_program(layers=1, dim=8, batch=4)
    with pytest.raises(ResolverError, match="task 'fwd_0'.*'tanh_matmul'"):
        measure_tasks(program, lambda task: {}[task.compute_key], resolver_name="empty")

    class ReadsLr:
        def launch(self, ctx) -> None:
            ctx.outputs[0].fill_(ctx.values["lr"])

    with pytest.raises(MissingValueError, match="task 'fwd_0' reads the per-run value 'lr'"):
        measure_tasks(program, lambda task: ReadsLr())
    costs = measure_tasks(program, lambda task: ReadsLr(), values={"lr": 0.5}, repeats=1)
    assert set(costs) == {"fwd_0", "loss", "bwd_0"}


def _measured_over_predicted(program) -> tuple[float, float, float]:
    """Price ``program`` on this CPU, plan it streaming its weights, run it: the ratio of
    the measured step (median of 5) to the predicted one, and the two."""
    priced = priced_by_measurement(program, matmul.build(program))
    assert priced.links != program.links  # measured, not the program's assumed links
    budget = minimal_budget(priced)  # the weights streamed in, the gradients out
    planned = plan(priced, budget)
    values = chain.initial_values(program)
    with Engine("torch", budget_bytes=budget, device="cpu") as engine:
        engine.load(planned, matmul.build(planned.program), initial=values)
        engine.predicted = planned.sim
        result = engine.run(steps=5, feed=lambda step: values)
    return result.measured_over_predicted, result.makespan_us, planned.sim.makespan_us


@pytest.mark.alone  # nox -s tests runs it with no other test worker beside it
def test_the_measured_prediction_is_within_2x_of_the_measured_step() -> None:
    program = chain.build_program(layers=4, dim=256, batch=512)
    # On a quiet machine the ratio is 1.0-1.5; the CPUs here are shared with other
    # processes, whose bursts slow the engine's step (a sum of tasks) more than the
    # medians of the measuring pass (CI's second test worker beside it: 2.81x, and with
    # one intra-op thread 2.19x three tries running; hence ``alone``). One intra-op
    # thread keeps the matmuls on one core, and a burst is given two more tries.
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        for _ in range(3):
            found = _measured_over_predicted(program)
            if 0.5 <= found[0] <= 2.0:
                break
    finally:
        torch.set_num_threads(threads)
    assert 0.5 <= found[0] <= 2.0, found
    # the assumed flop rate's prediction is another (the reason to measure)
    budget = minimal_budget(program)
    assert plan(program, budget).sim.makespan_us != found[2]


def test_plan_measured_prints_the_predicted_step(tmp_path: Path) -> None:
    path, out = tmp_path / "chain.json", tmp_path / "planned.json"
    path.write_text(chain.build_program(layers=2, dim=64, batch=64).to_json())
    args = ["plan", str(path), "--budget", "1MiB", "--measured", "--resolver", "matmul-chain"]
    result = CliRunner().invoke(cli, [*args, "-o", str(out)])
    assert result.exit_code == 0, result.output
    assert "measured 3 distinct task(s) of 5 on cpu through 'matmul-chain'" in result.output
    step = re.search(r"predicted step ([\d.,]+) (us|ms) on cpu", result.output)
    assert step is not None, result.output
    traced = CliRunner().invoke(
        cli, ["trace", str(out), "--resolver", "matmul-chain", "-o", str(tmp_path / "t.json")]
    )
    assert traced.exit_code == 0, traced.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--measured"], "--measured needs --resolver NAME"),
        (["--resolver", "matmul-chain"], "--resolver prices the tasks only with --measured"),
        (["--measured", "--resolver", "nope"], "no resolver named 'nope'"),
        (["--value", "lr=1e-3"], "--value and --values are read only with --measured"),
    ],
)
def test_plan_measured_bad_options(tmp_path: Path, args, message) -> None:
    path = tmp_path / "chain.json"
    path.write_text(chain.build_program(layers=1, dim=8, batch=4).to_json())
    result = CliRunner().invoke(cli, ["plan", str(path), "--budget", "1MiB", *args])
    assert result.exit_code == 2 and message in result.output, result.output
