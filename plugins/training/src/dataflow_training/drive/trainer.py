"""``train``: the main job behind ``dataflow train``, as a Python function.

It opens the feed, builds the ``TrainingRun``, resumes from a checkpoint when asked,
prints the plan line, then runs the steps: the learning rate from the schedule, one
``(tokens, targets)`` per accumulation round from the feed, a line of ``metrics.jsonl``
per step (and TensorBoard scalars under ``OUT/tensorboard`` when ``tensorboard`` is
installed), a checkpoint every ``checkpoint_every`` steps and at the end. With ``profile``
the steps of its window are traced (``dataflow_training.drive.profiling``). A NaN or inf loss
stops the run before anything is saved (the last checkpoint stays as it was); Ctrl-C
finishes the step under way, writes a checkpoint and stops.

In a fleet (``fleet``, a ``dataflow_training.drive.fleet.Fleet``) every member runs this loop
with its own rounds and budget: its feed is its rank's slice, its steps all-reduce the
gradients, the loss it logs is the fleet's, and rank 0 alone writes metrics and
checkpoints (one for the fleet, with every member's data position); every member
restores from it.
"""

from __future__ import annotations

import contextlib
import math
import sys
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TextIO

import attrs

from dataflow_training.drive.components import (
    METRICS_FILE,
    TENSORBOARD_FOLDER,
    Checkpointer,
    JsonlMetrics,
    MetricsSink,
    ProgressMetrics,
    Say,
    StopRequest,
    TensorBoardMetrics,
)
from dataflow_training.drive.profiling import ProfileWindow, StepProfiler
from dataflow_training.drive.run_folder import RunFolder
from dataflow_training.step.config import (
    DtypePolicy,
    TrainConfig,
    head_chunk_tokens,
    optimizer_states,
)

if TYPE_CHECKING:
    from dataflow_training.drive.fleet import Fleet

SCHEDULES = ("cosine", "wsd", "constant")
#: the share of the steps after warmup that WSD spends decaying (the rest is stable)
WSD_DECAY_FRACTION = 0.2
#: the Perfetto trace ``trace_steps`` writes beside the run's bundle
PERFETTO_FILE = "perfetto.json"
#: losses kept in every checkpoint's manifest
HISTORY_TAIL = 100
#: a feed of this vocabulary gives byte tokens (the feeds' byte tokenizer: ids 0..255)
BYTE_VOCAB = 256


class TrainingStopped(RuntimeError):
    """The run stopped itself (a NaN/inf loss); the message says why and what is kept."""


class Interrupted(Exception):
    """A signal (``signal``: SIGINT, Ctrl-C, or SIGTERM, a job scheduler's) stopped the run
    after a step: it wrote its final checkpoint (``path``) and stopped."""

    def __init__(self, step: int, path: Path | None, signal: str = "SIGINT") -> None:
        super().__init__(f"{signal}: stopped after step {step}; checkpoint {path}")
        self.step, self.path, self.signal = step, path, signal


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
    #: the backing (pinned host) budget of the step's plan; None: unbounded
    backing_bytes: int | None = None
    device: str = "cpu"
    checkpoint_every: int | None = None
    #: a checkpoint after the first step that ends this many minutes after the last one
    #: (None: off), so that a run without ``checkpoint_every`` keeps its work too
    checkpoint_minutes: float | None = 30.0
    resume: str | None = None
    #: a new run into a folder that holds another run moves that run aside (else refused)
    overwrite: bool = False
    keep: int | None = None
    lr: float = 3e-4
    warmup: int = 0
    schedule: str = "cosine"
    min_lr_ratio: float = 0.1
    clip: float | None = 1.0
    seed: int = 0
    dtype: str = "fp32"
    #: the optimizer states' dtype (``config.STATE_DTYPES``: fp32 or bf16)
    optimizer_states: str = "fp32"
    overrides: dict[str, Any] = attrs.field(factory=dict)
    profile: ProfileWindow | None = None
    graph: bool = True
    recompute: bool = True
    trace_steps: int = 0
    order: str = "round"  # TrainConfig.order
    updates: str = "auto"  # TrainConfig.updates
    head_vocab_tiles: bool = False  # TrainConfig.head_vocab_tiles
    #: the registered resolver that runs the tasks, or "auto" (``run.resolver_for``)
    resolver: str = "auto"
    #: a Hugging Face model folder whose weights start the run (``hf_init``); its config's
    #: fields that differ from the preset's become the run's overrides
    init: str | None = None

    def train_config(self, family: Any) -> TrainConfig:
        """The step of ``family`` (the family object ``self.family`` names); the head's
        token chunk follows the budget as ``predict``'s does (``head_chunk_tokens``), 1024
        tokens without one."""
        chunk = 1024
        if self.budget_bytes is not None:
            vocab = getattr(family.config(self.preset, **self.overrides), "vocab_size", None)
            if vocab:
                chunk = head_chunk_tokens(self.budget_bytes, vocab)
        return TrainConfig(
            seq_len=self.seq_len,
            batch=self.batch,
            rounds=self.rounds,
            dtype=DtypePolicy.named(self.dtype),
            optimizer=optimizer_states(self.optimizer_states, lr=self.lr),
            chunk_tokens=chunk,
            clip=self.clip,
            grad_norm=True,
            order=self.order,
            updates=self.updates,
            head_vocab_tiles=self.head_vocab_tiles,
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


def open_feed(o: TrainOptions, rank: int = 0, world: int = 1) -> Any:
    from dataflow import feeds

    return feeds().open(
        o.data, batch=o.batch, seq_len=o.seq_len, seed=o.seed, rank=rank, world=world
    )


def budget_text(budget_bytes: int) -> str:
    from dataflow import format_size

    return "unbounded" if budget_bytes >= 2**61 else format_size(budget_bytes)


def recomputed_layers(layout: Any, *, partial: bool | None = None) -> list[str]:
    """The layers whose saved activations the step re-derives before their backward
    (its ``rec`` tasks), in layer order; with ``partial`` True (False) only those with a
    partial save's (a full recompute's) rec task in some round."""
    recomputed = {
        slot.layer
        for slot in layout.tasks.values()
        if slot.kind == "rec" and (partial is None or partial == _is_partial(slot))
    }
    return [layer.name for layer in layout.layers if layer.name in recomputed]


def _is_partial(slot: Any) -> bool:
    """Whether a rec task completes a partial save: its output is ``A_...<partial>``."""
    return "." in slot.outputs["saved"][0]


def plan_line(compiled: Any) -> str:
    """The plan line of a compiled step (``CompiledStep``): the simulator's step of the
    plan that runs and the layers its ``rec`` tasks re-derive."""
    from dataflow import format_size

    p = compiled.predicted()
    layout = compiled.layout  # the plan the engine runs: the recompute planner chose it
    recomputed = ", ".join(recomputed_layers(layout)) or "none"
    partial = recomputed_layers(layout, partial=True)
    if partial:
        recomputed += f" (saved partially: {', '.join(partial)})"
    return (
        f"plan: {compiled.program.name} on {compiled.device}: predicted "
        f"{p['step_s']:.4g} s/step, "
        f"{p['tok_s']:,.0f} tok/s; fast peak {format_size(p['fast_peak_bytes'])} of "
        f"{budget_text(compiled.planned_budget_bytes)}, slow peak "
        f"{format_size(p['slow_peak_bytes'])}; moved {format_size(p['moved_bytes'])}/step; "
        f"recomputed layers: {recomputed}"
    )


@attrs.frozen
class Started:
    """A run ready for its loop: the options (an ``--init`` run's with its overrides),
    the feed, the compiled step and its driver, the step it starts after and the losses
    so far (both from the checkpoint it resumed, if any)."""

    o: TrainOptions
    feed: Any
    compiled: Any
    run: Any
    start: int
    history: list[tuple[int, float]]


def train(
    o: TrainOptions,
    *,
    out: TextIO | None = None,
    progress: Callable[[int, int, dict[str, Any]], None] | None = None,
    fleet: Fleet | None = None,
    family: Any = None,
) -> dict[str, Any]:
    """Run ``o``; returns a summary (steps done, last loss, checkpoints). ``progress(step,
    steps, metrics)`` is called after every step. Lines go to ``out`` (default: stdout as
    it is when each is printed, so that a progress bar that took stdout over shows them).
    ``family``: the family object ``o.family`` names, when the caller has it loaded."""
    writes = fleet is None or fleet.writes

    def say(line: str) -> None:
        if writes:
            print(line, file=out or sys.stdout, flush=True)

    folder = None
    if writes:  # rank 0 alone writes the run's folder
        folder = RunFolder.claim(o.out, resume=o.resume is not None, overwrite=o.overwrite, say=say)
    try:
        return _train(o, say, writes, out, progress, fleet, family)
    finally:
        if folder is not None:
            folder.release()


def _train(
    o: TrainOptions,
    say: Say,
    writes: bool,
    out: TextIO | None,
    progress: Callable[[int, int, dict[str, Any]], None] | None,
    fleet: Fleet | None,
    family: Any,
) -> dict[str, Any]:
    """``train`` in a folder it holds."""
    from dataflow_training.drive.checkpoint import latest_checkpoint

    began = _start(o, fleet, family, say)
    o, feed, compiled, run, start, history = attrs.astuple(began, recurse=False)
    sinks = _metrics_sinks(o, start, writes, progress, say)
    profiler = _profiler(o, start, out, say)
    _say_first_steps(compiled, start < o.steps, say)
    predicted = compiled.predicted()["step_s"]
    tokens = o.batch * o.seq_len * (o.rounds if fleet is None else sum(fleet.rounds))

    def manifest_extra() -> dict[str, Any]:
        extra = {"feed": feed.state(), "history": history[-HISTORY_TAIL:], "options": _jsonable(o)}
        if fleet is not None:  # every member's data position; rank 0 writes
            extra["fleet"] = {"rounds": list(fleet.rounds), "feeds": fleet.gather(feed.state())}
        return extra

    every, keep = o.checkpoint_every, o.keep
    saver = Checkpointer(
        run,
        o.out,
        every=every,
        minutes=o.checkpoint_minutes,
        steps=o.steps,
        keep=keep,
        writes=writes,
        extra=manifest_extra,
        say=say,
    )
    stop = StopRequest()
    last: dict[str, Any] = {}
    fast_peak = 0
    traced: list[Any] = []  # the traced steps' RunResults
    makespans: list[tuple[float, bool]] = []  # every step's (makespan_us, replayed)
    try:
        for step in range(start, o.steps):
            lr = lr_at(step, o)
            batches = [feed.next() for _ in range(o.rounds)]
            tracing = step >= o.steps - o.trace_steps
            with profiler.step(step + 1) if profiler else contextlib.nullcontext():
                stats = run.step(batches, lr, dispatch=tracing)
            result = run.last_result
            makespans.append((result.makespan_us, result.steps[-1].replayed))
            if tracing:
                traced.append(result)
            if fleet is not None:  # the loss of every round in the fleet
                stats = attrs.evolve(stats, loss=fleet.mean_loss(stats.losses))
            if not math.isfinite(stats.loss) or not all(math.isfinite(x) for x in stats.losses):
                kept = latest_checkpoint(o.out)
                raise TrainingStopped(
                    f"step {step + 1}: the loss is {stats.loss} (not finite); stopped "
                    f"without saving; the last checkpoint ({kept or 'none'}) is kept"
                )
            history.append((step + 1, stats.loss))
            last = _metrics(step + 1, stats, lr, tokens, predicted)
            for sink in sinks:
                sink.write(step + 1, last)
            fast_peak = max(fast_peak, stats.fast_peak_bytes)
            save, halt = saver.due(step + 1) or stop.save, stop.stop
            if fleet is not None:  # every member decides alike: a checkpoint is a collective
                asked = fleet.gather((save, halt))
                save = any(s for s, _ in asked)
                halt = next((h for _, h in asked if h is not None), None)
            if save:
                saver.save(step + 1)
                stop.save = False
                if fleet is None:  # a signal that came while it wrote: stop here, not a step on
                    halt = stop.stop
            if halt is not None:
                raise Interrupted(step + 1, saver.at(step + 1), halt)
        if traced and writes:
            say(write_run_bundle(run, o.out, traced, makespans))
    finally:
        stop.close()
        if profiler is not None:
            profiler.close()
        for sink in sinks:
            sink.close()
        # the checkpoints hold the state: copying it out of the engine beside the pinned
        # pool would need the model's state twice in host memory
        run.close(keep_state=False)
    return {
        "steps": o.steps,
        "start": start,
        "first": history[0] if history else None,
        "last": last,
        "checkpoints": saver.saved,
        "fast_peak_bytes": fast_peak,
        "budget_bytes": o.budget_bytes,
        "trace": None if profiler is None or not profiler.steps else o.profile.trace_path,
    }


def _start(o: TrainOptions, fleet: Fleet | None, family: Any, say: Say) -> Started:
    """Open the feed, compile the step, build its driver and resume it when asked; say
    what the run is (data, init, the checkpoint it resumes, the plan)."""
    from dataflow_training.drive.checkpoint import intact_checkpoint
    from dataflow_training.drive.run import TrainingRun, resolver_for
    from dataflow_training.plan.compiled_step import compile_step
    from dataflow_training.step.family import load_family

    resumed = None
    if o.resume is not None:
        resumed = intact_checkpoint(o.out, say) if o.resume == "auto" else Path(o.resume)
    if family is None:  # the one load of the run: passed down from here
        family = load_family(o.family)
    init = None
    if o.init is not None:
        o, init = _with_init(o, family)
    feed = open_feed(o) if fleet is None else open_feed(o, fleet.rank, fleet.world)
    if o.device.startswith("cuda"):  # tens of seconds for a large model: say what is under way
        say(
            f"profiling: each task of the step timed on {o.device}, then planned (the "
            "profile cache keeps the timings: a later run of these shapes skips them)"
        )
    compiled = compile_step(
        family,
        o.preset,
        o.train_config(family),
        overrides=o.overrides,
        budget_bytes=o.budget_bytes,
        backing_bytes=o.backing_bytes,
        device=o.device,
        graph=o.graph,
        recompute=o.recompute,
        resolver=resolver_for(o.resolver, o.device),
        grad_share=None if fleet is None else fleet.share,
        links=fleet_links(fleet, o.device),
    )
    run = TrainingRun(
        compiled,
        seed=o.seed,
        # a resumed run's weights come from its checkpoint: the folder's are not read
        state=_init_weights(o, init, family) if init is not None and resumed is None else None,
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
    if resumed is not None:
        try:
            manifest = run.restore(resumed, loose=() if fleet is None else ("rounds",))
        except ValueError as exc:  # another run's checkpoint: say how that run started
            raise type(exc)(f"{exc}{_init_hint(resumed, o)}") from None
        if fleet is not None:
            feed.restore(_fleet_feed_state(manifest, fleet, resumed))
        elif "feed" in manifest:
            feed.restore(manifest["feed"])
        start = int(manifest["step"])
        history = [tuple(x) for x in manifest.get("history", [])]
    say(f"data: {feed.describe()}")
    if init is not None:
        say(init.line if resumed is None else f"init: {o.init} not read (the run resumes)")
        tokenizer = Path(o.init) / "tokenizer.json"
        if vocab == BYTE_VOCAB and tokenizer.is_file():  # a real model fed bytes: say so
            say(
                f"warning: --data {o.data} gives byte tokens (ids 0-255), not those of "
                f"{tokenizer}; for the model's own: dataflow data prepare --text PATH "
                f"--tokenizer {tokenizer} -o DIR, then --data shards:DIR"
            )
    if resumed is not None:
        say(f"resumed from {resumed} (step {start})")
    say(plan_line(compiled))
    if compiled.pool_note is not None:
        say(compiled.pool_note)
    return Started(o, feed, compiled, run, start, history)


def _metrics_sinks(
    o: TrainOptions,
    start: int,
    writes: bool,
    progress: Callable[[int, int, dict[str, Any]], None] | None,
    say: Say,
) -> list[MetricsSink]:
    """``metrics.jsonl`` and TensorBoard (where this process writes), and the progress
    callback; says where the metrics go."""
    sinks: list[MetricsSink] = []
    if writes:
        jsonl = JsonlMetrics(o.out / METRICS_FILE, start)
        board = TensorBoardMetrics.open(o.out / TENSORBOARD_FOLDER, start)
        sinks.append(jsonl)
        if board is None:
            say(f"metrics: {jsonl.path} (pip install tensorboard for TensorBoard events)")
        else:
            sinks.append(board)
            say(f"metrics: {jsonl.path}; TensorBoard events in {board.log_dir}")
    if progress is not None:
        sinks.append(ProgressMetrics(progress, o.steps))
    return sinks


def _profiler(o: TrainOptions, start: int, out: TextIO | None, say: Say) -> StepProfiler | None:
    """The profiler window of ``--profile`` (None without one), said."""
    if o.profile is None:
        return None
    profiler = StepProfiler(o.profile, o.device, out, o.graph)
    if start >= o.profile.stop:
        say(
            f"profile: steps {o.profile.start}-{o.profile.stop} ran before step {start}, "
            "where this run resumes: nothing to trace"
        )
    else:
        say(profiler.describe())
    return profiler


def _say_first_steps(compiled: Any, steps_left: bool, say: Say) -> None:
    """On CUDA, what makes the first steps slow (the load, compiling, the graph capture)."""
    if not compiled.device.startswith("cuda") or not steps_left:
        return
    from dataflow import format_size

    pool = format_size(compiled.pinned_bytes)
    slow = [f"the engine loads (a slow pool of {pool} page-locked)"]
    if compiled.resolver == "torch-compiled":
        slow.append("each block kind compiles")
    if compiled.graph:
        slow.append("the second step is captured into a CUDA graph")
    say(f"first steps: {', '.join(slow)}; they take longer than the rest")


def _metrics(step: int, stats: Any, lr: float, tokens: int, predicted: float) -> dict[str, Any]:
    """A step's line of ``metrics.jsonl``."""
    return {
        "step": step,
        "loss": stats.loss,
        "lr": lr,
        "grad_norm": stats.grad_norm,
        "tok_s": tokens / stats.step_s if stats.step_s > 0 else None,
        "step_s": stats.step_s,
        "predicted_step_s": predicted,
        "fast_peak_bytes": stats.fast_peak_bytes,
        "allocator_peak_bytes": stats.allocator_peak_bytes,
    }


def write_run_bundle(
    run: Any, folder: Path, traced: list[Any], makespans: list[tuple[float, bool]]
) -> str:
    """Write the run's bundle with the traced steps' measured timeline, and its Perfetto
    trace, into ``folder``; return the line that says so."""
    from dataflow import write_bundle
    from dataflow.cli import write_perfetto
    from dataflow_training.drive.export import run_bundle

    write_bundle(folder, run_bundle(run, traced, makespans))
    return f"bundle: {folder} ({len(traced)} traced step(s)); " + write_perfetto(
        str(folder), str(folder / PERFETTO_FILE)
    )


def _fleet_feed_state(manifest: dict[str, Any], fleet: Any, path: Path) -> Any:
    """This member's data position in a fleet checkpoint; a checkpoint of another fleet
    shape (or of one process) is an error naming ``--rounds``."""
    recorded = manifest.get("fleet")
    world = len(recorded["rounds"]) if recorded else 1
    if recorded is None or world != fleet.world:
        raise ValueError(
            f"checkpoint {path} was written by {world} member(s); this fleet has "
            f"{fleet.world} (--rounds {','.join(map(str, fleet.rounds))}); resume it with "
            "as many members"
        )
    return recorded["feeds"][fleet.rank]


def _with_init(o: TrainOptions, family: Any) -> tuple[TrainOptions, Any]:
    """``o`` with the overrides that make its preset the ``init`` folder's config, and the
    folder's ``HFStart`` (``hf_init``)."""
    from dataflow_training.drive.hf_init import InitError, hf_overrides

    if o.overrides:
        raise InitError(
            f"--init {o.init}: the folder's config.json sets the run's overrides; "
            f"{sorted(o.overrides)} were given too"
        )
    init = hf_overrides(family, o.family, o.preset, o.init)
    return attrs.evolve(o, overrides=init.overrides), init


def _init_hint(checkpoint: Path, o: TrainOptions) -> str:
    """``; that run started with --init X`` when the checkpoint's run had another ``--init``
    than ``o`` (its overrides came from that folder's config.json), else nothing."""
    from dataflow_training.drive.checkpoint import resumed_options

    found = resumed_options(o.out, str(checkpoint))
    if found is None:
        return ""
    theirs = found[1].get("init")
    if theirs == o.init:
        return ""
    return f"; that run started with --init {theirs}" if theirs else "; that run had no --init"


def _init_weights(o: TrainOptions, init: Any, family: Any) -> Any:
    """The ``init`` folder's weights, in the run's parameter dtype."""
    import torch

    from dataflow_training.drive.hf_init import hf_weights

    dtype = getattr(torch, DtypePolicy.named(o.dtype).param)
    return hf_weights(family, init, dtype)


def _jsonable(o: TrainOptions) -> dict[str, Any]:
    return attrs.asdict(o, value_serializer=lambda _c, _f, v: str(v) if isinstance(v, Path) else v)


def elapsed_eta(started: float, done: int, total: int) -> float:
    """Seconds left at the pace so far."""
    spent = time.perf_counter() - started
    return spent / max(done, 1) * max(total - done, 0)


#: The hardware entry whose collective link prices a GPU fleet's all-reduce (the links to
#: pinned host memory are measured on the device; the collective link is not yet).
FLEET_HARDWARE = "h200"


def fleet_links(fleet: Any, device: str) -> Any:
    """A GPU fleet's step is planned with the collective link of the hardware table, for
    its size and scope (one host or several); on CPUs the lowering's assumed link."""
    if fleet is None or not device.startswith("cuda"):
        return None
    from dataflow import Links
    from dataflow_training.plan.hardware import hardware

    return Links(collective=hardware(FLEET_HARDWARE).collective_link(fleet.world, fleet.scope))
