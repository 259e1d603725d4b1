"""Bad invocations of every subcommand: each exits non-zero (2 for a usage error, 1 for a
failure) with exactly one line on stderr that names the culprit, and no traceback."""

from __future__ import annotations

import json
from importlib import util
from pathlib import Path

import click
import pytest

from dataflow import builtins, hookimpl
from dataflow.registry import PlannerSpec
from dataflow.testing.chains import training_chain
from dataflow.testing.cli import FAILURE_EXIT, USAGE_EXIT, assert_one_line_error, invoke
from dataflow.testing.shapes import tiny_training

USAGE, FAILURE = USAGE_EXIT, FAILURE_EXIT
GOLDEN = Path(__file__).parents[1] / "sim" / "golden"
_invoke = invoke


@pytest.fixture
def files(tmp_path: Path) -> dict[str, Path]:
    """Programs and non-programs to point commands at."""
    paths = {
        "bare": tmp_path / "bare.json",
        "tiny": tmp_path / "tiny.json",
        "not_json": tmp_path / "not_json.json",
        "no_name": tmp_path / "no_name.json",
        "ghost": tmp_path / "ghost.json",
        "a_file": tmp_path / "a_file",
        "folder": tmp_path / "folder",
    }
    paths["bare"].write_text(training_chain(layers=2, rounds=1).to_json())
    paths["tiny"].write_text(tiny_training().to_json())
    paths["not_json"].write_text("not json at all")
    paths["no_name"].write_text('{"schema": "dataflow.program/v1", "objects": [], "tasks": []}')
    document = json.loads((GOLDEN / "overlap.json").read_text())["program"]
    document["tasks"][1]["inputs"].append("ghost")
    paths["ghost"].write_text(json.dumps(document))
    paths["a_file"].write_text("")
    paths["folder"].mkdir()
    return paths


# -- the command group -------------------------------------------------------------------
def test_an_unknown_command_is_a_usage_error() -> None:
    assert_one_line_error(_invoke("nope"), USAGE, "No such command 'nope'")


def test_an_unknown_option_is_a_usage_error(files) -> None:
    assert_one_line_error(_invoke("plan", files["tiny"], "--budgte", "1GiB"), USAGE, "--budgte")


# -- validate ----------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("name", "code", "culprit"),
    [
        ("missing", USAGE, "missing.json"),
        ("folder", USAGE, "folder"),
        ("not_json", FAILURE, "not JSON"),
        ("no_name", FAILURE, "$.name: required field missing"),
        ("ghost", FAILURE, "1 problem(s)"),
    ],
)
def test_validate(files, tmp_path, name: str, code: int, culprit: str) -> None:
    path = files.get(name, tmp_path / f"{name}.json")
    assert_one_line_error(_invoke("validate", path), code, culprit)


# -- simulate ----------------------------------------------------------------------------
def test_simulate_a_missing_file(tmp_path) -> None:
    assert_one_line_error(_invoke("simulate", tmp_path / "nope.json"), USAGE, "nope.json")


@pytest.mark.parametrize("option", ["--budget", "--slow-budget"])
@pytest.mark.parametrize("value", ["0", "lots", "-5MiB"])
def test_simulate_a_bad_budget(files, option: str, value: str) -> None:
    assert_one_line_error(_invoke("simulate", files["tiny"], option, value), USAGE, option)


def test_simulate_a_trace_into_a_file_as_folder(files) -> None:
    result = _invoke("simulate", files["tiny"], "--trace", files["a_file"] / "t.json")
    assert_one_line_error(result, USAGE, "--trace", "is a file")


def test_simulate_a_bare_program_says_to_plan_it(files) -> None:
    line = assert_one_line_error(_invoke("simulate", files["bare"]), FAILURE, "cannot run")
    assert "plan it first" in line and "dataflow plan" in line


def test_simulate_a_structurally_invalid_program(files) -> None:
    assert_one_line_error(_invoke("simulate", files["ghost"]), FAILURE, "ghost")


# -- plan --------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        ((), "--budget"),  # missing
        (("--budget", "0"), "--budget"),
        (("--budget", "4 gigs"), "not a size"),
        (("--budget", "1GiB", "--slow-budget", "0"), "--slow-budget"),
        (("--budget", "1GiB", "--planner", "nope"), "pressurefit"),
    ],
)
def test_plan_bad_options(files, args, culprit: str) -> None:
    assert_one_line_error(_invoke("plan", files["tiny"], *args), USAGE, culprit)


@pytest.mark.parametrize("option", ["-o", "--trace"])
def test_plan_checks_output_files_before_planning(files, option: str) -> None:
    into_file = _invoke("plan", files["tiny"], "--budget", "1GiB", option, files["a_file"] / "x")
    assert_one_line_error(into_file, USAGE, option, "is a file")
    folder = _invoke("plan", files["tiny"], "--budget", "1GiB", option, files["folder"])
    assert_one_line_error(folder, USAGE, option, "is a folder")


def test_plan_makes_a_missing_output_folder(files, tmp_path) -> None:
    out = tmp_path / "new" / "deeper" / "planned.json"
    result = _invoke("plan", files["tiny"], "--budget", "1GiB", "-o", out)
    assert result.exit_code == 0, result.output
    assert out.exists()


def test_plan_an_infeasible_budget_names_the_one_that_works(files) -> None:
    result = _invoke("plan", files["tiny"], "--budget", "10MiB")
    assert_one_line_error(result, FAILURE, "10 MiB", "the smallest budget that works is")


def test_plan_a_planner_plugin_failure_names_the_planner(files, isolated_plugin_manager) -> None:
    class Boom:
        @hookimpl
        def dataflow_planners(self):
            def plan(program, budget_bytes, **options):
                raise ZeroDivisionError("the planner divided by zero")

            return [PlannerSpec("boom", plan)]

    isolated_plugin_manager(builtins, Boom())
    result = _invoke("plan", files["tiny"], "--budget", "1GiB", "--planner", "boom")
    assert_one_line_error(result, FAILURE, "planner 'boom' failed", "ZeroDivisionError")


def test_plan_a_place_failure_is_one_line(files) -> None:
    result = _invoke("plan", files["ghost"], "--budget", "1GiB", "--place")
    assert_one_line_error(result, FAILURE, "ghost")


# -- trace -------------------------------------------------------------------------------
needs_torch = pytest.mark.skipif(util.find_spec("torch") is None, reason="needs torch")


@pytest.mark.parametrize(
    ("args", "culprit"),
    [
        (("--resolver", "nope"), "--resolver"),
        (("--resolver", "synthetic", "--steps", "0"), "--steps"),
        (("--resolver", "synthetic", "--budget", "0"), "--budget"),
        (("--resolver", "synthetic", "--device", "tpu"), "--device"),
        ((), "--resolver"),  # missing
    ],
)
def test_trace_bad_options(files, args, culprit: str) -> None:
    assert_one_line_error(_invoke("trace", files["tiny"], *args), USAGE, culprit)


@needs_torch
def test_trace_on_a_device_that_is_not_here(files) -> None:
    import torch

    wanted = f"cuda:{torch.cuda.device_count()}"  # one past the last (cuda:0 without CUDA)
    result = _invoke("trace", files["tiny"], "--resolver", "synthetic", "--device", wanted)
    assert_one_line_error(result, USAGE, "--device", "use --device cpu")


def test_trace_a_bare_program_says_to_plan_it(files) -> None:
    result = _invoke("trace", files["bare"], "--resolver", "synthetic")
    assert_one_line_error(result, FAILURE, "cannot run", "plan it first")


def test_trace_into_a_folder(files) -> None:
    result = _invoke("trace", files["tiny"], "--resolver", "synthetic", "-o", files["folder"])
    assert_one_line_error(result, USAGE, "-o", "is a folder")


@needs_torch
def test_trace_a_resolver_that_does_not_know_the_keys(files, tmp_path) -> None:
    pytest.importorskip("dataflow_resolver_matmul_chain")
    planned = tmp_path / "planned.json"
    assert _invoke("plan", files["tiny"], "--budget", "1GiB", "-o", planned).exit_code == 0
    result = _invoke("trace", planned, "--resolver", "matmul-chain", "-o", tmp_path / "t.json")
    assert_one_line_error(result, FAILURE, "matmul-chain", "--resolver synthetic")


# -- kernels, plugins --------------------------------------------------------------------
def test_kernels_list_an_unknown_op() -> None:
    assert_one_line_error(_invoke("kernels", "list", "--op", "nope"), USAGE, "--op", "'nope'")


def test_kernels_list_an_unknown_device() -> None:
    pytest.importorskip("dataflow_kernels_torch")
    result = _invoke("kernels", "list", "--device", "tpu")
    assert_one_line_error(result, USAGE, "--device", "cpu")


def test_plugins_list_an_unknown_hook() -> None:
    result = _invoke("plugins", "list", "--hook", "nope")
    assert_one_line_error(result, USAGE, "--hook", "dataflow_planners")


# -- a plugin command's own errors go through the same path ------------------------------
@click.command("boom")
@click.option("--how", default="bug")
def boom(how: str) -> None:
    """Fails as asked."""
    if how == "bug":
        raise TypeError("an operand of the wrong type")
    raise ValueError("the value 7 is not allowed here")


class Boom:
    @hookimpl
    def dataflow_cli_commands(self):
        return [boom]


def test_a_library_error_in_a_plugin_command_is_one_line(isolated_plugin_manager) -> None:
    isolated_plugin_manager(builtins, Boom())
    assert_one_line_error(_invoke("boom", "--how", "value"), FAILURE, "the value 7")


def test_a_bug_says_internal_error_and_how_to_see_the_traceback(isolated_plugin_manager) -> None:
    isolated_plugin_manager(builtins, Boom())
    line = assert_one_line_error(_invoke("boom"), FAILURE, "internal error: TypeError")
    assert "--debug" in line


@pytest.mark.parametrize("where", ["first", "last"])
def test_debug_prints_the_traceback_above_the_line(isolated_plugin_manager, where) -> None:
    isolated_plugin_manager(builtins, Boom())
    args = ["--debug", "boom"] if where == "first" else ["boom", "--debug"]
    result = _invoke(*args)
    assert result.exit_code == FAILURE
    assert "Traceback" in result.stderr and "TypeError: an operand" in result.stderr
    assert result.stderr.splitlines()[-1].startswith("error: internal error: TypeError")


def test_debug_from_the_environment(isolated_plugin_manager, monkeypatch) -> None:
    isolated_plugin_manager(builtins, Boom())
    monkeypatch.setenv("DATAFLOW_DEBUG", "1")
    assert "Traceback" in _invoke("boom").stderr


def test_dataflow_alone_prints_its_help() -> None:
    result = _invoke()
    assert result.exit_code == 0 and "Commands:" in result.stdout and "plan" in result.stdout
