"""``ServedRun``: what a ``dataflow serve-trainer`` keeps alive between calls, one method
per verb (docs/engine_service.md). It holds one ``TrainingRun`` over one ``CompiledStep``
made at ``load``, in the server's run folder, or, for a ``load`` of another ``kind``, the
``KindRun`` of a trainer a plugin provides (``service.kinds``); each method takes a request's ``args`` and
returns its result (JSON), or raises a ``ProtocolError`` (or a ``ValueError`` of the run)
whose message names the field at fault. Nothing here knows the socket.

A verb checks all it is given before it changes anything: a ``step`` reads and checks its
batch before the engine runs, a ``restore`` checks the checkpoint against the step before
it takes its state, a ``load`` that fails leaves nothing loaded.
"""

from __future__ import annotations

import math
import os
import sys
import time
from pathlib import Path
from typing import Any, TextIO

import attrs

from dataflow import InfeasibleBudget, families, format_size, parse_size
from dataflow_training.drive.checkpoint import checkpoints, intact_checkpoint, step_name
from dataflow_training.drive.components import METRICS_FILE, Checkpointer, JsonlMetrics
from dataflow_training.drive.options import TrainOptions
from dataflow_training.drive.peft_export import merged
from dataflow_training.drive.profiling import ProfileWindow, StepProfiler
from dataflow_training.drive.run import TrainingRun, resolver_for
from dataflow_training.drive.trainer import HISTORY_TAIL, _init_weights, _with_init, plan_line
from dataflow_training.service.batches import read_batch
from dataflow_training.service.kinds import TOKENS, KindRun
from dataflow_training.service.protocol import ProtocolError, field, no_other_fields
from dataflow_training.service.weights_export import export_weights
from dataflow_training.step.family import load_family
from dataflow_training.step.freezing import FreezeError
from dataflow_training.step.lora import LoraError
from dataflow_training.step.optimizers import optimizer_spec

#: ``load``'s fields: each with its type and default (None: ``TrainOptions``' own)
LOAD_FIELDS: dict[str, tuple[type, Any]] = {
    "kind": (str, TOKENS),
    "preset": (str, None),
    "family": (str, None),
    "init": (str, None),
    "budget": (object, None),
    "backing": (object, None),
    "batch": (int, 8),
    "seq_len": (int, 64),
    "rounds": (int, 1),
    "lr": (float, 3e-4),
    "clip": (float, 1.0),
    "seed": (int, 0),
    "device": (str, "cpu"),
    "precision": (str, "auto"),
    "optimizer": (str, "adamw"),
    "optimizer_args": (dict, None),
    "freeze": (list, None),
    "lora": (int, None),
    "lora_alpha": (float, None),
    "lora_dropout": (float, 0.0),
    "lora_targets": (list, None),
    "lora_base": (str, None),
    "resolver": (str, "auto"),
    "recompute": (bool, True),
    "graph": (bool, True),
    "overrides": (dict, None),
    "resume": (str, None),
}
#: test hook, ``SECONDS``: hold every step that long after its batch is read, before it runs
#: (so that a test's client dies while the server is inside the verb)
SLOW_STEP_ENV = "DATAFLOW_SERVE_SLOW_STEP"
#: the largest stop step of an open profile window (``profile_stop`` closes it)
OPEN_WINDOW = 2**62


class ServedRun:
    """The run of a server on run folder ``out`` (claimed by the server); ``log`` takes the
    lines a run says (the server's stderr)."""

    def __init__(self, out: Path, log: TextIO | None = None) -> None:
        self.out, self.log = Path(out), log or sys.stderr
        self.run: TrainingRun | None = None
        self.kind_run: KindRun | None = None  # a plugin's kind of update, when loaded
        self.options: TrainOptions | None = None
        self.load_args: dict[str, Any] = {}
        self.family: Any = None
        self.history: list[tuple[int, float]] = []
        self.last_export: dict[str, str] | None = None
        self._metrics: JsonlMetrics | None = None
        self._saver: Checkpointer | None = None
        self._profiler: StepProfiler | None = None

    def say(self, line: str) -> None:
        print(line, file=self.log, flush=True)

    # -- load ------------------------------------------------------------------------
    def load(self, args: dict[str, Any]) -> dict[str, Any]:
        """Compile the step of a preset in a budget and start (or resume) its run."""
        if self.run is not None or self.kind_run is not None:
            what = self.options.preset if self.run is not None else self.kind_run.spec.name
            raise ProtocolError(
                f"load: a run is loaded already ({what}, step {self._updates()}); shut this "
                "server down and start another to load again"
            )
        kind = field(args, "kind", str, TOKENS)
        if kind != TOKENS:
            resumed = self._checkpoint_to_resume(field(args, "resume", str, None))
            self.kind_run = KindRun.open(kind, args, self.out, resumed, self.say)
            self.load_args = self.kind_run.load_args
            self.history = self.kind_run.history
            answer = self.kind_run.describe()
            return answer | {"resumed": None if resumed is None else str(resumed)}
        no_other_fields(args, tuple(LOAD_FIELDS), "load")
        given = {
            name: args.get(name, default) if kind is object else field(args, name, kind, default)
            for name, (kind, default) in LOAD_FIELDS.items()
        }
        if given["preset"] is None:
            raise ProtocolError("args.preset: missing (a string: a family's preset)")
        for name in ("batch", "seq_len", "rounds"):
            if given[name] < 1:
                raise ProtocolError(f"args.{name}: {given[name]} < 1")
        budgets = {name: _size(args, name) for name in ("budget", "backing")}
        resumed = self._checkpoint_to_resume(given["resume"])
        family_name = given["family"] or _family_of(given["preset"])
        try:
            family = load_family(family_name)
        except LookupError as exc:
            raise ProtocolError(f"args.family: {exc}") from None
        presets = getattr(family, "presets", None)
        if presets is not None and given["preset"] not in presets:
            raise ProtocolError(
                f"args.preset: {family_name} has no preset {given['preset']!r}; known: "
                f"{', '.join(presets)}"
            )
        o = TrainOptions(
            family=family_name,
            preset=given["preset"],
            steps=0,
            out=self.out,
            batch=given["batch"],
            seq_len=given["seq_len"],
            rounds=given["rounds"],
            budget_bytes=budgets["budget"],
            backing_bytes=budgets["backing"],
            device=given["device"],
            lr=given["lr"],
            clip=given["clip"] or None,
            seed=given["seed"],
            precision=given["precision"],
            optimizer=given["optimizer"],
            optimizer_args=_optimizer_args(given),
            **_what_trains(given),
            overrides=given["overrides"] or {},
            graph=given["graph"],
            recompute=given["recompute"],
            resolver=given["resolver"],
            init=given["init"],
        )
        init = None
        if o.init is not None:
            o, init = _with_init(o, family)
        resolver_for(o.resolver, o.device)  # a bad name: named before the compile
        _check_optimizer(o)
        try:
            compiled = o.compile(family, recompute=o.recompute)
        except FreezeError as exc:
            raise ProtocolError(f"args.freeze: {exc}") from None
        except LoraError as exc:  # it names the --lora option at fault: its field here
            option = str(exc).split(" ", 1)[0]
            name = option[2:].replace("-", "_") if option.startswith("--lora") else "lora"
            raise ProtocolError(f"args.{name}: {exc}") from None
        except InfeasibleBudget as exc:
            raise ProtocolError(
                f"args.budget: {format_size(o.budget_bytes)} is too small for this step: the "
                f"smallest budget that works is {format_size(exc.minimal_budget_bytes)} "
                f"({exc.minimal_budget_bytes} bytes)"
            ) from None
        state = _init_weights(o, init, family) if init is not None and resumed is None else None
        run = TrainingRun(compiled, seed=o.seed, state=state)
        if resumed is not None:
            manifest = run.restore(resumed)
            self.history = [tuple(x) for x in manifest.get("history", [])]
        self.run, self.options, self.family = run, o, family
        self.load_args = {k: v for k, v in args.items() if k != "resume"}
        self._saver = Checkpointer(
            run,
            self.out,
            every=None,
            steps=-1,
            keep=None,
            writes=True,
            extra=self._manifest_extra,
            say=self.say,
        )
        self._metrics = JsonlMetrics(self.out / METRICS_FILE, run.updates)
        line = plan_line(compiled)
        self.say(line)
        return {
            "step": run.updates,
            "resumed": None if resumed is None else str(resumed),
            "family": family_name,
            "plan": line,
            "vocab_size": run.vocab_size,
            "batch": o.batch,
            "seq_len": o.seq_len,
            "rounds": o.rounds,
        }

    def _checkpoint_to_resume(self, resume: str | None) -> Path | None:
        """The checkpoint ``resume`` names (``auto``: the newest intact one in the folder,
        None where there is none); a new run into a folder of checkpoints is refused."""
        if resume is None:
            held = checkpoints(self.out)
            if held:
                raise ProtocolError(
                    f"args.resume: {self.out} holds checkpoints ({held[-1].name} the newest): "
                    'give "resume": "auto" (or a checkpoint\'s path) to carry that run on, or '
                    "serve another --out"
                )
            return None
        if resume == "auto":
            return intact_checkpoint(self.out, self.say)
        if not Path(resume).is_dir():
            raise ProtocolError(f"args.resume: {resume} is not a checkpoint folder")
        return Path(resume)

    def _manifest_extra(self) -> dict[str, Any]:
        return {
            "history": self.history[-HISTORY_TAIL:],
            "service": {"load": self.load_args},
        }

    def _loaded(self, verb: str) -> TrainingRun | KindRun:
        if self.kind_run is not None:
            return self.kind_run
        if self.run is None:
            raise ProtocolError(f"{verb}: no run is loaded (send load first)")
        return self.run

    def _updates(self) -> int:
        return self.kind_run.updates if self.kind_run is not None else self.run.updates

    # -- step ------------------------------------------------------------------------
    def step(self, args: dict[str, Any]) -> dict[str, Any]:
        """One optimizer update over one batch per accumulation round (a plugin kind's:
        over the batch its ``path`` names, with the kind's step fields)."""
        run = self._loaded("step")
        if run is self.kind_run:
            if os.environ.get(SLOW_STEP_ENV):
                time.sleep(float(os.environ[SLOW_STEP_ENV]))
            if self._profiler is None:
                return run.step(args)
            with self._profiler.step(run.updates + 1):
                return run.step(args)
        no_other_fields(args, ("batch", "lr"), "step")
        lr = field(args, "lr", float, None)
        if lr is not None and not (math.isfinite(lr) and lr >= 0):
            raise ProtocolError(f"args.lr: {lr} is not a learning rate (finite, >= 0)")
        batches = read_batch(args.get("batch"), run.train)
        for r, (tokens, _targets) in enumerate(batches):  # TrainingRun checks it too, later
            if int(tokens.min()) < 0 or int(tokens.max()) >= run.vocab_size:
                raise ProtocolError(
                    f"args.batch.path: round {r} has token ids outside 0..{run.vocab_size - 1}"
                )
        number = run.updates + 1
        if os.environ.get(SLOW_STEP_ENV):
            time.sleep(float(os.environ[SLOW_STEP_ENV]))
        if self._profiler is not None:
            with self._profiler.step(number):
                stats = run.step(batches, lr)
        else:
            stats = run.step(batches, lr)
        self.history.append((number, stats.loss))
        metrics = {
            "step": number,
            "loss": stats.loss,
            "losses": list(stats.losses),
            "lr": stats.lr,
            "grad_norm": stats.grad_norm,
            "step_s": stats.step_s,
            "fast_peak_bytes": stats.fast_peak_bytes,
        }
        self._metrics.write(number, metrics)
        return metrics

    # -- checkpoints -----------------------------------------------------------------
    def save(self, args: dict[str, Any]) -> dict[str, Any]:
        """A checkpoint of the state now, as ``dataflow train`` writes them."""
        run = self._loaded("save")
        no_other_fields(args, (), "save")
        path = run.save() if run is self.kind_run else self._saver.at(run.updates)
        return {"step": run.updates, "checkpoint": str(path)}

    def restore(self, args: dict[str, Any]) -> dict[str, Any]:
        """Continue from a checkpoint of this step (``auto``: the folder's newest intact)."""
        run = self._loaded("restore")
        no_other_fields(args, ("checkpoint",), "restore")
        which = field(args, "checkpoint", str, "auto")
        path = intact_checkpoint(self.out, self.say) if which == "auto" else Path(which)
        if path is None:
            raise ProtocolError(f"args.checkpoint: {self.out} holds no checkpoint")
        if not path.is_dir():
            raise ProtocolError(f"args.checkpoint: {path} is not a checkpoint folder")
        if self._profiler is not None:
            raise ProtocolError("restore: a profile window is open (send profile_stop first)")
        if run is self.kind_run:
            run.take(path)
            self.history = run.history
            return {"step": run.updates, "checkpoint": str(path)}
        manifest = run.restore(path)
        self.history = [tuple(x) for x in manifest.get("history", [])]
        self._metrics.close()
        self._metrics = JsonlMetrics(self.out / METRICS_FILE, run.updates)
        return {"step": run.updates, "checkpoint": str(path)}

    # -- weights ---------------------------------------------------------------------
    def export_weights(self, args: dict[str, Any]) -> dict[str, Any]:
        """The weights as an HF folder (``weights_export``), whole or the changed tensors."""
        run = self._loaded("export_weights")
        no_other_fields(args, ("path", "changed_only", "max_shard_size"), "export_weights")
        default = self.out / "exports" / step_name(run.updates)
        folder = Path(field(args, "path", str, str(default)))
        changed_only = field(args, "changed_only", bool, False)
        shard = _size(args, "max_shard_size")
        if run is self.kind_run:
            family, config, weights = run.trainer.family, run.trainer.config, run.trainer.state()
        else:
            family, weights = self.family, run.weights()
            config = family.config(self.options.preset, **self.options.overrides)
            lora = self.options.lora_config
            if lora is not None:  # what an engine reloads: the adapters folded in
                weights = merged(weights, lora)
        if not hasattr(family, "export_hf"):
            name = getattr(family, "name", type(family).__name__)
            raise ProtocolError(f"export_weights: family {name!r} has no HF export")
        record = export_weights(
            family,
            config,
            weights,
            folder,
            step=run.updates,
            previous=self.last_export,
            changed_only=changed_only,
            max_shard_bytes=shard,
        )
        self.last_export = record["tensors"]
        return {
            "path": str(folder),
            "step": run.updates,
            "changed_only": record["changed_only"],
            "tensors": len(record["tensors"]),
            "written": record["written"],
            "files": record["files"],
        }

    # -- profiling -------------------------------------------------------------------
    def profile_start(self, args: dict[str, Any]) -> dict[str, Any]:
        """Bracket the steps from the next one on (until ``profile_stop``) for profilers:
        a torch.profiler trace; on CUDA ``cudaProfilerStart`` (for ``nsys profile
        --capture-range=cudaProfilerApi``) and NVTX ranges (``drive.profiling``)."""
        run = self._loaded("profile_start")
        no_other_fields(args, ("folder",), "profile_start")
        if self._profiler is not None:
            raise ProtocolError("profile_start: a profile window is open already")
        folder = Path(field(args, "folder", str, str(self.out / "profile")))
        window = ProfileWindow(run.updates + 1, OPEN_WINDOW, folder)
        device = self._device()
        graph = self.options.graph if self.options is not None else False
        self._profiler = StepProfiler(window, device, self.log, graph)
        cuda = device.startswith("cuda")
        return {"from_step": run.updates + 1, "folder": str(folder), "nvtx": cuda}

    def profile_stop(self, args: dict[str, Any]) -> dict[str, Any]:
        """End the window ``profile_start`` opened; the trace of its steps, if any ran."""
        no_other_fields(args, (), "profile_stop")
        profiler = self._profiler
        if profiler is None:
            raise ProtocolError("profile_stop: no profile window is open (send profile_start)")
        self._profiler = None
        if not profiler.steps:
            return {"steps": [], "trace": None}
        profiler.window = attrs.evolve(profiler.window, stop=profiler.steps[-1])
        path = profiler.close()
        return {"steps": profiler.steps, "trace": str(path)}

    # -- status ----------------------------------------------------------------------
    def _device(self) -> str:
        if self.kind_run is not None:
            return str(self.kind_run.load_args.get("device", "cpu"))
        return self.run.device

    def status(self, args: dict[str, Any]) -> dict[str, Any]:
        no_other_fields(args, (), "status")
        run, kinded = self.run, self.kind_run
        loaded = run is not None or kinded is not None
        described = kinded.trainer.describe() if kinded is not None else {}
        return {
            "pid": os.getpid(),
            "out": str(self.out),
            "loaded": loaded,
            "kind": None if not loaded else TOKENS if kinded is None else kinded.spec.name,
            "step": self._updates() if loaded else None,
            "family": described.get("family") if run is None else self.options.family,
            "preset": described.get("preset") if run is None else self.options.preset,
            "device": self._device() if loaded else None,
            "last_loss": self.history[-1][1] if self.history else None,
            "profiling": self._profiler is not None,
            "checkpoints": [p.name for p in checkpoints(self.out)],
        }

    def close(self, save: bool) -> str | None:
        """End the run (saving a checkpoint first with ``save``); the checkpoint's path."""
        saved = None
        if self._profiler is not None:
            self._profiler.close()
            self._profiler = None
        if self.kind_run is not None:
            saved = self.kind_run.close(save)
        if self.run is not None:
            if save:
                saved = str(self._saver.at(self.run.updates))
            self.run.close(keep_state=False)
        if self._metrics is not None:
            self._metrics.close()
        return saved


def _strings(given: dict[str, Any], name: str) -> tuple[str, ...]:
    """``load``'s field ``name``: a JSON array of strings (None: empty)."""
    value = given[name] or []
    if not all(isinstance(item, str) for item in value):
        raise ProtocolError(f"args.{name}: a JSON array of strings")
    return tuple(value)


def _what_trains(given: dict[str, Any]) -> dict[str, Any]:
    """``TrainOptions``' fields of what trains: ``freeze`` and the ``lora`` fields (a
    ``lora_*`` field needs ``lora``; their values are ``LoraConfig``'s to check, at the
    compile)."""
    fields = {"freeze": _strings(given, "freeze")}
    lora = {
        "lora": given["lora"],
        "lora_alpha": given["lora_alpha"],
        "lora_dropout": given["lora_dropout"],
        "lora_targets": _strings(given, "lora_targets"),
        "lora_base": given["lora_base"],
    }
    if lora["lora"] is None:
        named = [name for name, value in lora.items() if value]
        if named:
            raise ProtocolError(f"args.{named[0]}: needs args.lora (the adapters' rank)")
        return fields
    return fields | lora


def _optimizer_args(given: dict[str, Any]) -> dict[str, Any]:
    """``load``'s ``optimizer_args`` (a JSON object) typed by the optimizer's spec, as
    ``--optimizer-arg NAME=VALUE`` is."""
    try:
        spec = optimizer_spec(given["optimizer"])
    except ValueError as exc:
        raise ProtocolError(f"args.optimizer: {exc}") from None
    typed = {}
    for name, value in (given["optimizer_args"] or {}).items():
        try:
            typed[name] = spec.argument(name).parse(str(value))
        except ValueError as exc:
            raise ProtocolError(f"args.optimizer_args.{name}: {exc}") from None
    return typed


def _check_optimizer(o: TrainOptions) -> None:
    """The optimizer under the run's precision (``Precision.optimizer_policy``), or one
    line naming ``args.optimizer``."""
    try:
        o.policy.optimizer_policy(o.optimizer, o.optimizer_args)
    except ValueError as exc:
        raise ProtocolError(f"args.optimizer: {exc}") from None


def _size(args: dict[str, Any], name: str) -> int | None:
    """``args[name]``, a size in bytes (an integer) or as people write it (``"8MiB"``)."""
    value = args.get(name)
    if value is None:
        return None
    if isinstance(value, int) and not isinstance(value, bool):
        if value < 1:
            raise ProtocolError(f"args.{name}: {value} bytes < 1")
        return value
    if not isinstance(value, str):
        raise ProtocolError(f'args.{name}: a size (bytes, or a string such as "8MiB")')
    try:
        return parse_size(value)
    except ValueError as exc:
        raise ProtocolError(f"args.{name}: {exc}") from None


def _family_of(preset: str) -> str:
    """The one installed family that has ``preset``."""
    owners = []
    for spec in families():
        try:
            presets = getattr(spec.load(), "presets", ())
        except Exception:  # a broken family plugin cannot own the preset
            continue
        if preset in presets:
            owners.append(spec.name)
    if len(owners) != 1:
        which = "no installed family has" if not owners else f"families {', '.join(owners)} have"
        raise ProtocolError(f"args.preset: {which} a preset {preset!r}; name one in args.family")
    return owners[0]
