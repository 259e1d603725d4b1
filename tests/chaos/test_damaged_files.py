"""Damaged run files (``drive.checkpoint``, ``drive.components``), damaged for real: each
kind of damage to the newest checkpoint (a flipped byte in the weights, a truncated
optimizer file, a missing file, a garbled, missing or wrong-step manifest) is skipped by
``--resume auto`` with a line saying which and why, and the run resumed from the
checkpoint before trains as an uninterrupted run does; ``--resume FOLDER`` of it is one
line naming the file; an export needs the weights alone; a folder of damaged checkpoints
alone is one line, never a fresh start; a torn last metrics line is dropped."""

from __future__ import annotations

import json
import shutil
from collections.abc import Callable
from pathlib import Path

import pytest

from dataflow.testing import assert_one_line_error, invoke

from ._runs import CONSTANT, digests, losses, straight_prefix, train_args

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")  # the embedded corpus

pytestmark = pytest.mark.chaos


def _flip_a_byte(path: Path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01
    path.write_bytes(bytes(data))


def _cut_in_half(path: Path) -> None:
    path.write_bytes(path.read_bytes()[: path.stat().st_size // 2])


def _garble(path: Path) -> None:
    path.write_text(path.read_text()[:40])


def _another_step(path: Path) -> None:
    path.write_text(json.dumps({**json.loads(path.read_text()), "step": 2}))


#: each kind of damage: (the file damaged, how, what the line says of it)
DAMAGES: dict[str, tuple[str, Callable[[Path], None], str]] = {
    "flipped-weights-byte": ("model.safetensors", _flip_a_byte, "is corrupt: its checksum"),
    "truncated-optimizer": ("optimizer.safetensors", _cut_in_half, "is corrupt: its checksum"),
    "missing-weights": ("model.safetensors", Path.unlink, "no model.safetensors"),
    "garbled-manifest": ("manifest.json", _garble, "is corrupt"),
    "missing-manifest": ("manifest.json", Path.unlink, "no manifest.json"),
    "wrong-step-manifest": ("manifest.json", _another_step, "says step 2; its folder is step 6"),
}


@pytest.fixture(scope="module")
def pristine(tmp_path_factory) -> Path:
    """Six steps with a checkpoint every two (steps 2, 4, 6), trained once; tests damage
    copies of it (``run``)."""
    out = tmp_path_factory.mktemp("pristine") / "run"
    assert invoke(*train_args(out, 6, *CONSTANT, "--checkpoint-every", "2")).exit_code == 0
    return out


@pytest.fixture
def run(pristine, tmp_path) -> Path:
    out = tmp_path / "run"
    shutil.copytree(pristine, out)
    return out


def _named(folder: Path, file: str, damage: Callable) -> str:
    """What names the damaged file: its path, or for a missing one its folder (the line
    says which file is missing)."""
    return str(folder) if damage is Path.unlink else str(folder / file)


@pytest.mark.parametrize("kind", DAMAGES)
def test_a_damaged_newest_checkpoint_is_skipped_named_and_the_resume_is_exact(run, kind):
    file, damage, said = DAMAGES[kind]
    newest = run / "step_000006"
    damage(newest / file)
    earlier = {name: digests(run / name) for name in ("step_000002", "step_000004")}
    asked = invoke(*train_args(run, 9, *CONSTANT, "--resume", str(newest)))
    assert_one_line_error(asked, 1, _named(newest, file, damage), said)
    resumed = invoke(*train_args(run, 8, *CONSTANT, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    [skipped] = [line for line in resumed.output.splitlines() if line.startswith("resume: skip")]
    assert skipped.startswith("resume: skipped step_000006: "), skipped
    assert _named(newest, file, damage) in skipped and said in skipped, skipped
    assert "step_000004 (step 4)" in resumed.output
    assert losses(run) == straight_prefix(8)
    assert {name: digests(run / name) for name in earlier} == earlier


def test_a_folder_whose_checkpoints_are_all_damaged_is_one_line_and_changes_nothing(run):
    for folder in run.glob("step_*"):
        _flip_a_byte(folder / "model.safetensors")
    before = digests(run)
    result = invoke(*train_args(run, 8, *CONSTANT, "--resume", "auto"))
    assert_one_line_error(result, 1, f"no intact checkpoint in {run}", "step_000006")
    assert digests(run) == before


def test_an_export_needs_the_weights_alone(run, tmp_path):
    pytest.importorskip("transformers")
    _flip_a_byte(run / "step_000006" / "optimizer.safetensors")
    result = invoke("export", "--hf", str(tmp_path / "hf"), "--from", str(run / "step_000006"))
    assert result.exit_code == 0, result.output
    assert (tmp_path / "hf" / "config.json").is_file()
    _flip_a_byte(run / "step_000006" / "model.safetensors")
    damaged = invoke("export", "--hf", str(tmp_path / "hf2"), "--from", str(run / "step_000006"))
    assert_one_line_error(damaged, 1, str(run / "step_000006" / "model.safetensors"))


def test_a_torn_last_metrics_line_is_dropped_and_the_run_resumes_exactly(run):
    """A kill while a metrics line is written leaves half a line: the resume drops it
    (and the lines past the checkpoint); a damaged line before the last one is an error
    naming the file and line."""
    metrics = run / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 7, "loss": 4.1')  # torn
    resumed = invoke(*train_args(run, 7, *CONSTANT, "--resume", "auto"))
    assert resumed.exit_code == 0, resumed.output
    assert losses(run) == straight_prefix(7)
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    before = digests(run)
    damaged = invoke(*train_args(run, 8, *CONSTANT, "--resume", "auto"))
    assert_one_line_error(damaged, 1, f"{metrics}: line 2 is not a step's metrics")
    assert digests(run) == before
