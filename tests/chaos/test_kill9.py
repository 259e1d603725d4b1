"""kill -9 at random moments: a run with a checkpoint after every step is killed (SIGKILL,
which no process can answer) again and again, at moments a seeded ``random`` picks,
some of them inside checkpoint writes, and resumed with ``--resume auto`` each time
until it is done. After every kill each checkpoint completed before it is still there,
byte for byte, and intact, and the metrics so far are the uninterrupted run's; the run
resumed to its end has the uninterrupted run's losses exactly, step for step."""

from __future__ import annotations

import os
import random
import signal
import time
from pathlib import Path

import pytest

from dataflow.testing import invoke

from ._runs import (
    CONSTANT,
    SLOW_WRITE_ENV,
    WAIT_S,
    checkpoints,
    dataflow,
    intact,
    losses,
    straight_losses,
    train_args,
    wait_for,
)

pytest.importorskip("dataflow_family_gpt2")
pytest.importorskip("dataflow_feed_shards")  # the embedded corpus

pytestmark = pytest.mark.chaos

STEPS = 40
#: a checkpoint after every step (many small writes, so that kills land inside them), and
#: the default cosine schedule with a warmup: a resume must restore its place in it too
WARMUP = ("--warmup", "4")
OPTIONS = ("--checkpoint-every", "1", *WARMUP)
#: where each kill lands, in order: a few steps into the run (then a random fraction of a
#: step), the moment a checkpoint write is seen under way, a random moment while the
#: process starts (imports, plan, the run folder's claim), inside a write held open by
#: the writer's test hook after its files are written and before its rename
MOMENTS = ("steps", "write", "start", "held", "write", "steps")
SEED = 45


def _partial(out: Path) -> set[str]:
    """The ``.tmp-*`` folders of checkpoint writes under way (or killed)."""
    return {name for name in os.listdir(out) if name.startswith(".tmp-")} if out.is_dir() else set()


def _newest(out: Path) -> int:
    """The step of the newest completed checkpoint (0: none)."""
    found = [int(path.name.removeprefix("step_")) for path in out.glob("step_*")]
    return max(found, default=0)


def _until(moment: str, args: list[str], out: Path, rng: random.Random):
    """The run's next process, started and returned at ``moment`` (``MOMENTS``)."""
    resumed, left = _newest(out), _partial(out)
    held = resumed + 2
    env = {SLOW_WRITE_ENV: f"{held}:{WAIT_S}"} if moment == "held" else {}
    proc = dataflow(*args, env=env)
    began = time.monotonic()
    waits = {
        "steps": lambda: _newest(out) >= resumed + steps,
        "write": lambda: bool(_partial(out) - left),
        "start": lambda: time.monotonic() - began >= start_s,
        "held": lambda: bool(list(out.glob(f".tmp-step_{held:06d}-*/manifest.json"))),
    }
    steps, start_s = rng.randint(1, 3), rng.uniform(0.0, 3.0)
    wait_for(proc, waits[moment], poll_s=0.0005 if moment == "write" else 0.01)
    if moment == "steps":
        time.sleep(rng.uniform(0.0, 0.25))  # a random moment of the next step
    elif moment == "write":
        time.sleep(rng.uniform(0.0, 0.003))  # a random moment of the write
    return proc


def test_kill_9_at_random_moments_never_loses_work(tmp_path):
    straight = straight_losses(STEPS, *WARMUP)  # (its checkpoints change no loss)
    out = tmp_path / "run"
    rng = random.Random(SEED)
    seen: dict[str, dict[str, str]] = {}  # each completed checkpoint's file digests
    inside_writes = 0
    for number, moment in enumerate(MOMENTS):
        resume = ["--resume", "auto"] if number else []
        resumed, left = _newest(out), _partial(out)
        proc = _until(moment, train_args(out, STEPS, *OPTIONS, *resume), out, rng)
        proc.send_signal(signal.SIGKILL)
        stdout, stderr = proc.communicate(timeout=WAIT_S)
        where = f"kill {number} ({moment})"
        assert proc.returncode == -signal.SIGKILL, (where, stdout, stderr)
        assert "Traceback" not in stderr, (where, stderr)
        if left and _newest(out) > resumed:  # it got past its start: it cleaned up
            assert f"removed {len(left)} partial checkpoint folder(s)" in stdout, (where, stdout)
        inside_writes += bool(_partial(out) - left)
        if moment == "held":  # killed before its rename: never a step_* folder
            assert not (out / f"step_{resumed + 2:06d}").exists(), where
        now = checkpoints(out)
        for name, files in seen.items():  # no completed checkpoint lost or changed
            assert now.get(name) == files, f"{where} changed {name}"
        assert all(intact(out / name) for name in now), (where, sorted(now))
        assert losses(out) == straight[: len(losses(out))], where
        seen = now
    assert inside_writes >= 1, "no kill landed inside a checkpoint write"

    # the run resumed to its end with its own options alone
    resumed = _newest(out)
    proc = dataflow("train", "--out", str(out), "--resume", "auto")
    stdout, stderr = proc.communicate(timeout=WAIT_S * 2)
    assert proc.returncode == 0, stderr
    assert stderr.strip() == "", stderr
    assert f"step_{resumed:06d} (step {resumed})" in stdout, stdout
    assert losses(out) == straight  # bit-equal: the CPU's arithmetic is deterministic
    final = checkpoints(out)
    assert sorted(final) == [f"step_{step:06d}" for step in range(1, STEPS + 1)]
    assert all(final[name] == files for name, files in seen.items())
    assert not _partial(out) and not (out / "run.lock").exists()
    print(f"{len(MOMENTS)} kills, {inside_writes} inside checkpoint writes; resumed at {resumed}")


def test_a_kill_while_a_resume_trims_the_metrics_loses_no_line(tmp_path):
    """A resume rewrites ``metrics.jsonl`` without the lines past its checkpoint. A long
    run's file is tens of MB, and a kill in the middle of that rewrite must leave the
    old file or the new one, whole. The long history is stood in for by copies of the
    first steps' lines (the trim keeps every line of a step up to the checkpoint's):
    40,000 lines, about 8 MB; the kill comes the moment the file is seen to change."""
    out = tmp_path / "run"
    assert invoke(*train_args(out, 3, *CONSTANT, "--checkpoint-every", "2")).exit_code == 0
    metrics = out / "metrics.jsonl"
    first, second, third = metrics.read_text().splitlines()
    history = [first, second] * 20_000
    metrics.write_text("\n".join([*history, third]) + "\n")  # step 3: past the checkpoint
    before = metrics.stat()

    def changed() -> bool:
        try:
            now = metrics.stat()
        except FileNotFoundError:  # between a removal and a rename
            return True
        return (now.st_ino, now.st_size, now.st_mtime_ns) != (
            before.st_ino,
            before.st_size,
            before.st_mtime_ns,
        )

    proc = dataflow(*train_args(out, 4, *CONSTANT, "--resume", "auto"))
    wait_for(proc, changed, poll_s=0.0002)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=WAIT_S)
    kept = metrics.read_text().splitlines()
    assert len(kept) >= len(history), f"{len(history) - len(kept)} lines of the history lost"
    assert kept[: len(history)] == history
