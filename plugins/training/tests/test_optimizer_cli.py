"""``dataflow train --optimizer NAME --optimizer-arg K=V`` on gpt2_tiny on the CPU: the
plan line names the optimizer, the manifest records it with its typed arguments, a resume
takes both from the run and, its checkpoint holding every state field, repeats the
uninterrupted run's losses bit for bit; bad names and values are one line each."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train", "--preset", "gpt2_tiny", "--steps", str(steps), "--batch", "2",
        "--seq-len", "16", "--device", "cpu", "--lr", "3e-3", "--schedule", "constant",
        "--checkpoint-every", "2", "--out", str(out), *extra,
    ]  # fmt: skip


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def test_muon_resumes_with_its_arguments_and_state(tmp_path) -> None:
    out, straight = tmp_path / "run", tmp_path / "straight"
    chosen = ("--optimizer", "muon", "--optimizer-arg", "ns_steps=4", "--optimizer-arg",
              "nesterov=false")  # fmt: skip
    first = invoke(*_args(out, 2, *chosen))
    assert first.exit_code == 0, first.output
    plan = next(line for line in first.output.splitlines() if line.startswith("plan: "))
    assert "precision fp32 (fp32 weights/grads/activations, fp32 muon state)" in plan
    manifest = json.loads((out / "step_000002" / "manifest.json").read_text())
    assert manifest["options"]["optimizer"] == "muon"
    assert manifest["options"]["optimizer_args"] == {"ns_steps": 4, "nesterov": False}
    assert manifest["train"]["optimizer"]["state_dtypes"] == {
        "momentum": "float32",
        "exp_avg_sq": "float32",
    }
    resumed = invoke(*_args(out, 4, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    said = resumed.output.splitlines()[0]
    assert "optimizer muon, optimizer_args {" in said
    assert "'ns_steps': 4" in said and "'nesterov': False" in said
    assert invoke(*_args(straight, 4, *chosen)).exit_code == 0
    assert _losses(out) == _losses(straight)
    other = invoke(*_args(out, 5, "--resume", "auto", "--optimizer", "lion"))
    assert_one_line_error(other, 1, "step_000004: train.optimizer.")  # the fields that differ
    assert "train.optimizer.name" in other.output
    plain = invoke(*_args(tmp_path / "adamw", 4))  # another optimizer: other losses
    assert plain.exit_code == 0 and _losses(tmp_path / "adamw")[2:] != _losses(straight)[2:]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--optimizer", "sgdx"), "--optimizer: unknown optimizer 'sgdx'; known: adafactor, "
         "adamw, adamw_compensated, adamw_int8, lion, muon"),
        (("--optimizer", "lion", "--optimizer-arg", "gamma=1"),
         "optimizer 'lion' has no argument 'gamma'; known: beta1, beta2"),
        (("--optimizer", "muon", "--optimizer-arg", "ns_steps=many"),
         "ns_steps='many': ns_steps takes a whole number"),
        (("--optimizer-arg", "beta2"), "'beta2' is not NAME=VALUE"),
        (("--optimizer", "lion", "--precision", "bf16"),
         "--optimizer lion has no compensated update, which --precision bf16 needs"),
    ],
)  # fmt: skip
def test_a_bad_optimizer_option_is_one_line(tmp_path, extra, message) -> None:
    assert_one_line_error(invoke(*_args(tmp_path / "run", 2, *extra)), 2, message)
    assert not (tmp_path / "run").exists()
