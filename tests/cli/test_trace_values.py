"""``dataflow trace --value/--values``: the per-run values reach ``ctx.values``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from click.testing import CliRunner

from dataflow import ResolverSpec, hookimpl
from dataflow.cli.main import cli
from dataflow.cli.options import parse_value
from dataflow.planning import plan

chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")
matmul_resolver = pytest.importorskip("dataflow_resolver_matmul_chain.resolver")


class _Recording:
    """The chain's loss gradient, scaled by ``ctx.values["scale"]``; records what it saw."""

    seen: list[dict] = []

    def launch(self, ctx) -> None:
        _Recording.seen.append(dict(ctx.values))
        (h,) = ctx.inputs
        (g,) = ctx.outputs
        g.copy_(h).mul_(ctx.values["scale"])


class _Plugin:
    @hookimpl
    def dataflow_resolvers(self):
        def build(program):
            inner = matmul_resolver.build(program)
            return lambda task: (
                _Recording() if task.compute_key == "half_square_grad" else inner(task)
            )

        return [ResolverSpec("scaled-chain", build)]


@pytest.fixture
def planned(tmp_path: Path, isolated_plugin_manager) -> Path:
    isolated_plugin_manager(_Plugin())
    _Recording.seen.clear()
    out = tmp_path / "planned.json"
    out.write_text(plan(chain.build_program(layers=2, dim=8, batch=4), 1 << 20).program.to_json())
    return out


def _trace(planned: Path, *args: str):
    out = planned.parent / "trace.json"
    return CliRunner().invoke(
        cli, ["trace", str(planned), "--resolver", "scaled-chain", "-o", str(out), *args]
    )


def test_values_reach_the_tasks_typed(planned: Path, tmp_path: Path) -> None:
    values = tmp_path / "values.json"
    values.write_text(json.dumps({"scale": 2.0, "kl": 0.1, "tag": "from-file"}))
    result = _trace(
        planned, "--values", str(values), "--value", "scale=0.5", "--value", "flag=true",
        "--value", "tag=ppo", "--steps", "2",
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    expected = {"scale": 0.5, "kl": 0.1, "flag": True, "tag": "ppo"}
    assert _Recording.seen == [expected | {"step": 0}, expected | {"step": 1}]


def test_a_value_not_given_fails_in_one_line_naming_it_and_the_task(planned: Path) -> None:
    result = _trace(planned, "--value", "lr=1e-3")
    assert result.exit_code == 1
    lines = result.output.strip().splitlines()
    assert len(lines) == 1, result.output
    assert "task 'loss' reads the per-run value 'scale'" in lines[0]
    assert "given: lr, step" in lines[0] and "Traceback" not in result.output


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (["--value", "lr"], "'lr' is not NAME=VALUE"),
        (["--value", "step=3"], "'step' is set by the engine"),
        (["--values", "missing.json"], "cannot read missing.json"),
    ],
)
def test_bad_values_are_usage_errors(planned: Path, args, message) -> None:
    result = _trace(planned, *args)
    assert result.exit_code == 2 and message in result.output, result.output


def test_a_values_file_of_nested_values_is_refused(planned: Path, tmp_path: Path) -> None:
    bad = tmp_path / "bad.json"
    bad.write_text(json.dumps({"lr": [1, 2]}))
    result = _trace(planned, "--values", str(bad))
    assert result.exit_code == 2 and "value 'lr' is a list" in result.output


def test_parse_value_types() -> None:
    assert parse_value("3") == 3 and isinstance(parse_value("3"), int)
    assert parse_value("1e-3") == 1e-3
    assert parse_value("TRUE") is True and parse_value("false") is False
    assert parse_value("adam") == "adam"
