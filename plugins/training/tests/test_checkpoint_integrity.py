"""Verified checkpoints (``drive.checkpoint``): a damaged newest checkpoint is skipped by
``--resume auto`` with a line saying why, and named when asked for by folder; an export
needs the weights alone. The damage is real: a flipped byte, a garbled manifest, a
manifest of another step, a damaged optimizer file."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")  # the embedded corpus

CONSTANT = ("--schedule", "constant")  # the same lr whatever --steps says


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train", "--preset", "gpt2_tiny", "--steps", str(steps), "--batch", "4", "--seq-len",
        "32", "--device", "cpu", "--lr", "3e-3", *CONSTANT, "--out", str(out), *extra,
    ]  # fmt: skip


def _losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["loss"]) for m in map(json.loads, lines)]


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def run(tmp_path) -> Path:
    """Six steps with a checkpoint every two (steps 2, 4, 6)."""
    out = tmp_path / "run"
    assert invoke(*_args(out, 6, "--checkpoint-every", "2")).exit_code == 0
    return out


def test_a_flipped_byte_in_the_newest_checkpoint_falls_back_to_the_one_before(run, tmp_path):
    damaged = run / "step_000006" / "model.safetensors"
    _flip_a_byte(damaged)
    asked = invoke(*_args(run, 9, "--resume", str(run / "step_000006")))
    assert_one_line_error(asked, 1, str(damaged), "corrupt")
    resumed = invoke(*_args(run, 8, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert f"resume: skipped step_000006: checkpoint file {damaged} is corrupt" in resumed.output
    assert "step_000004 (step 4)" in resumed.output
    straight = tmp_path / "straight"
    assert invoke(*_args(straight, 8)).exit_code == 0
    assert _losses(run) == _losses(straight)


def test_a_garbled_manifest_is_skipped_and_named(run):
    manifest = run / "step_000006" / "manifest.json"
    manifest.write_text(manifest.read_text()[:40])
    asked = invoke("train", "--out", str(run), "--resume", str(manifest.parent), "--steps", "9")
    assert_one_line_error(asked, 1, str(manifest), "corrupt")
    resumed = invoke(*_args(run, 7, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert f"resume: skipped step_000006: checkpoint file {manifest} is corrupt" in resumed.output
    assert "step_000004 (step 4)" in resumed.output


def test_a_manifest_of_another_step_is_not_taken_for_its_folder(run):
    manifest = run / "step_000006" / "manifest.json"
    body = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**body, "step": 2}))
    resumed = invoke(*_args(run, 7, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert "says step 2; its folder is step 6" in resumed.output
    assert "step_000004 (step 4)" in resumed.output
    assert sorted(p.name for p in run.glob("step_*"))[:2] == ["step_000002", "step_000004"]


def test_an_export_needs_the_weights_alone(run, tmp_path):
    pytest.importorskip("transformers")
    _flip_a_byte(run / "step_000006" / "optimizer.safetensors")
    result = invoke("export", "--hf", str(tmp_path / "hf"), "--from", str(run / "step_000006"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "config.json").is_file()
    _flip_a_byte(run / "step_000006" / "model.safetensors")
    damaged = invoke("export", "--hf", str(tmp_path / "hf2"), "--from", str(run / "step_000006"))
    assert_one_line_error(damaged, 1, str(run / "step_000006" / "model.safetensors"))


@pytest.fixture
def small_disk(tmp_path):
    """A 4 MiB tmpfs (two of gpt2_tiny's 1.5 MB checkpoints fit, a third does not), where
    the machine lets this process mount one (root, as on CI); else the test skips."""
    import subprocess

    mount = tmp_path / "small"
    mount.mkdir()
    made = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=4m", "tmpfs", str(mount)], capture_output=True
    )
    if made.returncode != 0:
        pytest.skip(f"cannot mount a small tmpfs here: {made.stderr.decode().strip()}")
    yield mount
    subprocess.run(["umount", str(mount)], check=False)


def test_a_full_disk_is_one_line_and_keeps_the_earlier_checkpoints(small_disk, tmp_path):
    """A checkpoint write that runs out of space: one line naming the checkpoint and the
    cause, exit 1, nothing of that write left behind, the earlier checkpoints intact; once
    there is space again the run resumes from the newest and trains as one that never
    ran out does."""
    out = small_disk / "run"
    result = invoke(*_args(out, 5, "--checkpoint-every", "1"))
    line = assert_one_line_error(result, 1, f"cannot write checkpoint {out / 'step_000003'}")
    assert "no space left on the device (ENOSPC)" in line
    assert "the earlier checkpoints are intact" in line
    assert sorted(p.name for p in out.iterdir()) == [
        "metrics.jsonl",
        "step_000001",
        "step_000002",
    ]  # no .tmp-* folder, no lock file
    import shutil

    shutil.rmtree(out / "step_000001")  # space again
    resumed = invoke(*_args(out, 3, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert "step_000002 (step 2)" in resumed.output
    straight = tmp_path / "straight"
    assert invoke(*_args(straight, 3)).exit_code == 0
    assert _losses(out) == _losses(straight)
