"""``TrainingRun``: the driver that runs one compiled step on the engine, update by update.

    step = compile_step("gpt2", "gpt2_tiny", TrainConfig(seq_len=64, batch=8), budget_bytes=...)
    run = TrainingRun(step)
    stats = run.step([(tokens, targets)], lr=3e-4)     # one optimizer update
    run.save("ckpt/step_000001"); run.restore("ckpt/step_000001")

The step was lowered, planned and placed once (``compile_step``); the run loads the
engine with that placement once (lazily, at the first step, because the engine takes the
first step's data with the start values). Every later step feeds only the rounds' tokens
and targets; weights and optimizer state stay where the plan leaves them between steps.
The learning rate and the optimizer's step count go in through ``Engine.run(values=...)``:
``lr`` and ``update`` (the number of updates so far + 1, so a restored run's bias
correction continues where the saved one stopped).

The model state is ``{"<layer>.<param>": tensor}`` (the reference model's ``state_dict``
keys); the optimizer state is kept raw, as the packed ``O_*`` objects' bytes (laid out
for the state's shapes: a padded vocabulary table's real rows, ``values.state_layouts``),
because only this program's layout reads it. ``dataflow verify``, ``dataflow train`` and the
fleet share this class.
"""

from __future__ import annotations

import gc
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import attrs
import torch

from dataflow import Engine, PlanningError, format_size, resolvers
from dataflow_training.drive.checkpoint import (
    package_versions,
    plan_hash,
    read_checkpoint,
    set_rng_state,
    train_dict,
    train_from_dict,
    write_checkpoint,
)
from dataflow_training.drive.values import (
    StartValues,
    data_values,
    opt_for_state,
    opt_for_step,
    read_state,
    recut_opt,
    state_layouts,
)
from dataflow_training.kit.lora import init_adapters
from dataflow_training.kit.lora_base import stored_base
from dataflow_training.kit.segments import Segments
from dataflow_training.plan.compiled_step import (
    HOST_RESERVE_BYTES,
    CompiledStep,
    available_host_bytes,
    compile_step,
)
from dataflow_training.step.config import OMITTED_DEFAULTS
from dataflow_training.step.family import Family
from dataflow_training.step.lowering import lower

#: one round's data: ``(tokens, targets)``, or ``(tokens, targets, segments)`` (a
#: ``kit.Segments``, or None for one sequence per row) for a step with segments
Batch = tuple[Any, ...]


#: ``resolver_for``'s choice for "auto" on CUDA: each block kind's math compiled, what the
#: throughput rows of docs/throughput.md run (compare.py --resolver torch-compiled)
CUDA_RESOLVER = "torch-compiled"


def resolver_for(name: str, device: str) -> str:
    """The registered resolver ``name`` names for ``device``: "auto" is ``CUDA_RESOLVER`` on
    CUDA where it is installed, else ``torch`` (eager: the compiled resolver is made for
    CUDA, and on a CPU compiling a small model's tasks takes longer than its steps). A
    name that is not registered is a ValueError naming the known ones."""

    known = [spec.name for spec in resolvers()]
    if name == "auto":
        return CUDA_RESOLVER if device.startswith("cuda") and CUDA_RESOLVER in known else "torch"
    if name not in known:
        raise ValueError(
            f"--resolver {name!r}: not a registered resolver; known: auto, {', '.join(known)}"
        )
    return name


#: TrainConfig fields a step takes as a value (``step(lr=...)``: the run's lr schedule), not
#: part of the step a checkpoint must match: a resume may start a new schedule
PER_STEP = ("train.optimizer.lr",)
#: Fields a resume may change: how the same parameters are cut in pieces, the optimizer
#: state cut again to match (``RowPieces``' tables, ``kit.moe.expert_shards``)
RECUT = ("train.vocab_pieces", "overrides.expert_shards")
#: A checkpoint's optimizer state is kept as its run kept it (fp32, bf16 or int8 moments;
#: ``--optimizer-states``, ``--precision``): a resume in another form is refused, not
#: converted, with this said after the differing field
_STATE_FIELDS = ("train.optimizer.name", "train.optimizer.state_dtypes")
_STATE_HINT = (
    "; its optimizer state resumes only as it was kept: give the checkpoint's "
    "--optimizer-states/--precision (or none: a resume takes the run's), or start a new run"
)


def _differences(theirs: Any, ours: Any, path: str) -> list[tuple[str, Any, Any]]:
    """``(dotted path, theirs, ours)`` of every value that differs between two manifest
    fields, nested mappings compared key by key (a missing key is None)."""
    if isinstance(theirs, Mapping) and isinstance(ours, Mapping):
        found = []
        for key in sorted(set(theirs) | set(ours), key=str):
            found += _differences(theirs.get(key), ours.get(key), f"{path}.{key}")
        return found
    return [] if theirs == ours else [(path, theirs, ours)]


def _reference_state(
    family: Family, config: Any, seed: int, dtype: torch.dtype
) -> dict[str, torch.Tensor]:
    """The family reference model's initial state under ``seed``, in ``dtype``. The
    float32 model's tensors are dropped one by one as their copies are made, so the host
    holds the float32 model and little more, not the float32 model beside its whole copy
    (for an 8B model that is 32 GB, not 48)."""

    torch.manual_seed(seed)
    model = family.reference_model(config)
    state = model.state_dict()
    del model
    gc.collect()  # a module in a reference cycle would keep its parameters otherwise
    weights = {}
    for key in list(state):
        weights[key] = state.pop(key).detach().to(dtype, copy=True)
    return weights


@attrs.frozen
class StepStats:
    """What one ``TrainingRun.step`` did. ``step`` counts updates before this one (the
    first step is 0); ``losses`` one per round; ``grad_norm`` the global gradient norm
    before clipping (None when the step does not measure it); ``step_s`` the wall time of
    the engine run and the read-back."""

    step: int
    losses: tuple[float, ...]
    loss: float
    lr: float
    grad_norm: float | None
    step_s: float
    fast_peak_bytes: int
    allocator_peak_bytes: int | None


class TrainingRun:
    """The driver of one ``CompiledStep`` (``compiled``): one optimizer update per
    ``step``.

    ``state`` is the initial model state (default: the family's reference model
    initialised under ``seed``). The engine is loaded with the compiled placement at the
    first step, after ``check_backing`` refused a slow pool the host cannot page-lock.
    After a step, ``last_result`` is the engine's ``RunResult`` of it (task spans,
    transfers, peaks: what benchmarks read); None before the first step.
    """

    def __init__(
        self,
        compiled: CompiledStep,
        *,
        seed: int = 0,
        state: Mapping[str, torch.Tensor] | None = None,
    ) -> None:
        self.compiled, self.seed = compiled, seed
        self.train, self.device = compiled.train, compiled.device
        running = compiled.running
        self._data_objects = running.layout.data_objects()
        self._losses = running.layout.losses()
        self.grad_norms = running.layout.grad_norms()
        self.updates = 0  # optimizer updates done so far
        dtype = getattr(torch, self.train.dtype.param)
        # a copy in the step's dtypes: a LoRA base quantized here, at load (kit.lora_base)
        self._weights: dict[str, torch.Tensor] | None = stored_base(
            running.layers,
            _reference_state(compiled.family, compiled.config, seed, dtype)
            if state is None
            else state,
            dtype,
        )
        if self.train.lora is not None:  # a base's state: its adapters start as PEFT's do
            init_adapters(running.layers, self._weights, seed, dtype)
        self._opt_state: dict[str, torch.Tensor] | None = None
        self._engine: Any = None
        self._lost: str | None = None  # why the state is gone (a failed engine load)
        self.last_result: Any = None

    @classmethod
    def of(
        cls,
        family: str | Family,
        preset: str,
        train: Any,
        *,
        seed: int = 0,
        state: Mapping[str, torch.Tensor] | None = None,
        **options: Any,
    ) -> TrainingRun:
        """The run of ``compile_step(family, preset, train, **options)``."""

        return cls(compile_step(family, preset, train, **options), seed=seed, state=state)

    @property
    def vocab_size(self) -> int:
        return self.compiled.vocab_size

    def step(
        self, batches: Sequence[Batch], lr: float | None = None, *, dispatch: bool = False
    ) -> StepStats:
        """One optimizer update over ``batches``, one ``(tokens, targets)`` per
        accumulation round, each int64 of shape (batch, seq_len); a step lowered with
        segments (``TrainConfig.segments``) takes ``(tokens, targets, segments)``, the
        segments a ``kit.Segments`` of that shape (None: one sequence per row, positions
        from 0), checked here, once, before the step's tasks read them. ``lr`` defaults to the
        optimizer policy's; ``dispatch`` runs the step task by task even where a CUDA
        graph would replay it (``Engine.run``), so that ``last_result`` times every task."""
        batches = self._checked(batches)
        lr = self.train.optimizer.lr if lr is None else float(lr)
        values = {"lr": lr, "update": self.updates + 1}
        if self.compiled.fleet:
            values["fleet"] = 1
        started = time.perf_counter()
        if self._engine is None:
            self._load(batches)
            result = self._engine.run(values=values)
        else:
            result = self._engine.run(
                values=values, feed=lambda _step: self._data(batches), dispatch=dispatch
            )
        self.last_result = result
        # the losses and gradient norms of the step, fetched from the device together
        names = self._losses
        read = self._engine.read_scalars([*names, *self.grad_norms])
        losses = tuple(read[: len(names)])
        grad_norm = None
        if self.grad_norms:
            grad_norm = sum(read[len(names) :]) ** 0.5
        step_s = time.perf_counter() - started
        self.updates += 1
        return StepStats(
            self.updates - 1,
            losses,
            sum(losses) / len(losses),
            lr,
            grad_norm,
            step_s,
            result.fast_peak_bytes,
            result.allocator_peak_bytes,
        )

    def _checked(self, batches: Sequence[Batch]) -> list[Batch]:
        each = "(tokens, targets, segments)" if self.train.segments else "(tokens, targets)"
        if len(batches) != self.train.rounds:
            raise ValueError(
                f"step got {len(batches)} batch(es); the step has {self.train.rounds} "
                f"accumulation round(s), one {each} each"
            )
        shape = (self.train.batch, self.train.seq_len)
        out = []
        for r, batch in enumerate(batches):
            batch = tuple(batch)
            if len(batch) == 3 and batch[2] is not None and not self.train.segments:
                raise ValueError(
                    f"round {r} has segments; this step was lowered without them "
                    "(TrainConfig(segments=True) takes them)"
                )
            if len(batch) not in (2, 3):
                raise ValueError(f"round {r} is {len(batch)} value(s); the step takes {each}")
            tokens, targets = batch[:2]
            for name, t in (("tokens", tokens), ("targets", targets)):
                if tuple(t.shape) != shape:
                    raise ValueError(
                        f"round {r} {name} have shape {tuple(t.shape)}; the step takes {shape} "
                        "(batch, seq_len)"
                    )
            largest = int(tokens.max())
            if largest >= self.vocab_size:
                raise ValueError(
                    f"round {r} tokens reach id {largest}; the model's vocabulary has "
                    f"{self.vocab_size} ids"
                )
            checked = (tokens.to(torch.int64), targets.to(torch.int64))
            if self.train.segments:
                checked += (self._segments(r, batch[2] if len(batch) == 3 else None),)
            out.append(checked)
        return out

    def _segments(self, r: int, segments: Any) -> torch.Tensor:
        """Round ``r``'s segments as the step's ``S`` object holds them (stacked), checked
        against the step's shape; None is one sequence per row."""
        shape = (self.train.batch, self.train.seq_len)
        if segments is None:
            segments = Segments.dense(*shape)
        if not isinstance(segments, Segments):
            raise ValueError(
                f"round {r} segments are a {type(segments).__name__}; the step takes a "
                "dataflow_training.Segments (or None)"
            )
        if segments.shape != shape:
            raise ValueError(
                f"round {r} segments have shape {segments.shape}; the step takes {shape} "
                "(batch, seq_len)"
            )
        return segments.stacked().cpu()

    def _data(self, batches: list[Batch]) -> dict[str, torch.Tensor]:
        return data_values(self._data_objects, lambda _step, round_: batches[round_])

    def _load(self, batches: list[Batch]) -> None:

        opt_state = self._opt_state or {}
        layouts = state_layouts(self.compiled.running)
        for obj_id, raw in opt_state.items():
            if obj_id not in layouts or (layouts[obj_id].size_bytes,) != raw.shape:
                raise ValueError(
                    f"optimizer state {obj_id!r} does not fit this step's layout "
                    f"({tuple(raw.shape)} bytes given)"
                )
        opt_state = opt_for_step(self.compiled.running, opt_state)
        self.check_backing()
        # built object by object as the engine copies them in: the host holds the pinned
        # pool and one object's bytes at a time, not every start value at once, and the
        # weights' host copy goes as each parameter object is put (consume)
        initial = StartValues(
            self.compiled.running,
            self._weights,
            lambda _step, r: batches[r],
            given=opt_state,
            consume=True,
        )
        engine = Engine(
            "torch",
            budget_bytes=self.compiled.budget_bytes,
            slow_budget_bytes=self.compiled.backing_bytes,
            device=self.device,
            graph=self.compiled.graph,
        )
        try:
            engine.load(self.compiled.placement, self.compiled.executables(), initial=initial)
        except BaseException as exc:  # the weights were handed over: the state is gone
            self._weights = self._opt_state = None
            self._lost = f"its engine failed to load ({type(exc).__name__}: {exc})"
            raise
        self._engine = engine
        self._weights = self._opt_state = None

    def check_backing(self) -> None:
        """Refuse, before anything is allocated, a plan whose slow pool exceeds
        ``pinned_limit_bytes`` or, on CUDA, the host's available memory less
        ``HOST_RESERVE_BYTES`` (class docstring)."""

        pool = self.compiled.pinned_bytes
        limit = self.compiled.pinned_limit_bytes
        if limit is not None and pool > limit:
            what = f"pinned_limit_bytes: more than the {format_size(limit)} allowed"
        else:
            available = available_host_bytes() if self.device.startswith("cuda") else None
            if available is None or pool <= available - HOST_RESERVE_BYTES:
                return
            what = (
                f"host memory: more than the {format_size(available)} this host has "
                f"available less {format_size(HOST_RESERVE_BYTES)} kept for the process"
            )
        peak = format_size(self.compiled.plan.sim.slow_peak_bytes)
        raise PlanningError(
            f"{what}: the engine's slow pool for this plan takes {format_size(pool)} (a "
            f"slice for every object ever in slow memory; the plan's slow peak is {peak}); "
            "a larger fast budget (fewer objects offloaded) or fewer tokens a round "
            "(smaller activations) needs a smaller pool"
        )

    def step_activity(self, lr: float | None = None) -> dict[str, float]:
        """One more optimizer update on the last step's batches, replayed from the CUDA
        graph under torch.profiler: busy microseconds of the compute stream and of each
        copy direction, and the step's span (``Engine.replay_activity``). For benchmarks:
        compute idle is ``1 - compute_busy_us / span_us``."""
        if self._engine is None:
            raise RuntimeError("step_activity needs the steps before it run first")
        lr = self.train.optimizer.lr if lr is None else float(lr)
        activity = self._engine.replay_activity(values={"lr": lr, "update": self.updates + 1})
        self.updates += 1
        return activity

    @property
    def graph_note(self) -> str | None:
        """Why steps are dispatched rather than replayed from a CUDA graph (None when they
        are replayed, or before the engine has tried)."""
        if not self.compiled.graph:
            return "CUDA graphs are off (not on CUDA, or graph=False)"
        return None if self._engine is None else self._engine.graph_note

    @property
    def load_seconds(self) -> dict[str, float]:
        """Seconds the engine's load (in the first step) spent in each phase
        (``Engine.load_seconds``); empty before the first step."""
        return {} if self._engine is None else dict(self._engine.load_seconds)

    # -- state -------------------------------------------------------------------------
    def state(self) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
        """``(model state, optimizer state)``: ``{"<layer>.<param>": tensor}`` and the raw
        bytes of every ``O_*`` object (zeros before the first update), on the CPU, laid
        out for the state's shapes (``values.state_layouts``: a padded vocabulary table's
        moments have its real rows, as the weights do)."""
        if self._engine is None:
            if self._weights is None:
                raise RuntimeError(f"the run has no state: {self._lost}")
            weights = {k: v.clone() for k, v in self._weights.items()}
            if self._opt_state is not None:
                return weights, {k: v.clone() for k, v in self._opt_state.items()}
            layouts = state_layouts(self.compiled.running)
            opt = {k: torch.zeros(v.size_bytes, dtype=torch.uint8) for k, v in layouts.items()}
            return weights, opt
        fetch = self._engine.fetch
        running = self.compiled.running
        weights = {k: v.cpu() for k, v in read_state(running, fetch, "W").items()}
        opt = {p.id: fetch(p.id).detach().cpu().clone() for p in running.layout.of_kind("O")}
        return weights, opt_for_state(running, opt)

    def weights(self) -> dict[str, torch.Tensor]:
        """The model state alone, ``{"<layer>.<param>": tensor}`` on the CPU (``state()``
        without copying the optimizer state out: what an export needs)."""
        if self._engine is None:
            if self._weights is None:
                raise RuntimeError(f"the run has no state: {self._lost}")
            return {k: v.clone() for k, v in self._weights.items()}
        fetch = self._engine.fetch
        return {k: v.cpu() for k, v in read_state(self.compiled.running, fetch, "W").items()}

    def grads(self) -> dict[str, torch.Tensor]:
        """The last step's weight gradients (as the update saw them: clipped when the
        step clips), ``{"<layer>.<param>": tensor}``; needs ``keep_grads``."""
        running = self.compiled.running
        grads = running.layout.of_kind("dW")
        if self._engine is None or not grads:
            raise RuntimeError("grads() needs a step run with keep_grads=True")
        if not any(p.id in running.program.final_locations for p in grads):
            raise RuntimeError("grads() needs a step compiled with keep_grads=True")
        return {k: v.cpu() for k, v in read_state(running, self._engine.fetch, "dW").items()}

    def aux_temps(self) -> list[dict[str, dict[str, torch.Tensor]]]:
        """The last step's AuxTemp, per round ``{"<layer>": {name: tensor}}`` on the CPU
        (every block that records decisions); needs ``keep_aux_temp``."""
        running = self.compiled.running
        temps = running.layout.of_kind("AuxTemp")
        if self._engine is None or not temps:
            raise RuntimeError("aux_temps() needs a step run of a program with AuxTemp")
        if not all(p.id in running.program.final_locations for p in temps):
            raise RuntimeError("aux_temps() needs a step compiled with keep_aux_temp=True")
        per_layer = len({p.layer for p in temps})
        rounds: list[dict[str, dict[str, torch.Tensor]]] = []
        for i, packed in enumerate(temps):  # lowered round by round, block by block
            if i % per_layer == 0:
                rounds.append({})
            views = packed.layout.views(self._engine.fetch(packed.id))
            rounds[-1][packed.layer] = {name: view.cpu().clone() for name, view in views.items()}
        return rounds

    def host_weights(self) -> Mapping[str, torch.Tensor]:
        """The model state on the host, ``{"<layer>.<param>": tensor}`` (not to be
        changed): the engine's memory is given back first, the whole state kept on the
        host, and the next step loads the engine again. Another engine (an evaluation,
        ``drive.evaluation``) may then run in the same budget."""
        self.close(keep_state=True)
        gc.collect()  # the engine's arena goes now, not when a reference cycle is collected
        if self._weights is None:
            raise RuntimeError(f"the run has no state: {self._lost}")
        return self._weights

    def set_state(
        self,
        weights: Mapping[str, torch.Tensor],
        opt_state: Mapping[str, torch.Tensor] | None,
        updates: int,
    ) -> None:
        """Continue from a given state: the engine is loaded afresh at the next step."""
        self.close()
        dtype = getattr(torch, self.train.dtype.param)
        self._weights = stored_base(self.compiled.running.layers, weights, dtype)
        self._opt_state = None if opt_state is None else dict(opt_state)
        self.updates = updates

    def save(self, path: str | Path, extra: Mapping[str, Any] | None = None) -> Path:
        """Write a complete checkpoint to ``path`` (atomically; see
        ``dataflow_training.drive.checkpoint``); ``extra`` goes into its manifest."""

        weights, opt = self.state()
        return write_checkpoint(path, weights, opt, self.manifest(extra))

    def restore(self, path: str | Path, loose: Sequence[str] = ()) -> dict[str, Any]:
        """Continue from the checkpoint at ``path``; returns its manifest. A checkpoint of
        another family, preset, overrides or training step (its lr aside: ``PER_STEP``) is
        an error naming the field; ``loose`` names training-step fields not compared (a
        fleet member restores a checkpoint rank 0 wrote with its own ``rounds``). Other
        pieces of the same parameters (``RECUT``) are taken: the optimizer state is cut
        again (``values.recut_opt``)."""

        weights, opt, manifest, rng = read_checkpoint(path)
        mine = self.manifest()
        recut = []
        for field in ("family", "preset", "overrides", "train"):
            theirs, ours = manifest.get(field), mine[field]
            if field == "train" and isinstance(theirs, dict):  # fields written only when set
                theirs, ours = OMITTED_DEFAULTS | theirs, OMITTED_DEFAULTS | ours
            if field == "train" and loose and isinstance(theirs, dict):
                theirs = {k: v for k, v in theirs.items() if k not in loose}
                ours = {k: v for k, v in ours.items() if k not in loose}
            differences = [d for d in _differences(theirs, ours, field) if d[0] not in PER_STEP]
            recut += [d for d in differences if d[0] in RECUT]
            differences = [d for d in differences if d[0] not in RECUT]
            if differences:
                where, was, now = differences[0]
                more = [d[0] for d in differences[1:]]
                also = f" (and {len(more)} more: {', '.join(more)})" if more else ""
                raise ValueError(
                    f"checkpoint {path}: {where} is {was!r}; this run's is {now!r}{also}"
                    f"{_STATE_HINT if where.startswith(_STATE_FIELDS) else ''}"
                )
        if recut:  # the checkpoint's step, lowered for its optimizer state's layout
            theirs = lower(
                self.compiled.family,
                self.compiled.preset,
                train_from_dict(manifest["train"]),
                overrides=manifest.get("overrides") or {},
            )
            try:
                opt = recut_opt(theirs, self.compiled.running, opt)
            except ValueError as exc:
                where, was, now = recut[0]
                raise ValueError(
                    f"checkpoint {path}: {where} is {was!r}; this run's is {now!r}, and {exc}"
                ) from None
        self.set_state(weights, opt, int(manifest["step"]))
        set_rng_state(rng)
        return manifest

    def manifest(self, extra: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """What a checkpoint of this run records about it (``checkpoint.MANIFEST_FIELDS``)."""

        return {
            "step": self.updates,
            "family": self.compiled.family.name,
            "preset": self.compiled.preset,
            "overrides": self.compiled.overrides,
            "vocab_size": self.vocab_size,
            "train": train_dict(self.train),
            "seed": self.seed,
            "device": self.device,
            "budget_bytes": self.compiled.planned_budget_bytes,
            "plan_hash": plan_hash(self.compiled.program),
            "versions": package_versions(),
            **dict(extra or {}),
        }

    def close(self, keep_state: bool = True) -> None:
        """Give the engine's memory back, keeping the state on the host for a later step
        (``keep_state=False``: drop it; a large model's state need not be copied out when
        the run ends)."""
        if self._engine is not None:
            if keep_state:
                self._weights, self._opt_state = self.state()
            else:
                self._weights = self._opt_state = None
                self._lost = "the run was closed with keep_state=False"
            self._engine.close()
            self._engine = None

    def __enter__(self) -> TrainingRun:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
