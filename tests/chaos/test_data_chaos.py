"""Chaos for the data a run trains on: a ``dataflow data prepare`` killed with SIGKILL
half-way, and a run resumed from another working directory than it started in.

- A killed prepare leaves nothing at its target, only the folder it was writing beside
  it; training on either is refused in one line that says what to run; ``--resume``
  finishes it, keeping the shards already written (the same files, not rewritten), and the
  dataset is byte for byte an uninterrupted prepare's.
- A run given its data as a relative path keeps the absolute path in its checkpoints, so
  ``--resume auto`` from anywhere else trains on, loss for loss as the uninterrupted run.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataflow.testing import FAILURE_EXIT, assert_one_line_error, invoke

pytest.importorskip("dataflow_feed_shards")

#: How long the killed prepare may take to write its first shards (it writes ~20 a second
#: here, fsyncing each) and how many it must have written when the kill comes.
SHARDS_TIMEOUT_S, KILL_AFTER_SHARDS = 60, 4
SHARD_TOKENS = 20_000
TRAIN = ("train", "--preset", "gpt2_tiny", "--device", "cpu", "--batch", 2, "--seq-len", 32)


def _corpus(folder: Path, files: int, size_bytes: int) -> Path:
    """``files`` text files of ``size_bytes`` random letters each."""
    folder.mkdir()
    draw = random.Random(0)
    for index in range(files):
        text = "".join(draw.choices("abcdefgh \n", k=size_bytes))
        (folder / f"part_{index:03d}.txt").write_text(text)
    return folder


def _written_shards(folder: Path) -> int:
    """Shards the ``prepared.json`` of a prepare in progress records (0: none yet)."""
    try:
        return len(json.loads((folder / "prepared.json").read_text())["shards"])
    except (OSError, ValueError, KeyError):
        return 0


def _kill_mid_way(text: Path, out: Path) -> Path:
    """Start ``dataflow data prepare`` of ``text`` into ``out``, SIGKILL it once it has
    written a few shards; returns the folder it was writing."""
    command = [str(Path(sys.executable).parent / "dataflow"), "data", "prepare"]
    command += ["--text", str(text), "-o", str(out), "--shard-tokens", str(SHARD_TOKENS)]
    # at the lowest priority: on a loaded machine the prepare (a second or two of work)
    # could otherwise finish between two looks of this loop, which then has nothing to kill
    # (set from here while it still starts up: no code between fork and exec)
    proc = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE)
    os.setpriority(os.PRIO_PROCESS, proc.pid, 19)
    deadline = time.monotonic() + SHARDS_TIMEOUT_S
    try:
        while True:
            writing = list(out.parent.glob(f".{out.name}.prepare-{proc.pid}"))
            if writing and _written_shards(writing[0]) >= KILL_AFTER_SHARDS:
                break
            assert proc.poll() is None, f"prepare ended before the kill: {proc.stderr.read()}"
            assert time.monotonic() < deadline, "prepare wrote no shards in time"
            time.sleep(0.01)
        proc.send_signal(signal.SIGKILL)
    finally:
        proc.kill()
        proc.wait()
        proc.stderr.close()
    assert proc.returncode == -signal.SIGKILL
    return writing[0]


def _files(folder: Path) -> dict[str, bytes]:
    return {path.name: path.read_bytes() for path in sorted(folder.glob("*.bin"))}


def test_a_killed_prepare_is_refused_then_resumed_to_the_same_shards(tmp_path: Path) -> None:
    text = _corpus(tmp_path / "text", 15, 40_000)  # 30 shards of 20,000 tokens
    whole = invoke("data", "prepare", "--text", text, "-o", tmp_path / "whole",
                   "--shard-tokens", SHARD_TOKENS)  # fmt: skip
    assert whole.exit_code == 0, whole.output
    out = tmp_path / "data"
    left = _kill_mid_way(text, out)
    assert not out.exists()
    kept = _written_shards(left)
    first = (left / "train_000001.bin").stat().st_ino

    for data in (f"shards:{out}", str(left)):
        refused = invoke(*TRAIN, "--steps", 1, "--data", data, "--out", tmp_path / "run")
        line = assert_one_line_error(refused, FAILURE_EXIT, str(left), "--resume")
        assert f"-o {out} --shard-tokens {SHARD_TOKENS} --resume" in line
    assert not (tmp_path / "run" / "metrics.jsonl").exists()
    again = invoke("data", "prepare", "--text", text, "-o", out, "--shard-tokens", SHARD_TOKENS)
    assert_one_line_error(again, FAILURE_EXIT, str(left), "--resume", "--replace")

    resumed = invoke("data", "prepare", "--text", text, "-o", out,
                     "--shard-tokens", SHARD_TOKENS, "--resume")  # fmt: skip
    assert resumed.exit_code == 0, resumed.output
    assert f"({kept} shard(s) kept)" in resumed.output
    assert (out / "train_000001.bin").stat().st_ino == first  # kept, not written again
    assert _files(out) == _files(tmp_path / "whole") and len(_files(out)) == 30
    assert sorted(path.name for path in tmp_path.iterdir()) == ["data", "run", "text", "whole"]


def test_a_run_resumes_from_another_working_directory(tmp_path, monkeypatch) -> None:
    work, elsewhere = tmp_path / "work", tmp_path / "elsewhere"
    elsewhere.mkdir(parents=True)
    _corpus(work, 4, 5_000)
    monkeypatch.chdir(work)
    prepared = invoke("data", "prepare", "--text", ".", "-o", "../shards")
    assert prepared.exit_code == 0, prepared.output
    run = tmp_path / "run"
    first = invoke(*TRAIN, "--steps", 4, "--checkpoint-every", 2, "--data", "../shards",
                   "--out", "../run")  # fmt: skip
    assert first.exit_code == 0, first.output
    manifest = json.loads((run / "step_000002" / "manifest.json").read_text())
    assert manifest["options"]["data"] == f"shards:{tmp_path / 'shards'}"
    whole = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]

    for name in ("model.safetensors", "optimizer.safetensors", "manifest.json"):
        (run / "step_000004" / name).unlink()  # as if killed after step 2's checkpoint
    (run / "step_000004").rmdir()
    monkeypatch.chdir(elsewhere)  # where ../shards is nothing
    resumed = invoke("train", "--resume", "auto", "--out", run)
    assert resumed.exit_code == 0, resumed.output
    losses = [json.loads(line)["loss"] for line in (run / "metrics.jsonl").read_text().splitlines()]
    assert len(whole) == 4 and losses == whole
