"""A run folder belongs to one run: ``claim`` it before a run writes anything there.

A new run (no ``--resume``) into a folder that holds another run's checkpoints or metrics
is refused with what would work: ``--resume auto`` (carry that run on), another ``--out``,
or ``--overwrite`` (the old run is moved aside, whole, to ``OUT.replaced-<time>``). While a
run is under way it holds ``OUT/run.lock``: an exclusive ``flock`` on it, and in it the
holder's pid, host and start time, so that a second process on the same folder is
refused naming who holds it. The kernel drops the lock with the process, however it
ends, so the lock of a dead run never blocks a new one; a lock file a dead process left
is taken over with a line that says so.
"""

from __future__ import annotations

import fcntl
import json
import os
import socket
import time
from pathlib import Path
from typing import Any

from dataflow_training.drive.checkpoint import checkpoints, remove_leftovers
from dataflow_training.drive.components import METRICS_FILE, Say

LOCK_FILE = "run.lock"


class RunFolderError(RuntimeError):
    """The folder cannot be this run's: it holds another run, or another process runs there."""


def _holds_a_run(out: Path) -> list[str]:
    """What in ``out`` belongs to a run: its checkpoints and its metrics, by name."""
    found = [path.name for path in checkpoints(out)]
    metrics = out / METRICS_FILE
    if metrics.is_file() and metrics.stat().st_size > 0:
        found.append(METRICS_FILE)
    return found


def _aside(out: Path) -> Path:
    stamp = time.strftime("%Y%m%d-%H%M%S")
    target = out.with_name(f"{out.name}.replaced-{stamp}")
    index = 1
    while target.exists():
        index += 1
        target = out.with_name(f"{out.name}.replaced-{stamp}-{index}")
    return target


class RunFolder:
    """The run's hold on ``out`` (``claim``); ``release`` ends it."""

    def __init__(self, out: Path, handle: Any) -> None:
        self.out, self._handle = out, handle

    @classmethod
    def claim(cls, out: Path, *, resume: bool, overwrite: bool, say: Say) -> RunFolder:
        """Take ``out`` for this run (module docstring): refuse a folder holding another
        run unless it resumes or ``overwrite`` moves that run aside, then lock it."""
        out.mkdir(parents=True, exist_ok=True)
        handle = cls._lock(out, say)
        try:
            left = remove_leftovers(out)
            if left:
                say(f"removed {len(left)} partial checkpoint folder(s) a killed write left")
            held = [] if resume else _holds_a_run(out)
            if held and not overwrite:
                shown = ", ".join(held[:3]) + (
                    f" and {len(held) - 3} more" if len(held) > 3 else ""
                )
                raise RunFolderError(
                    f"--out {out} holds a run ({shown}): carry it on with --resume auto, "
                    "start this one in another --out, or pass --overwrite to move that run "
                    "aside"
                )
            if held:
                target = _aside(out)
                out.rename(target)
                (target / LOCK_FILE).unlink(missing_ok=True)  # ours, gone with the folder
                handle.close()
                out.mkdir()
                say(f"overwrite: the run in {out} was moved aside to {target}")
                handle = cls._lock(out, say)
        except BaseException:
            cls(out, handle).release()
            raise
        return cls(out, handle)

    @staticmethod
    def _lock(out: Path, say: Say) -> Any:
        path = out / LOCK_FILE
        handle = path.open("a+")
        try:
            fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            handle.seek(0)
            holder = _holder(handle.read())
            handle.close()
            raise RunFolderError(
                f"--out {out} is in use by another run ({holder}): wait for it, or give "
                "this run another --out"
            ) from None
        handle.seek(0)
        left = handle.read().strip()
        if left:  # a lock file whose process is gone (the kernel dropped its flock)
            say(f"lock: {path} of a run that is gone ({_holder(left)}) taken over")
        handle.seek(0)
        handle.truncate()
        mine = {"pid": os.getpid(), "host": socket.gethostname(), "started": time.time()}
        handle.write(json.dumps(mine))
        handle.flush()
        return handle

    def release(self) -> None:
        """Remove the lock file and drop the lock (the kernel drops it too if the process
        dies first)."""
        if self._handle is None:
            return
        (self.out / LOCK_FILE).unlink(missing_ok=True)
        self._handle.close()
        self._handle = None


def _holder(text: str) -> str:
    try:
        found = json.loads(text)
        started = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(found["started"]))
        return f"pid {found['pid']} on {found['host']}, started {started}"
    except (ValueError, KeyError, TypeError):
        return "a process that left no readable record"
