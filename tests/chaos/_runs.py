"""What the chaos tests share: one small run (``dataflow train`` of gpt2_tiny on the
embedded corpus, on the CPU), started in this process (``invoke``) or in a process of its
own (``started``) that a test signals or kills; a run folder read back (losses, file
digests, the checkpoints and whether each is intact, checked here independently of the
code under test); and the losses of an uninterrupted run to compare a resumed one with.

Imported by the test modules as ``from ._runs import ...`` (this folder is a package, which
pytest's ``--import-mode=importlib`` imports as ``tests.chaos``); no conftest, so that the
folder's other test files stay independent.
"""

from __future__ import annotations

import atexit
import functools
import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dataflow.testing import invoke

#: how long a test waits for a run to get somewhere before it fails
WAIT_S = 120
#: the same learning rate whatever ``--steps`` says: a run of N steps trains as the first
#: N steps of a longer one, so one uninterrupted run serves every test of a process
CONSTANT = ("--schedule", "constant")
#: the steps of the uninterrupted run the constant-schedule tests compare with
STRAIGHT_STEPS = 16
#: drive.checkpoint's test hook, ``STEP:SECONDS``: the write of checkpoint STEP waits that
#: long between writing its files and its rename, so that a kill or signal lands inside it
SLOW_WRITE_ENV = "DATAFLOW_CHECKPOINT_SLOW_WRITE"
DATAFLOW = str(Path(sys.executable).parent / "dataflow")


def train_args(out: Path, steps: int, *extra: str) -> list[str]:
    """``dataflow train`` arguments of the suite's run: gpt2_tiny on the embedded corpus,
    batch 4 x 32 tokens, on the CPU, into ``out``."""
    return [
        "train", "--preset", "gpt2_tiny", "--steps", str(steps), "--batch", "4", "--seq-len",
        "32", "--device", "cpu", "--lr", "3e-3", "--out", str(out), *extra,
    ]  # fmt: skip


def losses(out: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of each line of ``out/metrics.jsonl``; a last line torn by a kill
    is left out."""
    lines = (out / "metrics.jsonl").read_text().splitlines()
    found = []
    for number, line in enumerate(lines, start=1):
        try:
            metrics = json.loads(line)
        except ValueError:
            assert number == len(lines), f"metrics.jsonl line {number} is damaged: {line!r}"
            break
        found.append((metrics["step"], metrics["loss"]))
    return found


@functools.cache
def straight_losses(steps: int = STRAIGHT_STEPS, *extra: str) -> list[tuple[int, float]]:
    """The losses of an uninterrupted run of ``steps`` (with ``extra`` options), trained
    once per process."""
    folder = Path(tempfile.mkdtemp(prefix="chaos-straight-"))
    atexit.register(shutil.rmtree, folder, True)
    result = invoke(*train_args(folder / "run", steps, *extra))
    assert result.exit_code == 0, result.output
    return losses(folder / "run")


def straight_prefix(steps: int) -> list[tuple[int, float]]:
    """The losses of the first ``steps`` steps of an uninterrupted constant-schedule run."""
    return straight_losses(max(steps, STRAIGHT_STEPS), *CONSTANT)[:steps]


def digests(out: Path) -> dict[str, str]:
    """The SHA-256 of every file under ``out``, by its path there."""
    return {
        str(path.relative_to(out)): hashlib.sha256(path.read_bytes()).hexdigest()
        for path in sorted(out.rglob("*"))
        if path.is_file()
    }


def checkpoints(out: Path) -> dict[str, dict[str, str]]:
    """The complete checkpoints (``step_*`` folders) under ``out``, each with its files'
    digests."""
    return {path.name: digests(path) for path in sorted(out.glob("step_*")) if path.is_dir()}


def intact(folder: Path) -> bool:
    """Whether a checkpoint's manifest reads, names its folder's step and lists the
    digests its tensor files have."""
    try:
        manifest = json.loads((folder / "manifest.json").read_text())
    except (OSError, ValueError):
        return False
    files = manifest.get("files", {})
    return (
        f"step_{manifest.get('step', -1):06d}" == folder.name
        and len(files) == 2
        and all(
            (folder / name).is_file()
            and hashlib.sha256((folder / name).read_bytes()).hexdigest() == digest
            for name, digest in files.items()
        )
    )


def started(out: Path, steps: int, *extra: str, env: dict[str, str] | None = None, after: int = 3):
    """``dataflow train`` into ``out`` in a process of its own, returned once it has
    trained ``after`` steps."""
    proc = dataflow(*train_args(out, steps, *extra), env=env)
    wait_for(proc, lambda: (out / "metrics.jsonl").exists() and len(losses(out)) >= after)
    return proc


def stop(proc: subprocess.Popen) -> None:
    """SIGSTOP ``proc`` and return once every thread of it is stopped (each
    ``/proc/<pid>/task/<tid>/stat`` says ``T``): the signal is delivered asynchronously,
    and a write of the process's in flight when it was sent would otherwise land after
    the caller has read the folder (a digest of a checkpoint's temporary file changed
    under one such read in CI, session 40)."""
    proc.send_signal(signal.SIGSTOP)
    tasks = Path(f"/proc/{proc.pid}/task")
    if not tasks.exists():  # no procfs: give the signal time
        time.sleep(0.5)
        return

    def state(stat: Path) -> str:  # the field after the parenthesised command name
        try:
            return stat.read_text().rpartition(")")[2].split()[0]
        except OSError:  # a thread that ended meanwhile
            return "T"

    deadline = time.monotonic() + WAIT_S
    # every thread: a write may be in flight on any of them
    while any(state(task / "stat") not in ("T", "t") for task in tasks.iterdir()):
        if time.monotonic() > deadline:
            raise AssertionError(f"process {proc.pid} did not stop within {WAIT_S} s")
        time.sleep(0.01)


def dataflow(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen:
    """``dataflow ARGS`` in a process of its own, its output piped."""
    return subprocess.Popen(
        [DATAFLOW, *args],
        env={**os.environ, **(env or {})},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def wait_for(proc: subprocess.Popen, done, poll_s: float = 0.02) -> None:
    """Wait until ``done()``; fails (with the process's output) if ``proc`` ends first or
    ``WAIT_S`` pass."""
    deadline = time.monotonic() + WAIT_S
    while not done():
        if proc.poll() is not None:
            stdout, stderr = proc.communicate()
            raise AssertionError(f"the run ended (exit {proc.returncode}):\n{stdout}\n{stderr}")
        assert time.monotonic() < deadline, "the run never got there"
        time.sleep(poll_s)
