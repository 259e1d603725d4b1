"""The parts ``train`` is made of, each with a small interface of its own: metrics sinks
(``metrics.jsonl``, TensorBoard, the progress bar), the checkpointer and the stop request
(Ctrl-C). ``train`` is a loop over them; new behaviour (validation, signals, phases) goes
into a part, not into the loop.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol

from dataflow_training.drive.checkpoint import prune, step_name

Metrics = dict[str, Any]
Say = Callable[[str], None]

METRICS_FILE = "metrics.jsonl"
TENSORBOARD_FOLDER = "tensorboard"
#: the metrics.jsonl fields also written as TensorBoard scalars (when not None)
TENSORBOARD_SCALARS = ("loss", "lr", "grad_norm", "tok_s", "step_s", "val_loss", "val_ppl")


class MetricsSink(Protocol):
    """Where each step's metrics go: ``write`` after every step, ``close`` at the end."""

    def write(self, step: int, metrics: Metrics) -> None: ...

    def close(self) -> None: ...


class JsonlMetrics:
    """One JSON line a step in ``path``. A resumed run (``start`` > 0) first drops the
    lines of steps after ``start`` that an interrupted run left."""

    def __init__(self, path: Path, start: int) -> None:
        self.path = path
        _truncate(path, start)
        self._file = path.open("a")

    def write(self, step: int, metrics: Metrics) -> None:
        try:
            self._file.write(json.dumps(metrics) + "\n")
            self._file.flush()
        except OSError as exc:  # a full disk: name the file
            raise OSError(exc.errno, exc.strerror, str(self.path)) from exc

    def close(self) -> None:
        self._file.close()


class TensorBoardMetrics:
    """``TENSORBOARD_SCALARS`` as TensorBoard scalars; a resumed run purges the events
    after ``start`` that an interrupted run left, as ``metrics.jsonl`` loses its lines."""

    def __init__(self, writer: Any) -> None:
        self.writer = writer

    @classmethod
    def open(cls, folder: Path, start: int) -> TensorBoardMetrics | None:
        """The sink into ``folder``, or None when ``tensorboard`` is not installed."""
        try:
            # optional: TensorBoard's writer needs the tensorboard package
            from torch.utils.tensorboard import SummaryWriter
        except ImportError:
            return None
        return cls(SummaryWriter(str(folder), purge_step=start + 1 if start else None))

    @property
    def log_dir(self) -> str:
        return self.writer.log_dir

    def write(self, step: int, metrics: Metrics) -> None:
        for name in TENSORBOARD_SCALARS:
            if metrics.get(name) is not None:  # val_* only on the steps that evaluate
                self.writer.add_scalar(name, metrics[name], step)

    def close(self) -> None:
        self.writer.close()


class ProgressMetrics:
    """``progress(step, steps, metrics)`` after every step (the CLI's progress bar)."""

    def __init__(self, progress: Callable[[int, int, Metrics], None], steps: int) -> None:
        self.progress, self.steps = progress, steps

    def write(self, step: int, metrics: Metrics) -> None:
        self.progress(step, self.steps, metrics)

    def close(self) -> None:
        pass


class MetricsFileError(ValueError):
    """A ``metrics.jsonl`` line that is not a step's metrics, before its last line."""


def _truncate(path: Path, step: int) -> None:
    """Keep the lines of steps up to ``step`` (a resumed run rewrites what came after). A
    last line cut short (the process was killed while writing it) is dropped; any other
    line that is not a step's metrics is an error naming the file and line. The file is
    replaced whole (a long run's is tens of MB): a kill while it is rewritten leaves the
    old file or the new one, never a part."""
    if not path.exists():
        return
    content = path.read_text()
    lines = [line for line in content.splitlines() if line.strip()]
    kept = []
    for number, line in enumerate(lines, start=1):
        try:
            line_step = json.loads(line)["step"]
        except (ValueError, KeyError, TypeError):
            if number == len(lines):
                break  # torn by a kill mid-write: that step's metrics are lost, not the run
            raise MetricsFileError(
                f"{path}: line {number} is not a step's metrics ({line[:60]!r}); move the "
                "file aside to resume without its history"
            ) from None
        if line_step <= step:
            kept.append(line)
    text = "".join(f"{line}\n" for line in kept)
    if text != content:  # into a file beside, then renamed: a kill keeps the old or the new
        partial = path.with_name(f".{path.name}.trimmed")
        with partial.open("w") as file:
            file.write(text)
            file.flush()
            os.fsync(file.fileno())
        os.replace(partial, path)


class Checkpointer:
    """Writes the run's checkpoints into ``out``: every ``every`` steps, every ``minutes``
    minutes since the last one (a run without ``every`` still keeps its work), and at the
    last step (``due``), each with what ``extra()`` returns in its manifest, keeping the
    newest ``keep``. A member of a fleet that does not write (``writes`` False) only
    records where rank 0 writes."""

    def __init__(
        self,
        run: Any,
        out: Path,
        *,
        every: int | None,
        minutes: float | None = None,
        steps: int,
        keep: int | None,
        writes: bool,
        extra: Callable[[], dict[str, Any]],
        say: Say,
    ) -> None:
        self.run, self.out, self.every, self.steps, self.keep = run, out, every, steps, keep
        self.minutes = minutes
        self.writes, self.extra, self.say = writes, extra, say
        self.saved: list[Path] = []
        self._last_s = time.monotonic()

    def due(self, step: int) -> bool:
        late = self.minutes is not None and time.monotonic() - self._last_s >= 60 * self.minutes
        return bool(self.every and step % self.every == 0) or step == self.steps or late

    def save(self, step: int) -> Path:
        path = self.out / step_name(step)
        extra = self.extra()
        self._last_s = time.monotonic()
        if not self.writes:
            self.saved.append(path)
            return path
        if path.is_dir():  # resumed from an earlier step: this one is of the old history
            self.say(f"replacing {path}, written by the run this one resumed before")
            shutil.rmtree(path)
        path = self.run.save(path, extra)
        self.saved.append(path)
        if self.keep is not None:
            prune(self.out, self.keep)
        return path

    def at(self, step: int) -> Path:
        """The checkpoint of ``step``: the one written there already, else a new one."""
        if self.saved and self.saved[-1].name == step_name(step):
            return self.saved[-1]
        return self.save(step)


class StopRequest:
    """The signals a run answers while it is installed (job schedulers send SIGTERM, then
    kill after a grace period; Ctrl-C is SIGINT): SIGINT and SIGTERM ask the run to stop
    after the step under way (``stop``: the signal's name), SIGUSR1 to write a checkpoint
    after it and carry on (``save``). ``close`` puts the previous handlers back."""

    SIGNALS = ("SIGINT", "SIGTERM", "SIGUSR1")

    def __init__(self) -> None:
        self.stop: str | None = None
        self.save = False
        self._previous = {}
        for name in self.SIGNALS:
            number = getattr(signal, name, None)
            if number is not None:  # (SIGUSR1 is not on every platform)
                self._previous[number] = signal.signal(number, self._on_signal)

    @property
    def requested(self) -> bool:
        return self.stop is not None

    def _on_signal(self, signum: int, frame: Any) -> None:
        name = signal.Signals(signum).name
        if name == "SIGUSR1":
            self.save = True
        else:
            self.stop = self.stop or name

    def close(self) -> None:
        for number, previous in self._previous.items():
            signal.signal(number, previous)
