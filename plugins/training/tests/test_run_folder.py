"""A run folder belongs to one run, and signals keep a run's work (``drive.run_folder``,
``drive.components.StopRequest``): ``dataflow train`` on gpt2_tiny and the embedded corpus,
on the CPU, with the real failures: a second run into an old folder, a second process on
the same folder, SIGTERM and SIGUSR1 sent to a running process, a lock file a dead
process left."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from dataflow.testing import assert_one_line_error, invoke

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")  # the embedded corpus

LINE_TIMEOUT_S = 120


def _args(out: Path, steps: int, *extra: str) -> list[str]:
    return [
        "train",
        "--preset",
        "gpt2_tiny",
        "--steps",
        str(steps),
        "--batch",
        "4",
        "--seq-len",
        "32",
        "--device",
        "cpu",
        "--lr",
        "3e-3",
        "--out",
        str(out),
        *extra,
    ]


def _losses(out: Path) -> list[tuple[int, float]]:
    lines = (out / "metrics.jsonl").read_text().splitlines()
    return [(m["step"], m["loss"]) for m in map(json.loads, lines)]


def _started(out: Path, steps: int, *extra: str) -> subprocess.Popen:
    """``dataflow train`` in a process of its own, once it has trained three steps."""
    proc = subprocess.Popen(
        [str(Path(sys.executable).parent / "dataflow"), *_args(out, steps, *extra)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    deadline = time.monotonic() + LINE_TIMEOUT_S
    while not (out / "metrics.jsonl").exists() or len(_losses(out)) < 3:
        assert proc.poll() is None, proc.communicate()
        assert time.monotonic() < deadline, "the run never got going"
        time.sleep(0.05)
    return proc


def _folder(out: Path) -> dict[str, bytes]:
    """Every file under ``out`` with its bytes."""
    return {str(p.relative_to(out)): p.read_bytes() for p in sorted(out.rglob("*")) if p.is_file()}


def test_a_new_run_into_a_folder_that_holds_a_run_is_refused_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    assert invoke(*_args(out, 4, "--checkpoint-every", "2")).exit_code == 0
    before = _folder(out)
    result = invoke(*_args(out, 3))
    assert_one_line_error(result, 1, f"--out {out} holds a run", "--resume auto", "--overwrite")
    assert "step_000004" in result.stderr and "metrics.jsonl" in result.stderr
    assert _folder(out) == before  # no line, checkpoint or lock file of the refused run


def test_overwrite_moves_the_old_run_aside_whole(tmp_path):
    out = tmp_path / "run"
    assert invoke(*_args(out, 4)).exit_code == 0
    old = _folder(out)
    result = invoke(*_args(out, 2, "--overwrite"))
    assert result.exit_code == 0, result.output
    [aside] = tmp_path.glob("run.replaced-*")
    assert f"moved aside to {aside}" in result.output
    assert _folder(aside) == old
    assert [step for step, _ in _losses(out)] == [1, 2]


def test_a_second_process_is_refused_and_sigterm_saves_then_a_resume_equals_a_straight_run(
    tmp_path,
):
    """While a run trains, a second ``dataflow train`` on its folder (even with --resume)
    is refused naming the first's pid; SIGTERM then finishes the step under way, writes
    its checkpoint and exits 143; the run resumed from there trains as one uninterrupted
    run does, step for step."""
    out = tmp_path / "run"
    constant = ("--schedule", "constant")  # the same lr whatever --steps says
    proc = _started(out, 100_000, *constant)
    try:
        second = invoke(*_args(out, 5, "--resume", "auto"))
        pid = f"pid {proc.pid} on {socket.gethostname()}"
        assert_one_line_error(second, 1, f"--out {out} is in use by another run ({pid}")
    finally:
        proc.send_signal(signal.SIGTERM)
        _, stderr = proc.communicate(timeout=LINE_TIMEOUT_S)
    assert proc.returncode == 143, stderr
    assert "Traceback" not in stderr
    done = _losses(out)[-1][0]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-2].startswith(f"stopping after step {done}; wrote "), stderr
    assert lines[-1] == "terminated (SIGTERM)", stderr
    assert (out / f"step_{done:06d}" / "manifest.json").exists()
    assert not (out / "run.lock").exists()
    resumed = invoke("train", "--out", str(out), "--resume", "auto", "--steps", str(done + 3))
    assert resumed.exit_code == 0, resumed.output
    straight = tmp_path / "straight"
    assert invoke(*_args(straight, done + 3, *constant)).exit_code == 0
    assert _losses(out) == _losses(straight)


def test_sigusr1_writes_a_checkpoint_and_the_run_carries_on(tmp_path):
    out = tmp_path / "run"
    proc = _started(out, 100_000)
    try:
        proc.send_signal(signal.SIGUSR1)
        deadline = time.monotonic() + LINE_TIMEOUT_S
        while not list(out.glob("step_*/manifest.json")):
            assert proc.poll() is None, proc.communicate()
            assert time.monotonic() < deadline, "SIGUSR1 wrote no checkpoint"
            time.sleep(0.05)
        [first] = out.glob("step_*")
        saved_at = int(first.name.removeprefix("step_"))
        while _losses(out)[-1][0] < saved_at + 2:  # it carries on
            assert proc.poll() is None, proc.communicate()
            time.sleep(0.05)
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=LINE_TIMEOUT_S)
    assert proc.returncode == 143
    assert len(list(out.glob("step_*"))) == 2  # SIGUSR1's, then SIGTERM's


def test_a_lock_a_dead_process_left_is_taken_over_with_a_line(tmp_path):
    out = tmp_path / "run"
    out.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"],
        text=True,
        capture_output=True,
        check=True,
    )
    record = {"pid": int(dead.stdout), "host": socket.gethostname(), "started": time.time()}
    (out / "run.lock").write_text(json.dumps(record))
    result = invoke(*_args(out, 2))
    assert result.exit_code == 0, result.output
    assert f"lock: {out / 'run.lock'} of a run that is gone (pid {record['pid']}" in result.output
    assert not (out / "run.lock").exists()


def test_checkpoints_come_on_a_time_interval_without_checkpoint_every(tmp_path):
    out = tmp_path / "run"
    assert invoke(*_args(out, 3, "--checkpoint-minutes", "1e-9")).exit_code == 0
    assert sorted(p.name for p in out.glob("step_*")) == [
        "step_000001",
        "step_000002",
        "step_000003",
    ]
    off = tmp_path / "off"
    assert invoke(*_args(off, 3, "--checkpoint-minutes", "0")).exit_code == 0
    assert [p.name for p in off.glob("step_*")] == ["step_000003"]  # the last only
    assert os.path.exists(off / "metrics.jsonl")


def test_a_torn_last_metrics_line_is_dropped_and_the_run_resumes(tmp_path):
    """A kill while a metrics line is written leaves half a line: the resume drops it
    (and the lines past the checkpoint); a damaged line before the last one is an error
    naming the file and line."""
    out = tmp_path / "run"
    assert (
        invoke(*_args(out, 4, "--checkpoint-every", "2", "--schedule", "constant")).exit_code == 0
    )
    metrics = out / "metrics.jsonl"
    metrics.write_text(metrics.read_text() + '{"step": 5, "loss": 4.1')  # torn
    resumed = invoke(*_args(out, 5, "--resume", "auto", "--schedule", "constant"))
    assert resumed.exit_code == 0, resumed.output
    assert [step for step, _ in _losses(out)] == [1, 2, 3, 4, 5]
    lines = metrics.read_text().splitlines()
    metrics.write_text("\n".join([lines[0], "{not json", *lines[1:]]) + "\n")
    damaged = invoke(*_args(out, 6, "--resume", "auto", "--schedule", "constant"))
    assert_one_line_error(damaged, 1, f"{metrics}: line 2 is not a step's metrics")
