"""Validation: the loss of held-out tokens, from the step's forward-only program.

    evaluator = evaluator_of(o, compiled)       # compiled once, inside the run's budget
    metrics = evaluator.evaluate(run.host_weights())   # {"val_loss": ..., "val_ppl": ...}

The program is the training step's forward half (``step.forward_only``), at the step's
batch and sequence length, planned by PressureFit in the same fast budget and placed and
run by its own engine. Only one engine holds the budget at a time: the training run gives
its engine's memory back first (``TrainingRun.host_weights``, the state kept on the host;
its next step loads it again), so the evaluation's peak is held to the budget as a
training step's is. The tokens are the first ``tokens`` of the validation feed, rounded up
to whole batches: every evaluation, and ``dataflow eval --from`` of a checkpoint
(``eval_checkpoint.evaluate_checkpoint``), reads the same ones. The training feed is never
read here, so the training batches after an evaluation are those without it.

The held-out tokens are the ``val`` shards of a ``shards:`` training feed (those ``dataflow
data prepare --val-tokens`` writes), or any feed spec given as ``val_data``.
"""

from __future__ import annotations

import math
import time
from collections.abc import Mapping
from typing import Any

import attrs
import torch

from dataflow import Engine, feeds, format_size
from dataflow_training.drive.values import StartValues, data_values
from dataflow_training.plan.compiled_step import UNBOUNDED_BYTES, CompiledStep

#: the feed scheme whose folders hold held-out shards (``split="val"``)
SHARDS = "shards"


class EvalError(ValueError):
    """Validation asked of data that has none, or bad evaluation options."""


def val_feed_spec(data: str, val_data: str | None) -> tuple[str, str | None]:
    """The spec the validation tokens come from and the split it opens (None: the feed's
    own): ``val_data`` as given, else the ``val`` split of ``data`` (a ``shards:`` folder)."""
    if val_data is not None:
        return val_data, None
    if data.partition(":")[0] != SHARDS:
        raise EvalError(
            f"--eval-every: --data {data} has no held-out shards (only shards: folders "
            "that `dataflow data prepare --val-tokens N` wrote have them); give --val-data "
            "SPEC (any data source --data takes)"
        )
    return data, "val"


@attrs.frozen
class EvalOptions:
    """What an evaluation reads: ``tokens`` of ``spec`` (opened with ``split``), every
    ``every`` steps of a training run (None: only when asked)."""

    spec: str
    tokens: int
    every: int | None = None
    split: str | None = None


class Evaluator:
    """The compiled forward-only step of a run and the validation tokens it scores."""

    def __init__(self, compiled: CompiledStep, options: EvalOptions) -> None:
        self.compiled, self.options = compiled, options
        train = compiled.train
        self.batch_tokens = train.batch * train.seq_len
        self.batches = max(1, math.ceil(options.tokens / self.batch_tokens))
        extra = {} if options.split is None else {"split": options.split}
        feed = feeds().open(
            options.spec, batch=train.batch, seq_len=train.seq_len, seed=0, rank=0, world=1, **extra
        )
        self.describe = feed.describe()
        self.vocab_size = getattr(feed, "vocab_size", None)
        #: the held-out batches, read once: every evaluation scores the same tokens
        self.data = [feed.next() for _ in range(self.batches)]
        self.fast_peak_bytes = 0
        for r, (tokens, _targets) in enumerate(self.data):
            largest = int(tokens.max())
            if largest >= compiled.vocab_size:
                raise EvalError(
                    f"--val-data {options.spec}: batch {r} reaches token id {largest}; the "
                    f"model's vocabulary has {compiled.vocab_size} ids"
                )

    @classmethod
    def of(cls, o: Any, family: Any, options: EvalOptions) -> Evaluator:
        """The evaluator of a run of ``o`` (``TrainOptions``; ``family`` the family object it
        names): its step's shape, budget, device and resolver, forward only."""
        return cls(o.compile(family, forward_only=True), options)

    def due(self, step: int) -> bool:
        every = self.options.every
        return bool(every) and step % every == 0

    @property
    def tokens(self) -> int:
        return self.batches * self.batch_tokens

    def line(self) -> str:
        """What the evaluation reads and its plan, for the run's opening lines."""
        p = self.compiled.predicted()
        every = f"every {self.options.every} steps, " if self.options.every else ""
        return (
            f"eval: {every}{self.tokens:,} tokens ({self.batches} batch(es)) of "
            f"{self.describe}; forward-only plan: fast peak "
            f"{format_size(p['fast_peak_bytes'])} of {_budget(self.compiled)}, predicted "
            f"{p['step_s'] * self.batches:.3g} s"
        )

    def evaluate(self, weights: Mapping[str, torch.Tensor]) -> dict[str, Any]:
        """``val_loss`` (the mean of the batches' mean losses: every batch is whole, so
        the mean over every scored token), ``val_ppl`` (its exp), ``val_tokens``,
        ``eval_s`` and the engine's peaks (the ledger's fast peak; on CUDA the allocator's,
        which the engine holds to the budget), of the model state ``weights`` (left as it
        is)."""
        started = time.perf_counter()
        running = self.compiled.running
        data_objects = running.layout.data_objects()
        (loss_id,) = running.layout.losses()
        initial = StartValues(running, weights, lambda _step, _r: self.data[0])
        engine = Engine(
            "torch",
            budget_bytes=self.compiled.budget_bytes,
            slow_budget_bytes=self.compiled.backing_bytes,
            device=self.compiled.device,
            graph=self.compiled.graph,
        )
        losses = []
        peak, allocator = 0, None
        try:
            engine.load(self.compiled.placement, self.compiled.executables(), initial=initial)
            for i, batch in enumerate(self.data):
                if i == 0:
                    result = engine.run()
                else:
                    result = engine.run(
                        feed=lambda _step, b=batch: data_values(data_objects, lambda *_: b)
                    )
                losses.append(engine.read_scalars([loss_id])[0])
                peak = max(peak, result.fast_peak_bytes)
                if result.allocator_peak_bytes is not None:  # CUDA: the engine checked it
                    allocator = max(allocator or 0, result.allocator_peak_bytes)
        finally:
            engine.close()
        self.fast_peak_bytes = max(self.fast_peak_bytes, peak)
        val_loss = sum(losses) / len(losses)
        return {
            "val_loss": val_loss,
            "val_ppl": math.exp(val_loss) if val_loss < 700 else math.inf,
            "val_tokens": self.tokens,
            "eval_s": time.perf_counter() - started,
            "eval_fast_peak_bytes": peak,
            "eval_allocator_peak_bytes": allocator,
        }


def _budget(compiled: CompiledStep) -> str:
    budget = compiled.planned_budget_bytes
    return "unbounded" if budget >= UNBOUNDED_BYTES // 2 else format_size(budget)


def evaluator_of(o: Any, compiled: CompiledStep, fleet: Any = None) -> Evaluator | None:
    """The evaluator of a training run of ``o`` (``TrainOptions``) whose step is
    ``compiled``: None without ``o.eval_every``."""
    if not o.eval_every:
        return None
    if fleet is not None:
        raise EvalError(
            "--eval-every: a fleet does not evaluate yet; run `dataflow eval --from "
            "RUN` on its checkpoints"
        )
    spec, split = val_feed_spec(o.data, o.val_data)
    options = EvalOptions(spec, o.eval_tokens, o.eval_every, split)
    return Evaluator.of(o, compiled.family, options)
