"""``--precision``: the policies (``step.precision``) and ``dataflow train`` with each on
gpt2_tiny on the CPU: the plan line names the policy and its bytes per parameter, the
checkpoint holds the policy's state fields (the compensation of ``bf16`` and ``mixed``,
moved off zero by the updates), a resume takes the policy from the run (and, for those
two, repeats the uninterrupted run's losses bit for bit), and a run of the older ``--dtype`` /
``--optimizer-states`` options resumes as it was."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
import torch
from dataflow_training.step.precision import NAMES, pinned, precision

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")

#: policy -> (bytes per parameter, optimizer, state dtypes, weight dtype)
POLICIES = {
    "bf16": (10, "adamw_compensated", ("bfloat16",) * 3, torch.bfloat16),
    "bf16-plain": (8, "adamw", ("bfloat16",) * 2, torch.bfloat16),
    "mixed": (16, "adamw_compensated", ("float32",) * 3, torch.bfloat16),
    "fp32": (16, "adamw", ("float32",) * 2, torch.float32),
}


def test_auto_is_bf16_on_cuda_and_fp32_elsewhere() -> None:
    assert precision("auto", device="cuda").name == "bf16"
    assert precision("auto", device="cuda:1").name == "bf16"
    assert precision("auto", device="cpu").name == "fp32"
    for name, (per_param, optimizer, states, _) in POLICIES.items():
        policy = precision(name)
        assert policy.bytes_per_param == per_param
        assert (policy.optimizer, tuple(policy.state_dtypes.values())) == (optimizer, states)


def test_the_older_options_are_pins_and_a_conflict_is_named() -> None:
    assert precision("auto", device="cuda", dtype="fp32").name == "fp32"
    assert precision("auto", dtype="bf16").name == "bf16-plain"  # moments follow --dtype
    legacy = precision("auto", dtype="bf16", states="fp32")
    assert legacy == pinned("bf16", "fp32") and legacy.optimizer == "adamw"
    assert legacy.bytes_per_param == 12
    assert precision("mixed", dtype="bf16", states="fp32").name == "mixed"  # agreeing pins
    with pytest.raises(ValueError, match="--dtype fp32 conflicts with --precision bf16"):
        precision("bf16", dtype="fp32")
    with pytest.raises(ValueError, match="--optimizer-states fp32 conflicts with --precision"):
        precision("bf16-plain", states="fp32")


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train", "--preset", "gpt2_tiny", "--steps", str(steps), "--batch", "2",
        "--seq-len", "16", "--device", "cpu", "--lr", "3e-3", "--schedule", "constant",
        "--checkpoint-every", "2",
        "--out", str(out), *extra,
    ]  # fmt: skip


def _losses(out: Path) -> list[float]:
    return [json.loads(x)["loss"] for x in (out / "metrics.jsonl").read_text().splitlines()]


def _plan(output: str) -> str:
    return next(line for line in output.splitlines() if line.startswith("plan: "))


def _fields(checkpoint: Path) -> tuple[dict, dict[str, torch.Tensor], dict]:
    """``(weights, {"<layer>.<param>/<field>": tensor}, manifest)`` of a checkpoint: its
    optimizer state read through the layout of the step its manifest records."""
    from dataflow_training.drive.checkpoint import read_checkpoint, train_from_dict
    from dataflow_training.step.family import load_family
    from dataflow_training.step.lowering import lower

    weights, opt, manifest, _ = read_checkpoint(checkpoint)
    train = train_from_dict(manifest["train"])
    layout = lower(load_family("gpt2"), "gpt2_tiny", train, overrides=manifest["overrides"]).layout
    fields = {}
    for obj_id, raw in opt.items():
        packed = layout.packed[obj_id]
        for name, view in packed.layout.views(raw).items():
            fields[f"{packed.layer}.{name}"] = view
    return weights, fields, manifest


@pytest.mark.parametrize("name", NAMES)
def test_a_run_of_each_policy_checkpoints_its_state_and_resumes(tmp_path, name) -> None:
    per_param, optimizer, states, weight_dtype = POLICIES[name]
    out, straight = tmp_path / "run", tmp_path / "straight"
    first = invoke(*_args(out, 2, "--precision", name))
    assert first.exit_code == 0, first.output
    assert f"precision {name} (" in _plan(first.output)
    assert f"; {per_param} B/param)" in _plan(first.output)

    weights, fields, manifest = _fields(out / "step_000002")
    assert manifest["options"]["precision"] == name
    assert manifest["train"]["optimizer"]["name"] == optimizer
    assert tuple(manifest["train"]["optimizer"]["state_dtypes"].values()) == states
    assert {w.dtype for w in weights.values()} == {weight_dtype}
    compensations = {k: v for k, v in fields.items() if k.endswith("/compensation")}
    if optimizer == "adamw_compensated":
        assert len(compensations) == sum(1 for k in fields if k.endswith("/exp_avg"))
        assert {v.dtype for v in compensations.values()} == {getattr(torch, states[2])}
        assert any(bool(v.any()) for v in compensations.values())  # the updates left some
    else:
        assert not compensations

    resumed = invoke(*_args(out, 3, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert f"precision {name} (" in _plan(resumed.output)
    if optimizer == "adamw_compensated":  # the new state restored: the same bits as a run on
        assert invoke(*_args(straight, 3, "--precision", name)).exit_code == 0
        assert _losses(out) == _losses(straight)


def test_a_run_of_the_older_options_resumes_with_them(tmp_path) -> None:
    """A run with ``--dtype bf16 --optimizer-states fp32`` (bf16 weights, float32 moments,
    a plain update: what the throughput rows used before ``--precision``), its manifest's
    options written as they were then (no ``precision``), resumes with that policy."""
    out = tmp_path / "run"
    first = invoke(*_args(out, 2, "--dtype", "bf16", "--optimizer-states", "fp32"))
    assert first.exit_code == 0, first.output
    assert "precision bf16 weights, fp32 moments (" in _plan(first.output)
    manifest_file = out / "step_000002" / "manifest.json"
    manifest = json.loads(manifest_file.read_text())
    del manifest["options"]["precision"]  # a manifest of a run before --precision
    manifest_file.write_text(json.dumps(manifest))
    resumed = invoke(*_args(out, 3, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert "dtype bf16, optimizer_states fp32" in resumed.output.splitlines()[0]
    assert "precision bf16 weights, fp32 moments (" in _plan(resumed.output)
    assert len(_losses(out)) == 3
    # asking for a policy the checkpoint does not hold: one line naming the field
    other = invoke(*_args(out, 4, "--resume", "auto", "--precision", "mixed"))
    assert_one_line_error(other, 1, "train.optimizer.name is 'adamw'")


def test_precision_and_a_conflicting_pin_are_one_line(tmp_path) -> None:
    result = invoke(*_args(tmp_path / "run", 1, "--precision", "bf16", "--dtype", "fp32"))
    assert_one_line_error(result, 2, "--dtype fp32 conflicts with --precision bf16")
    assert not (tmp_path / "run").exists()


def test_verify_runs_a_policy_s_update_against_the_float64_reference() -> None:
    """``dataflow verify --precision mixed``: the step level runs the compensated update
    with float32 state (bf16 weights) and every check passes; a ``--dtype`` that is not
    the policy's is one line."""
    args = ["verify", "--family", "gpt2", "--preset", "gpt2_tiny", "--levels", "step"]
    result = invoke(*args, "--precision", "mixed", "--steps", "2")
    assert result.exit_code == 0, result.output
    assert re.search(r"^\d+ passed, 0 failed$", result.output, re.M)
    refused = invoke(*args, "--precision", "mixed", "--dtype", "fp32")
    assert_one_line_error(refused, 2, "--dtype fp32 conflicts with --precision mixed")


def test_predict_prices_each_policy_s_state(tmp_path) -> None:
    """``dataflow predict --precision``: the row names the policy, and the state it adds
    moves more bytes in a budget that offloads it (gpt2_124m at 1 GiB)."""
    moved = {}
    for name in NAMES:
        out = tmp_path / f"{name}.json"
        result = invoke(
            "predict", "--preset", "gpt2_124m", "--t-round", "4096", "--tokens-step", "8192",
            "--budget", "1", "--seq-len", "1024", "--jobs", "1", "--precision", name,
            "--json", str(out),
        )  # fmt: skip
        assert result.exit_code == 0, result.output
        (row,) = json.loads(out.read_text())["rows"]
        assert row["precision"] == name and row["feasible"]
        moved[name] = row["h2d_gb"] + row["d2h_gb"]
    assert moved["bf16-plain"] < moved["bf16"] < moved["mixed"]
