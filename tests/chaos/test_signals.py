"""Signals keep a run's work (``drive.components.StopRequest``), sent to a real
``dataflow train`` process: SIGTERM (what job schedulers and ``docker stop`` send) and
SIGINT (Ctrl-C) finish the step under way (or the checkpoint write under way), write its
checkpoint and exit 143 and 130, the checkpoints before it untouched, and the run resumed
from there trains as an uninterrupted one does, loss for loss; SIGUSR1 writes a
checkpoint and the run carries on."""

from __future__ import annotations

import signal
from pathlib import Path

import pytest

from dataflow.testing import invoke

from ._runs import (
    CONSTANT,
    SLOW_WRITE_ENV,
    WAIT_S,
    checkpoints,
    intact,
    losses,
    started,
    straight_prefix,
    wait_for,
)

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")  # the embedded corpus

pytestmark = pytest.mark.chaos


def _sigusr1_then_wait(proc, out: Path) -> None:
    """SIGUSR1: a checkpoint after the step under way, then the run carries on."""
    proc.send_signal(signal.SIGUSR1)
    wait_for(proc, lambda: bool(list(out.glob("step_*/manifest.json"))))
    [saved] = out.glob("step_*")
    saved_at = int(saved.name.removeprefix("step_"))
    wait_for(proc, lambda: losses(out)[-1][0] >= saved_at + 2)  # it carries on


def _hold_the_write_of_step_4(proc, out: Path) -> None:
    """Wait until step 4's checkpoint is under way (its files written, the rename held off
    by the writer's test hook)."""
    wait_for(proc, lambda: bool(list(out.glob(".tmp-step_000004-*/manifest.json"))))


@pytest.mark.parametrize(
    ("name", "code", "last_line"),
    [
        ("SIGTERM", 143, "terminated (SIGTERM)"),  # while step 4's checkpoint is written
        ("SIGINT", 130, "interrupted"),  # between steps, after a SIGUSR1 checkpoint
    ],
)
def test_a_stop_signal_saves_the_step_and_exits_with_its_code_then_the_resume_is_exact(
    tmp_path, name, code, last_line
):
    out = tmp_path / "run"
    if name == "SIGTERM":  # checkpoints at 2 and 4; step 4's write takes 3 s
        env, extra, before = (
            {SLOW_WRITE_ENV: "4:3"},
            ("--checkpoint-every", "2"),
            _hold_the_write_of_step_4,
        )
    else:  # no checkpoint but SIGUSR1's
        env, extra, before = {}, (), _sigusr1_then_wait
    proc = started(out, 100_000, *CONSTANT, *extra, env=env)
    before(proc, out)
    kept = checkpoints(out)
    proc.send_signal(getattr(signal, name))
    _, stderr = proc.communicate(timeout=WAIT_S)
    assert proc.returncode == code, stderr
    assert "Traceback" not in stderr, stderr
    done = losses(out)[-1][0]
    lines = [line for line in stderr.splitlines() if line.strip()]
    assert lines[-2:] == [
        f"stopping after step {done}; wrote {out / f'step_{done:06d}'}",
        last_line,
    ]
    now = checkpoints(out)
    assert all(now[step] == files for step, files in kept.items())  # none lost or changed
    # the checkpoints before and the one of the stop: stopped inside step 4's write, the
    # run stops at 4 (no step more, no second write)
    assert sorted(now) == sorted({*kept, f"step_{done:06d}"}), (sorted(now), stderr)
    if name == "SIGTERM":
        assert done == 4
    assert intact(out / f"step_{done:06d}") and not (out / "run.lock").exists()
    resumed = invoke("train", "--out", str(out), "--resume", "auto", "--steps", str(done + 3))
    assert resumed.exit_code == 0, resumed.output
    assert f"step_{done:06d} (step {done})" in resumed.output
    assert losses(out) == straight_prefix(done + 3)
