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
with its own rounds and budget: it reads the one-process stream and keeps the rounds dealt
to it (``fleet.DealtFeed``), its steps all-reduce the gradients, the loss it logs is the
fleet's, and rank 0 alone writes metrics and checkpoints (one for the fleet); every member
restores from it. The data position in a checkpoint is the one process's, so a run resumes
with another world size or split, or as one process, reading on where it stopped.
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
import torch

from dataflow import Links, format_size, write_bundle
from dataflow.cli import write_perfetto
from dataflow_training.drive.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    intact_checkpoint,
    latest_checkpoint,
    read_manifest,
    resumed_options,
)
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
from dataflow_training.drive.evaluation import evaluator_of
from dataflow_training.drive.export import run_bundle
from dataflow_training.drive.fleet import DealtFeed
from dataflow_training.drive.hf_init import InitError, hf_overrides, hf_weights
from dataflow_training.drive.options import TrainOptions, feed_shape, open_feed
from dataflow_training.drive.phases import (
    Phase,
    PhasedRun,
    check_phases,
    phase_at,
    run_phases,
)
from dataflow_training.drive.profiling import StepProfiler
from dataflow_training.drive.run import TrainingRun
from dataflow_training.drive.run_folder import RunFolder
from dataflow_training.drive.schedule import LrSchedule, stored_schedule
from dataflow_training.drive.schedule import resumed as schedule_on_resume
from dataflow_training.drive.step_search import search_for
from dataflow_training.drive.tokenizer import is_byte_level, keep_tokenizer
from dataflow_training.drive.vocabulary import VocabError, choose_vocab
from dataflow_training.plan.hardware import hardware
from dataflow_training.step.family import load_family
from dataflow_training.step.freezing import parameter_counts
from dataflow_training.step.precision import NAMES

if TYPE_CHECKING:
    from dataflow_training.drive.fleet import Fleet

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


def budget_text(budget_bytes: int) -> str:

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
    plan that runs, the parameters (total and trainable) and the layers its ``rec`` tasks
    re-derive."""

    p = compiled.predicted()
    layout = compiled.layout  # the plan the engine runs: the recompute planner chose it
    recomputed = ", ".join(recomputed_layers(layout)) or "none"
    partial = recomputed_layers(layout, partial=True)
    if partial:
        recomputed += f" (saved partially: {', '.join(partial)})"
    return (
        f"plan: {compiled.program.name} on {compiled.priced_for}: predicted "
        f"{p['step_s']:.4g} s/step, "
        f"{p['tok_s']:,.0f} tok/s; fast peak {format_size(p['fast_peak_bytes'])} of "
        f"{budget_text(compiled.planned_budget_bytes)}, slow peak "
        f"{format_size(p['slow_peak_bytes'])}; moved {format_size(p['moved_bytes'])}/step; "
        f"{parameters_text(compiled.running.layers)}; recomputed layers: {recomputed}"
    )


def parameters_text(layers: Any) -> str:
    """``parameters 1.2M (trainable 0.3M)`` of a lowered step's layers (``freezing``)."""
    total, trainable = parameter_counts(layers)
    return f"parameters {_count(total)} (trainable {_count(trainable)})"


def _count(n: int) -> str:
    for size, unit in ((10**9, "B"), (10**6, "M"), (10**3, "K")):
        if n >= size:
            return f"{n / size:.4g}{unit}"
    return str(n)


def packed_attention_warning(o: TrainOptions) -> str | None:
    """The line a packed run on CUDA replayed from a CUDA graph gets: its attention runs
    the memory-efficient kernel with a per-row bias there (flash's varlen kernels read the
    documents' layout on the host, which a graph cannot), far slower than the dense step's
    (``benchmarks/probes/segments_attention.py``); None for any other run."""
    if not (o.pack_documents and o.graph and o.device.startswith("cuda")):
        return None
    return (
        "warning: --pack-documents with --graph on CUDA: the replayed step's attention runs "
        "the masked memory-efficient kernel (14-23x slower than flash's varlen kernels at "
        "2 x 4096 tokens on an H100); --no-graph takes the varlen kernels"
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
    schedule: LrSchedule
    #: what made the data's token ids, as each checkpoint records it (``drive.tokenizer``)
    tokenizer: dict[str, Any] | None = None


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

    began = _start(o, fleet, family, say)
    o, feed, compiled, run, start, history, schedule, tokenizer = attrs.astuple(
        began, recurse=False
    )
    rounds = _step_rounds(o, fleet)
    owned = range(o.rounds) if fleet is None else fleet.owned
    dealt = DealtFeed(feed, rounds, owned, documents=o.pack_documents)
    sinks = _metrics_sinks(o, start, writes, progress, say)
    profiler = _profiler(o, start, out, say)
    _say_first_steps(compiled, start < o.steps, say)
    evaluator = evaluator_of(o, compiled, fleet)
    if evaluator is not None:
        say(evaluator.line())
    tokens = o.batch * o.seq_len * rounds
    # the options of one process that runs the fleet's step: what a resume takes
    options = _jsonable(attrs.evolve(o, rounds=rounds))

    def manifest_extra() -> dict[str, Any]:
        # the feed is the one-process stream's position, the same on every member
        extra = {"feed": feed.state(), "history": history[-HISTORY_TAIL:], "options": options}
        extra["schedule"] = schedule.to_json()
        if fleet is not None:
            extra["fleet"] = {"rounds": list(fleet.rounds)}
        extra["tokenizer"] = tokenizer
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
            lr = schedule.lr_at(step)
            batches = dealt.next_step()
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
            predicted = run.compiled.predicted()["step_s"]  # the phase's own step
            last = _metrics(step + 1, stats, lr, tokens, predicted)
            if evaluator is not None and evaluator.due(step + 1):
                last |= evaluator.evaluate(run.host_weights())
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
            say(write_run_bundle(run.current, o.out, traced, makespans))
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

    resumed, manifest = None, None
    if o.policy.name in NAMES:  # the policy auto chose, recorded: a resume keeps it
        o = attrs.evolve(o, precision=o.policy.name)
    if o.resume is not None:
        resumed = intact_checkpoint(o.out, say) if o.resume == "auto" else Path(o.resume)
    if resumed is not None:  # --resume auto in a folder of no checkpoint: a fresh start
        manifest = read_manifest(resumed)  # read once: the schedule and the vocabulary
    schedule, schedule_line = LrSchedule.of(o), None
    if resumed is not None:  # before the compile: a refused change is said at once
        schedule, schedule_line = _resumed_schedule(resumed, manifest, o)
    if family is None:  # the one load of the run: passed down from here
        family = load_family(o.family)
    init = None
    if o.init is not None:
        o, init = _with_init(o, family)
    feed = open_feed(o)  # every member reads the one-process stream
    if o.pack_documents and getattr(feed, "documents", None) is None:
        raise ValueError(
            f"--pack-documents: {o.data} marks no documents (its feed gives no "
            "next_documents: bytes shards, or shards of a tokenizer without "
            "<|endoftext|>); see docs/feeds.md"
        )
    o, vocab_note = _with_vocab(o, family, feed, init, manifest)
    if manifest is not None:
        o = _with_kept_shards(o, manifest)
    if o.device.startswith("cuda"):  # tens of seconds for a large model: said before the
        # search, which profiles first
        say(
            f"profiling: each task of the step timed on {o.device}, then planned (the "
            "profile cache keeps the timings: a later run of these shapes skips them)"
        )
    phases = run_phases(o.freeze, o.phases, family)
    check_phases(phases, family, o.preset, o.overrides)
    if o.search:  # the step's shape, chosen for the model the vocabulary makes, as the
        # first phase trains it (its freeze and config fields)
        opened, first = feed_shape(o), phases[0]
        chosen, searched = search_for(
            attrs.evolve(o, freeze=first.freeze, overrides=first.overrides(o.overrides)), family
        )
        shards = chosen.overrides.get("expert_shards")  # the search's choice, a model override
        kept = o.overrides if shards is None else {**o.overrides, "expert_shards": shards}
        o = attrs.evolve(chosen, freeze=o.freeze, overrides=kept)
        say(searched.line())
        if feed_shape(o) != opened:
            feed = open_feed(o)

    def compile_phase(phase: Phase) -> Any:
        """The step of ``phase`` (its freeze and config fields), of the run's shape."""
        return attrs.evolve(o, freeze=phase.freeze, overrides=phase.overrides(o.overrides)).compile(
            family,
            recompute=o.recompute,
            grad_share=None if fleet is None else fleet.share,
            links=fleet_links(fleet, o.device),
        )

    phase = phase_at(phases, int(manifest["step"]) if manifest is not None else 0)
    if manifest is not None and manifest.get("phase", 0) == phase - 1:
        if phases[phase].start == int(manifest["step"]):  # saved at the boundary, by the
            phase -= 1  # phase before it: resumed in it, the next step enters the next
    if manifest is not None and manifest.get("phase", 0) != phase:
        raise CheckpointError(
            f"checkpoint {resumed} is of phase {manifest.get('phase', 0) + 1}; this run's "
            f"phases put its step {manifest['step']} in phase {phase + 1} (give the run's "
            "--freeze and --phase)"
        )
    compiled = compile_phase(phases[phase])
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
    writes = fleet is None or fleet.writes
    record = keep_tokenizer(feed, o.out, resumed=resumed is not None, writes=writes)
    history: list[tuple[int, float]] = []
    start = 0
    if resumed is not None:
        try:
            # a member's own rounds may differ from the writer's: the step's are checked
            manifest = run.restore(resumed, loose=("rounds",))
        except ValueError as exc:  # another run's checkpoint: say how that run started
            raise type(exc)(f"{exc}{_init_hint(resumed, o)}") from None
        position = _resumed_position(manifest, _step_rounds(o, fleet), resumed)
        if position is not None:
            feed.restore(position)
        start = int(manifest["step"])
        history = [tuple(x) for x in manifest.get("history", [])]
    if fleet is not None:
        fleet.check_stream(feed.state())
    packed = f"; documents packed apart ({feed.documents})" if o.pack_documents else ""
    say(f"data: {feed.describe()}" + (f"; {vocab_note}" if vocab_note else "") + packed)
    if (warning := packed_attention_warning(o)) is not None:
        say(warning)
    if init is not None:
        say(init.line if resumed is None else f"init: {o.init} not read (the run resumes)")
        tokenizer = Path(o.init) / "tokenizer.json"
        if vocab == BYTE_VOCAB and tokenizer.is_file() and not is_byte_level(tokenizer):
            # a real model fed bytes: say so
            say(
                f"warning: --data {o.data} gives byte tokens (ids 0-255), not those of "
                f"{tokenizer}; for the model's own: dataflow data prepare --text PATH "
                f"--tokenizer {tokenizer} -o DIR, then --data shards:DIR"
            )
    if resumed is not None:
        say(f"resumed from {resumed} (step {start})")
    if schedule_line is not None:
        say(schedule_line)
    if len(phases) > 1:
        say(f"phase {phase + 1} of {len(phases)}, {phases[phase].describe()}")
    say(f"{plan_line(compiled)}; {o.policy.describe(o.optimizer)}")
    if compiled.pool_note is not None:
        say(compiled.pool_note)
    run = PhasedRun(run, phases, compile_phase, say, plan_line, phase)
    return Started(o, feed, compiled, run, start, history, schedule, record)


def _resumed_schedule(
    checkpoint: Path, manifest: dict[str, Any], o: TrainOptions
) -> tuple[LrSchedule, str | None]:
    """The lr schedule a run resumed from ``checkpoint`` (whose ``manifest`` is given)
    follows, and the line that says what it does (``schedule.resumed``)."""
    try:
        stored = stored_schedule(manifest, o)
    except (TypeError, ValueError, KeyError) as exc:
        raise CheckpointError(
            f"checkpoint file {checkpoint / MANIFEST_FILE} is corrupt: its schedule does not "
            f"read ({exc})"
        ) from None
    return schedule_on_resume(stored, o, int(manifest["step"]), o.reset_schedule)


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

    write_bundle(folder, run_bundle(run, traced, makespans))
    return f"bundle: {folder} ({len(traced)} traced step(s)); " + write_perfetto(
        str(folder), str(folder / PERFETTO_FILE)
    )


def _step_rounds(o: TrainOptions, fleet: Fleet | None) -> int:
    """The rounds of a step: this process's, or the fleet's in all."""
    return o.rounds if fleet is None else sum(fleet.rounds)


def _resumed_position(manifest: dict[str, Any], rounds: int, path: Path) -> Any:
    """The feed position a checkpoint continues from (None: it kept none). Its step must
    have had ``rounds`` rounds in all, in one process or over a fleet of any split; a
    checkpoint of a fleet whose members read their own slices of the feed (``fleet.feeds``:
    before the fleet dealt one stream) has no position in the stream. Either is an error
    naming the checkpoint."""
    recorded = manifest.get("fleet")
    if isinstance(recorded, dict) and "feeds" in recorded:
        raise ValueError(
            f"checkpoint {path} was written by a fleet whose members read their own slices "
            "of the data; its data position does not continue the one-process stream "
            "the fleet reads now: start a new run (another --out), or resume it with the "
            "dataflow that wrote it"
        )
    theirs = sum(recorded["rounds"]) if recorded else int(manifest["train"]["rounds"])
    if theirs != rounds:
        split = f" (--rounds {','.join(map(str, recorded['rounds']))})" if recorded else ""
        raise ValueError(
            f"checkpoint {path}: its steps ran {theirs} rounds{split}; this run's have "
            f"{rounds}: resume with {theirs} rounds in all (--ga-rounds {theirs}, or a fleet's "
            "--rounds adding up to it)"
        )
    return manifest.get("feed")


def _with_init(o: TrainOptions, family: Any) -> tuple[TrainOptions, Any]:
    """``o`` with the overrides that make its preset the ``init`` folder's config, and the
    folder's ``HFStart`` (``hf_init``)."""

    given = {k: v for k, v in o.overrides.items() if k not in TRAINING_OVERRIDES}
    if given:
        raise InitError(
            f"--init {o.init}: the folder's config.json sets the run's overrides; "
            f"{sorted(given)} were given too"
        )
    init = hf_overrides(family, o.family, o.preset, o.init)
    training = {k: v for k, v in o.overrides.items() if k in TRAINING_OVERRIDES}
    return attrs.evolve(o, overrides={**init.overrides, **training}), init


#: Model overrides that are training settings, not the model's (no HF config carries
#: them): they go with ``--init``, and a resumed run keeps its checkpoint's unless given
#: (``_with_kept_shards``)
TRAINING_OVERRIDES = ("expert_shards",)


def _with_kept_shards(o: TrainOptions, manifest: dict[str, Any]) -> TrainOptions:
    """``o`` with the resumed run's expert shards where ``--expert-shards`` is not given
    (another count given is the run's from here: the restore cuts the optimizer state
    again, ``TrainingRun.restore``)."""
    theirs = (manifest.get("overrides") or {}).get("expert_shards")
    if theirs is None or "expert_shards" in o.overrides:
        return o
    return attrs.evolve(o, overrides={**o.overrides, "expert_shards": theirs})


def _with_vocab(
    o: TrainOptions, family: Any, feed: Any, init: Any, manifest: dict[str, Any] | None
) -> tuple[TrainOptions, str]:
    """``o`` with the model's vocabulary in its overrides where it is not the preset's
    (``vocabulary.choose_vocab``; a resumed run keeps its checkpoint's), and what the
    ``data:`` line says of it."""
    preset_vocab = getattr(family.config(o.preset), "vocab_size", None)
    if preset_vocab is None:  # a family without the field: its own vocabulary
        if o.vocab_size is not None:
            raise VocabError(f"--vocab-size: family {o.family!r} has no vocab_size to set")
        return o, ""
    init_vocab = None if init is None else init.config.vocab_size
    kept = None
    if manifest is not None:  # the resumed checkpoint's: its overrides on the preset's
        overrides = manifest.get("overrides") or {}
        kept = overrides.get("vocab_size", preset_vocab)
    vocab = choose_vocab(
        preset_vocab, feed, o.data, given=o.vocab_size, init_vocab=init_vocab, kept=kept
    )
    if init is None and vocab.size != preset_vocab:
        o = attrs.evolve(o, overrides={**o.overrides, "vocab_size": vocab.size})
    return o, vocab.note


def _init_hint(checkpoint: Path, o: TrainOptions) -> str:
    """``; that run started with --init X`` when the checkpoint's run had another ``--init``
    than ``o`` (its overrides came from that folder's config.json), else nothing."""

    found = resumed_options(o.out, str(checkpoint))
    if found is None:
        return ""
    theirs = found[1].get("init")
    if theirs == o.init:
        return ""
    return f"; that run started with --init {theirs}" if theirs else "; that run had no --init"


def _init_weights(o: TrainOptions, init: Any, family: Any) -> Any:
    """The ``init`` folder's weights, in the run's parameter dtype."""

    dtype = getattr(torch, o.policy.dtype.param)
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

    return Links(collective=hardware(FLEET_HARDWARE).collective_link(fleet.world, fleet.scope))
