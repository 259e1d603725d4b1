"""A run folder belongs to one run (``drive.run_folder``): ``dataflow train`` on gpt2_tiny
and the embedded corpus, on the CPU, with the real failures: a second run into an old
folder, a second process on a running run's folder, a lock file a dead process left; and
a run without ``--checkpoint-every`` still keeps its work on a time interval."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time

import pytest

from dataflow.testing import assert_one_line_error, invoke

from ._runs import (
    CONSTANT,
    STRAIGHT_STEPS,
    WAIT_S,
    checkpoints,
    digests,
    intact,
    losses,
    started,
    stop,
    straight_prefix,
    train_args,
)

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")  # the embedded corpus

pytestmark = pytest.mark.chaos


def test_a_new_run_into_a_folder_that_holds_a_run_is_refused_and_changes_nothing(tmp_path):
    out = tmp_path / "run"
    assert invoke(*train_args(out, 4, "--checkpoint-every", "2")).exit_code == 0
    before = digests(out)
    result = invoke(*train_args(out, 3))
    assert_one_line_error(result, 1, f"--out {out} holds a run", "--resume auto", "--overwrite")
    assert "step_000004" in result.stderr and "metrics.jsonl" in result.stderr
    assert digests(out) == before  # no line, checkpoint or lock file of the refused run


def test_overwrite_moves_the_old_run_aside_whole_and_it_still_resumes(tmp_path):
    out = tmp_path / "run"
    assert invoke(*train_args(out, 4, *CONSTANT)).exit_code == 0
    old = digests(out)
    result = invoke(*train_args(out, 2, *CONSTANT, "--overwrite"))
    assert result.exit_code == 0, result.output
    [aside] = tmp_path.glob("run.replaced-*")
    assert f"moved aside to {aside}" in result.output
    assert digests(aside) == old
    assert losses(out) == straight_prefix(2)
    resumed = invoke("train", "--out", str(aside), "--resume", "auto", "--steps", "6")
    assert resumed.exit_code == 0, resumed.output
    assert "step_000004 (step 4)" in resumed.output
    assert losses(aside) == straight_prefix(6)


def test_a_second_run_on_a_running_runs_folder_is_refused_and_the_first_completes_unharmed(
    tmp_path,
):
    """While a run trains, a second ``dataflow train`` on its folder (new, resuming or
    overwriting) is refused naming the first's pid and changes nothing there; the first
    then trains to its end as an uninterrupted run does. The first is held still
    (SIGSTOP) while the second tries, so that it cannot finish first."""
    out = tmp_path / "run"
    proc = started(out, STRAIGHT_STEPS, *CONSTANT, "--checkpoint-every", "4")
    stop(proc)
    try:
        before = digests(out)
        holder = f"--out {out} is in use by another run (pid {proc.pid} on {socket.gethostname()}"
        for extra in ([], ["--resume", "auto"], ["--overwrite"]):
            second = invoke(*train_args(out, 5, *CONSTANT, *extra))
            assert_one_line_error(second, 1, holder)
        assert digests(out) == before
    finally:
        proc.send_signal(signal.SIGCONT)
    _, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == 0, stderr
    assert losses(out) == straight_prefix(STRAIGHT_STEPS)
    kept = checkpoints(out)
    assert sorted(kept) == [f"step_{step:06d}" for step in range(4, STRAIGHT_STEPS + 1, 4)]
    assert all(intact(out / name) for name in kept)
    assert not (out / "run.lock").exists()


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
    result = invoke(*train_args(out, 2))
    assert result.exit_code == 0, result.output
    assert f"lock: {out / 'run.lock'} of a run that is gone (pid {record['pid']}" in result.output
    assert not (out / "run.lock").exists()


def test_checkpoints_come_on_a_time_interval_without_checkpoint_every(tmp_path):
    out = tmp_path / "run"
    assert invoke(*train_args(out, 3, "--checkpoint-minutes", "1e-9")).exit_code == 0
    assert sorted(p.name for p in out.glob("step_*")) == [
        "step_000001",
        "step_000002",
        "step_000003",
    ]
    off = tmp_path / "off"
    assert invoke(*train_args(off, 3, "--checkpoint-minutes", "0")).exit_code == 0
    assert [p.name for p in off.glob("step_*")] == ["step_000003"]  # the last only
    assert os.path.exists(off / "metrics.jsonl")
