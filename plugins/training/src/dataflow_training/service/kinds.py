"""Trainer kinds: the updates ``dataflow serve-trainer`` serves besides its own token-batch
step, as plugins register them (``dataflow_trainer_kinds``, docs/plugin_hooks.md).

A ``load`` with ``"kind": NAME`` (not ``tokens``, the server's own) finds the plugin's
``TrainerKindSpec``, opens its trainer (a ``ServedTrainer``) and serves it with a
``KindRun``: the plugin does the update, the server everything around it. ``step`` hands
the trainer the path of ``batch`` and the kind's step fields; ``save`` and ``restore``
write and read the run folder's checkpoints with the same atomic, checksummed writer
``dataflow train`` uses (``drive.checkpoint``: the trainer's ``state()`` as the model
file, its ``optimizer_state()`` as the optimizer file); ``export_weights`` writes the
trainer's ``state()`` through its family's HF export (``weights_export``).
"""

from __future__ import annotations

import shutil
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any, Protocol

import torch

from dataflow import UnknownNameError, trainer_kinds
from dataflow_training.drive.checkpoint import read_checkpoint, set_rng_state, step_name
from dataflow_training.drive.checkpoint import write_checkpoint as write_folder
from dataflow_training.drive.components import METRICS_FILE, JsonlMetrics
from dataflow_training.drive.trainer import HISTORY_TAIL
from dataflow_training.service.protocol import ProtocolError, field, no_other_fields

#: the server's own kind (``ServedRun``): a plugin cannot register it
TOKENS = "tokens"
#: the ``load`` fields of every kind that the server reads itself
SERVER_LOAD_FIELDS = ("kind", "device", "resume")
#: the ``load`` fields a checkpoint need not share with the run that takes it up: where the
#: run computes, and where its first weights came from (the checkpoint's replace them)
UNCOMPARED = ("budget", "device", "init", "seed")


class ServedTrainer(Protocol):
    """What a trainer kind's ``open(options, *, device)`` returns."""

    #: optimizer updates so far (a checkpoint's step)
    updates: int
    #: the family object and model config its weights export through (``export_hf``)
    family: Any
    config: Any

    def describe(self) -> dict[str, Any]:
        """What ``load`` answers besides the step (JSON values: family, preset, plan...)."""
        ...

    def step(self, path: Path, **args: Any) -> dict[str, float]:
        """One update on the batch at ``path`` with the kind's step fields; its stats.
        A bad batch or field is a ``ValueError`` naming it, raised before any change."""
        ...

    def state(self) -> dict[str, torch.Tensor]:
        """The weights now, keyed as ``family.export_hf`` takes them."""
        ...

    def optimizer_state(self) -> dict[str, torch.Tensor]:
        """What the optimizer keeps (a checkpoint's optimizer file): tensors by name."""
        ...

    def load_state(
        self, weights: Mapping[str, torch.Tensor], optimizer_state: Mapping[str, torch.Tensor]
    ) -> None:
        """Take up a checkpoint's weights and optimizer state (``updates`` with them);
        ``ValueError`` naming the tensor when they are not this trainer's."""
        ...

    def close(self) -> None: ...


def kind_spec(name: str) -> Any:
    """The registered trainer kind ``name``; a ``ProtocolError`` naming the known ones."""
    registry = trainer_kinds()
    try:
        return registry.get(name)
    except UnknownNameError:
        known = ", ".join([TOKENS, *registry.names()])
        raise ProtocolError(
            f"args.kind: {name!r} is not one of {known} (plugins register more: "
            "dataflow_trainer_kinds)"
        ) from None


class KindRun:
    """A plugin kind's trainer served in run folder ``out`` (the ``ServedRun`` verbs)."""

    def __init__(
        self,
        spec: Any,
        trainer: ServedTrainer,
        out: Path,
        load_args: dict[str, Any],
        say: Callable[[str], None],
    ) -> None:
        self.spec, self.trainer, self.out, self.say = spec, trainer, Path(out), say
        self.load_args = load_args
        self.history: list[tuple[int, float]] = []
        self.saved: Path | None = None
        self.metrics = JsonlMetrics(self.out / METRICS_FILE, trainer.updates)

    @classmethod
    def open(
        cls,
        name: str,
        args: dict[str, Any],
        out: Path,
        resume: Path | None,
        say: Callable[[str], None],
    ) -> KindRun:
        """Open kind ``name``'s trainer from ``load``'s ``args`` (resumed from ``resume``)."""
        spec = kind_spec(name)
        no_other_fields(args, (*SERVER_LOAD_FIELDS, *spec.load_args), f"load (kind {name})")
        device = field(args, "device", str, "cpu")
        options = {k: v for k, v in args.items() if k not in SERVER_LOAD_FIELDS}
        trainer = spec.open(options, device=device)
        served = cls(spec, trainer, out, {k: v for k, v in args.items() if k != "resume"}, say)
        if resume is not None:
            try:
                served.take(resume)
            except BaseException:
                served.close(save=False)
                raise
        return served

    @property
    def updates(self) -> int:
        return self.trainer.updates

    def describe(self) -> dict[str, Any]:
        return {"kind": self.spec.name, "step": self.updates, **self.trainer.describe()}

    # -- step ------------------------------------------------------------------------
    def step(self, args: dict[str, Any]) -> dict[str, Any]:
        """One update on the batch ``args.batch.path`` names, with the kind's step fields."""
        no_other_fields(args, ("batch", *self.spec.step_args), "step")
        batch = args.get("batch")
        if not isinstance(batch, dict):
            raise ProtocolError("args.batch: missing (a JSON object: path)")
        no_other_fields(batch, ("kind", "path"), f"a {self.spec.name} batch", where="args.batch")
        kind = field(batch, "kind", str, self.spec.name, where="args.batch")
        if kind != self.spec.name:
            raise ProtocolError(
                f"args.batch.kind: {kind!r}, but the run loaded is of kind {self.spec.name!r}"
            )
        path = Path(field(batch, "path", str, where="args.batch"))
        if not path.exists():
            raise ProtocolError(f"args.batch.path: {path} does not exist")
        rest = {k: v for k, v in args.items() if k != "batch"}
        try:
            stats = self.trainer.step(path, **rest)
        except ValueError as exc:
            raise ProtocolError(str(exc)) from None
        number = self.updates
        metrics = {"step": number, **{k: float(v) for k, v in stats.items()}}
        if "loss" in metrics:
            self.history.append((number, metrics["loss"]))
        self.metrics.write(number, metrics)
        return metrics

    # -- checkpoints -----------------------------------------------------------------
    def save(self) -> Path:
        """The checkpoint of the step now: the one this run wrote there already, else new
        (one an abandoned history left at this step is replaced)."""
        path = self.out / step_name(self.updates)
        if self.saved == path and path.is_dir():
            return path
        if path.is_dir():
            self.say(f"replacing {path}, written by a history this run left")
            shutil.rmtree(path)
        manifest = {
            "step": self.updates,
            "kind": self.spec.name,
            "history": self.history[-HISTORY_TAIL:],
            "service": {"load": self.load_args},
        }
        self.saved = write_folder(
            path, self.trainer.state(), self.trainer.optimizer_state(), manifest
        )
        return self.saved

    def take(self, path: Path) -> dict[str, Any]:
        """Continue from the checkpoint at ``path``: checked (checksums, its kind and its
        load fields but ``UNCOMPARED``) before the trainer takes it up."""
        weights, optimizer, manifest, rng = read_checkpoint(path)
        if manifest.get("kind") != self.spec.name:
            raise ProtocolError(
                f"args.checkpoint: {path} is of kind {manifest.get('kind') or TOKENS!r}, "
                f"not {self.spec.name!r}"
            )
        theirs = (manifest.get("service") or {}).get("load", {})
        for name in sorted(set(theirs) | set(self.load_args)):
            if name in UNCOMPARED or theirs.get(name) == self.load_args.get(name):
                continue
            raise ProtocolError(
                f"args.checkpoint: {path} was loaded with {name}={theirs.get(name)!r}, this "
                f"run with {name}={self.load_args.get(name)!r}"
            )
        self.trainer.load_state(weights, optimizer)
        set_rng_state(rng)
        self.history = [tuple(x) for x in manifest.get("history", [])]
        self.saved = path if path.parent == self.out else None
        self.metrics.close()
        self.metrics = JsonlMetrics(self.out / METRICS_FILE, self.updates)
        return manifest

    def close(self, save: bool) -> str | None:
        saved = str(self.save()) if save else None
        self.trainer.close()
        self.metrics.close()
        return saved
