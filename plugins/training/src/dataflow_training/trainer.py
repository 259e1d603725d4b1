"""``train``: the main job behind ``dataflow train``, as a Python function.

It opens the feed, builds the ``TrainingRun``, resumes from a checkpoint when asked,
prints the plan line, then runs the steps: the learning rate from the schedule, one
``(tokens, targets)`` per accumulation round from the feed, a line of ``metrics.jsonl``
per step, a checkpoint every ``checkpoint_every`` steps and at the end. A NaN or inf loss
stops the run before anything is saved (the last checkpoint stays as it was); Ctrl-C
finishes the step under way, writes a checkpoint and stops.
"""

from __future__ import annotations

import json
import math
import signal
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

import attrs

from dataflow_training.config import DtypePolicy, OptimizerPolicy, TrainConfig

SCHEDULES = ("cosine", "wsd", "constant")
#: the share of the steps after warmup that WSD spends decaying (the rest is stable)
WSD_DECAY_FRACTION = 0.2
METRICS_FILE = "metrics.jsonl"
#: losses kept in every checkpoint's manifest
HISTORY_TAIL = 100


class TrainingStopped(RuntimeError):
    """The run stopped itself (a NaN/inf loss); the message says why and what is kept."""


class Interrupted(Exception):
    """Ctrl-C: the run wrote its final checkpoint (``path``) and stopped."""

    def __init__(self, step: int, path: Path | None) -> None:
        super().__init__(f"interrupted after step {step}; checkpoint {path}")
        self.step, self.path = step, path


@attrs.frozen
class TrainOptions:
    """Everything ``dataflow train`` takes (see its ``--help``)."""

    family: str
    preset: str
    steps: int
    out: Path = attrs.field(converter=Path)
    data: str = "embedded:python-stdlib"
    batch: int = 8
    rounds: int = 1
    seq_len: int = 64
    budget_bytes: int | None = None
    device: str = "cpu"
    checkpoint_every: int | None = None
    resume: str | None = None
    keep: int | None = None
    lr: float = 3e-4
    warmup: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    clip: float | None = 1.0
    seed: int = 0
    dtype: str = "fp32"
    overrides: dict[str, Any] = attrs.field(factory=dict)
    recompute: bool = True

    def train_config(self) -> TrainConfig:
        return TrainConfig(
            seq_len=self.seq_len,
            batch=self.batch,
            rounds=self.rounds,
            dtype=DtypePolicy.named(self.dtype),
            optimizer=OptimizerPolicy(lr=self.lr),
            clip=self.clip,
            grad_norm=True,
        )


def lr_at(step: int, o: TrainOptions) -> float:
    """The learning rate of 0-based ``step``: linear warmup over ``warmup`` steps to
    ``lr``, then ``cosine`` (down to ``min_lr_ratio * lr`` at the last step), ``wsd``
    (stable, then a linear decay over the last ``WSD_DECAY_FRACTION`` of the steps) or
    ``constant``."""
    if step < o.warmup:
        return o.lr * (step + 1) / o.warmup
    floor = o.lr * o.min_lr_ratio
    span = max(1, o.steps - o.warmup - 1)
    done = min(1.0, (step - o.warmup) / span)
    if o.schedule == "constant":
        return o.lr
    if o.schedule == "cosine":
        return floor + (o.lr - floor) * 0.5 * (1 + math.cos(math.pi * done))
    if o.schedule == "wsd":
        start = 1 - WSD_DECAY_FRACTION
        return o.lr if done <= start else o.lr - (o.lr - floor) * (done - start) / (1 - start)
    raise ValueError(f"unknown schedule {o.schedule!r}; known: {', '.join(SCHEDULES)}")


def open_feed(o: TrainOptions) -> Any:
    from dataflow.plugins import feeds

    return feeds().open(o.data, batch=o.batch, seq_len=o.seq_len, seed=o.seed, rank=0, world=1)


def plan_line(run: Any) -> str:
    from dataflow.units import format_size

    p = run.predicted()
    budget = run.planned.budget_bytes
    budget_text = "unbounded" if budget >= 2**61 else format_size(budget)
    return (
        f"plan: {run.program.name} on {run.device}: predicted {p['step_s']:.4g} s/step, "
        f"{p['tok_s']:,.0f} tok/s; fast peak {format_size(p['fast_peak_bytes'])} of "
        f"{budget_text}, slow peak {format_size(p['slow_peak_bytes'])}; "
        f"moved {format_size(p['moved_bytes'])}/step; recomputed layers: none"
    )


def train(
    o: TrainOptions,
    *,
    out: TextIO | None = None,
    progress: Callable[[int, int, dict[str, Any]], None] | None = None,
) -> dict[str, Any]:
    """Run ``o``; returns a summary (steps done, last loss, checkpoints). ``progress(step,
    steps, metrics)`` is called after every step."""
    from dataflow_training.checkpoint import latest_checkpoint, prune, step_name
    from dataflow_training.run import TrainingRun

    out = out or sys.stdout
    feed = open_feed(o)
    run = TrainingRun(
        o.family,
        o.preset,
        o.train_config(),
        budget_bytes=o.budget_bytes,
        device=o.device,
        seed=o.seed,
        overrides=o.overrides,
        recompute=o.recompute,
    )
    vocab = getattr(feed, "vocab_size", None)
    if vocab is not None and vocab > run.vocab_size:
        raise ValueError(
            f"--data {o.data} produces token ids up to {vocab - 1}; {o.family} {o.preset} has "
            f"a vocabulary of {run.vocab_size}"
        )
    o.out.mkdir(parents=True, exist_ok=True)
    history: list[tuple[int, float]] = []
    start = 0
    resumed = None
    if o.resume is not None:
        resumed = latest_checkpoint(o.out) if o.resume == "auto" else Path(o.resume)
        if resumed is not None:
            manifest = run.restore(resumed)
            if "feed" in manifest:
                feed.restore(manifest["feed"])
            start = int(manifest["step"])
            history = [tuple(x) for x in manifest.get("history", [])]
    metrics_path = o.out / METRICS_FILE
    _truncate_metrics(metrics_path, start)
    print(f"data: {feed.describe()}", file=out)
    if resumed is not None:
        print(f"resumed from {resumed} (step {start})", file=out)
    print(plan_line(run), file=out, flush=True)
    predicted = run.predicted()["step_s"]
    tokens = o.batch * o.rounds * o.seq_len
    saved: list[Path] = []

    def save(step: int) -> Path:
        extra = {
            "feed": feed.state(),
            "history": history[-HISTORY_TAIL:],
            "options": _jsonable(o),
        }
        path = run.save(o.out / step_name(step), extra)
        saved.append(path)
        if o.keep is not None:
            prune(o.out, o.keep)
        return path

    stop = {"interrupt": False}

    def on_sigint(signum: int, frame: Any) -> None:
        stop["interrupt"] = True

    previous = signal.signal(signal.SIGINT, on_sigint)
    last: dict[str, Any] = {}
    try:
        with metrics_path.open("a") as metrics:
            for step in range(start, o.steps):
                lr = lr_at(step, o)
                batches = [feed.next() for _ in range(o.rounds)]
                stats = run.step(batches, lr)
                if not all(math.isfinite(x) for x in stats.losses):
                    kept = latest_checkpoint(o.out)
                    raise TrainingStopped(
                        f"step {step + 1}: the loss is {stats.loss} (not finite); stopped "
                        f"without saving; the last checkpoint ({kept or 'none'}) is kept"
                    )
                history.append((step + 1, stats.loss))
                last = {
                    "step": step + 1,
                    "loss": stats.loss,
                    "lr": lr,
                    "grad_norm": stats.grad_norm,
                    "tok_s": tokens / stats.step_s if stats.step_s > 0 else None,
                    "step_s": stats.step_s,
                    "predicted_step_s": predicted,
                    "fast_peak_bytes": stats.fast_peak_bytes,
                    "allocator_peak_bytes": stats.allocator_peak_bytes,
                }
                metrics.write(json.dumps(last) + "\n")
                metrics.flush()
                if progress is not None:
                    progress(step + 1, o.steps, last)
                every = o.checkpoint_every
                if (every and (step + 1) % every == 0) or step + 1 == o.steps:
                    save(step + 1)
                if stop["interrupt"]:
                    path = saved[-1] if saved and saved[-1].name == step_name(step + 1) else None
                    raise Interrupted(step + 1, path or save(step + 1))
    finally:
        signal.signal(signal.SIGINT, previous)
        run.close()
    return {"steps": o.steps, "start": start, "last": last, "checkpoints": saved}


def _truncate_metrics(path: Path, step: int) -> None:
    """Keep the lines of steps up to ``step`` (a resumed run rewrites what came after)."""
    if not path.exists():
        return
    kept = [
        line
        for line in path.read_text().splitlines()
        if line.strip() and json.loads(line).get("step", 0) <= step
    ]
    path.write_text("".join(f"{line}\n" for line in kept))


def _jsonable(o: TrainOptions) -> dict[str, Any]:
    data = attrs.asdict(o)
    data["out"] = str(o.out)
    return data


def elapsed_eta(started: float, done: int, total: int) -> float:
    """Seconds left at the pace so far."""
    spent = time.perf_counter() - started
    return spent / max(done, 1) * max(total - done, 0)
