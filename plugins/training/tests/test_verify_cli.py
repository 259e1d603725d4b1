"""``dataflow verify`` on bad options: each is refused before any check runs, in one line
that names the option and what would work; ``--steps 1`` passes and shows its progress."""

from __future__ import annotations

import re

import pytest

from dataflow.cli import Failure
from dataflow.testing import FAILURE_EXIT, USAGE_EXIT, assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")

TINY = ("verify", "--family", "gpt2", "--preset", "gpt2_tiny")


@pytest.mark.parametrize(
    ("args", "culprits"),
    [
        (("verify", "--family", "nope", "--preset", "x"), ("--family", "known: ", "gpt2")),
        (("verify", "--family", "gpt2", "--preset", "nope"), ("--preset", "gpt2_tiny")),
        ((*TINY, "--steps", "0"), ("--steps",)),
        ((*TINY, "--rounds", "0"), ("--rounds",)),
        ((*TINY, "--batch", "0"), ("--batch",)),
        ((*TINY, "--seq-len", "0"), ("--seq-len",)),
        ((*TINY, "--seq-len", "100000"), ("--seq-len", "at most 128")),
        ((*TINY, "--budget", "0"), ("--budget",)),
        ((*TINY, "--budget", "much"), ("--budget", "not a size")),
        ((*TINY, "--dtype", "fp8"), ("--dtype", "fp32")),
        ((*TINY, "--device", "tpu"), ("--device", "cpu, cuda")),
        (("verify", "--preset", "gpt2_tiny"), ("--family",)),
    ],
)
def test_a_bad_option_is_a_usage_error(args, culprits) -> None:
    assert_one_line_error(invoke(*args), USAGE_EXIT, *culprits)


def test_cuda_on_a_machine_without_it_says_so() -> None:
    import torch

    wanted = f"cuda:{torch.cuda.device_count()}"  # one past the last device
    line = assert_one_line_error(invoke(*TINY, "--device", wanted), USAGE_EXIT, "--device")
    assert "use --device cpu" in line


def test_a_budget_below_the_smallest_is_refused_before_any_check() -> None:
    result = invoke(*TINY, "--budget", "1KiB")
    line = assert_one_line_error(result, FAILURE_EXIT, "--budget 1 KiB")
    assert re.search(r"the smallest budget that works is \d+ KiB \(\d+ bytes\)", line), line
    assert "op:" not in result.stderr  # no level started


def test_one_step_passes_and_reports_each_level() -> None:
    result = invoke(*TINY, "--steps", "1", "--rounds", "1", "--batch", "1", "--seq-len", "8")
    assert result.exit_code == 0, result.output
    for level in ("op", "task", "step"):
        assert f"{level}: " in result.stderr and " checks, " in result.stderr
    assert " passed, 0 failed" in result.stdout
    assert re.search(
        r"step 1 of 1: engine \d+\.\d s, reference \d+\.\d s; \d+ checks, 0 failed", result.stderr
    )


def test_the_table_lists_failures_and_each_levels_closest_check_unless_all() -> None:
    """By default the table holds each level's check nearest its tolerance (nothing
    failed here); ``--all`` lists every check, every step's gradients among them."""
    shape = ("--steps", "2", "--rounds", "1", "--batch", "1", "--seq-len", "8")
    short, full = invoke(*TINY, *shape), invoke(*TINY, *shape, "--all")
    assert short.exit_code == 0 and full.exit_code == 0, short.output + full.output
    rows = [line for line in short.stdout.splitlines() if line.startswith("│ ")]
    assert {row.split("│")[1].strip() for row in rows} >= {"op", "task", "step"}
    assert len(rows) <= 6  # three levels, a name wrapped onto a second line at most
    assert "closest to its tolerance" in short.stdout
    assert "grad emb.wte (step 1)" in full.stdout and "grad emb.wte (step 1)" not in short.stdout
    assert " passed, 0 failed" in short.stdout and " passed, 0 failed" in full.stdout


def test_json_writes_every_check(tmp_path) -> None:
    import json

    path = tmp_path / "checks.json"
    small = ("--steps", "1", "--rounds", "1", "--batch", "1", "--seq-len", "8", "--dtype", "bf16")
    result = invoke(*TINY, *small, "--json", str(path))
    assert result.exit_code == 0, result.output
    rows = json.loads(path.read_text())
    passed = int(re.search(r"(\d+) passed, 0 failed", result.stdout).group(1))
    assert len(rows) == passed and all(row["ok"] for row in rows)
    assert {row["level"] for row in rows} == {"op", "task", "step"}
    grads = [row for row in rows if row["name"].startswith("grad ")]
    assert grads and all(row["yardstick"] > 0 for row in grads)  # bf16: plain autograd's error
    assert all(row["effective_tolerance"] >= row["tolerance"] for row in rows)


def test_json_to_a_path_that_cannot_be_written_is_one_line(tmp_path) -> None:
    small = ("--steps", "1", "--rounds", "1", "--batch", "1", "--seq-len", "8")
    bad = tmp_path / "missing" / "checks.json"
    result = invoke(*TINY, *small, "--json", str(bad))
    assert_one_line_error(result, USAGE_EXIT, "--json", "missing")  # before any check ran


def test_levels_runs_only_those_named() -> None:
    small = ("--steps", "1", "--rounds", "1", "--batch", "1", "--seq-len", "8")
    result = invoke(*TINY, *small, "--levels", "step")
    assert result.exit_code == 0, result.output
    assert "step: " in result.stderr and "op: " not in result.stderr
    assert "task: " not in result.stderr


def test_a_step_level_the_host_cannot_hold_is_refused_before_any_check(monkeypatch) -> None:
    from dataflow_training.check.verify import step_host_bytes
    from dataflow_training.cli import verify_cli as run  # where the command looks it up

    from dataflow import families

    family = families().get("gpt2").load()
    need = step_host_bytes(family, family.config("gpt2_tiny"))
    monkeypatch.setattr(run, "available_host_bytes", lambda: need - 1)
    result = invoke(*TINY)
    assert_one_line_error(result, FAILURE_EXIT, "--preset gpt2_tiny", "--levels op,task")
    assert "op:" not in result.stderr
    monkeypatch.setattr(run, "available_host_bytes", lambda: need)
    small = ("--steps", "1", "--rounds", "1", "--batch", "1", "--seq-len", "8")
    assert invoke(*TINY, *small, "--levels", "step").exit_code == 0
    monkeypatch.setattr(run, "available_host_bytes", lambda: 1)
    assert invoke(*TINY, "--levels", "op").exit_code == 0  # no step level: no such need


def test_on_cuda_a_host_that_cannot_hold_the_float64_reference_is_refused(monkeypatch) -> None:
    """With the engine on CUDA the step level still keeps its float64 reference on the
    host: at least ``CUDA_STEP_BYTES_PER_PARAM`` a parameter (Qwen 3.5's dense cut was
    killed for memory after four minutes on a 128 GiB host, session 41). Refused up
    front, saying what it needs and what to run instead."""
    from dataflow_training.check.verify import (
        CUDA_STEP_BYTES_PER_PARAM,
        model_params,
        step_host_bytes,
    )
    from dataflow_training.cli import verify_cli as run

    from dataflow import families

    family = families().get("qwen3_5").load()
    config = family.config("qwen3_5_cut")
    need = step_host_bytes(family, config, "cuda")
    assert need == CUDA_STEP_BYTES_PER_PARAM * model_params(family, config) > 128 * 2**30
    assert need < step_host_bytes(family, config, "cpu")
    monkeypatch.setattr(run, "available_host_bytes", lambda: 128 * 2**30)
    with pytest.raises(Failure) as refused:
        run._check_host_memory(family, config, "qwen3_5_cut", "cuda")
    message = refused.value.format_message()
    assert "--preset qwen3_5_cut" in message and "float64 reference" in message
    assert "--levels op,task" in message and f"{model_params(family, config):,}" in message
    monkeypatch.setattr(run, "available_host_bytes", lambda: need)
    run._check_host_memory(family, config, "qwen3_5_cut", "cuda")  # enough: no error


def test_the_resolver_is_named_and_an_unknown_one_refused_before_any_check() -> None:
    small = ("--steps", "1", "--rounds", "1", "--batch", "1", "--seq-len", "8")
    result = invoke(*TINY, *small, "--levels", "step", "--resolver", "auto")
    assert result.exit_code == 0, result.output
    assert "tasks run by the torch resolver" in result.stderr  # auto on the CPU: eager
    result = invoke(*TINY, "--resolver", "jit")
    assert_one_line_error(result, FAILURE_EXIT, "--resolver 'jit'", "known: auto")
    assert "op:" not in result.stderr


@pytest.mark.parametrize("value", ["steps", "", "op,bogus"])
def test_an_unknown_level_is_a_usage_error(value) -> None:
    assert_one_line_error(
        invoke(*TINY, "--levels", value), USAGE_EXIT, "--levels", "op, task, step"
    )


def test_verify_refuses_unknown_levels() -> None:
    from dataflow_training.check.verify import verify

    with pytest.raises(ValueError, match="each is one of op, task, step"):
        verify("gpt2", "gpt2_tiny", levels=("steps",))
