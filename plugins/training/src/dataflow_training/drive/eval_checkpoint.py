"""``dataflow eval --from RUN``'s job: the validation loss of a checkpoint, from its run's
options (its manifest) and the run's evaluator (``drive.evaluation``)."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import attrs
import torch

from dataflow_training.drive.checkpoint import (
    MANIFEST_FILE,
    CheckpointError,
    intact_checkpoint,
    read_checkpoint,
    read_manifest,
)
from dataflow_training.drive.evaluation import EvalOptions, Evaluator, val_feed_spec
from dataflow_training.drive.options import TrainOptions
from dataflow_training.step.family import load_family


def checkpoint_of(location: str | Path) -> Path:
    """The checkpoint ``location`` names: itself where it holds a manifest, else the
    newest intact checkpoint of the run folder it is; a ``CheckpointError`` naming it when
    it is neither."""
    folder = Path(location)
    if (folder / MANIFEST_FILE).is_file():
        return folder
    if not folder.is_dir():
        raise CheckpointError(f"{folder} is not a folder (a run folder or a checkpoint)")
    found = intact_checkpoint(folder)
    if found is None:
        raise CheckpointError(f"{folder} holds no checkpoint (no {MANIFEST_FILE}, no step_*)")
    return found


def evaluate_checkpoint(
    location: str | Path,
    *,
    tokens: int | None = None,
    val_data: str | None = None,
    budget_bytes: int | None = None,
    device: str | None = None,
    say: Any = None,
) -> dict[str, Any]:
    """The validation loss of the checkpoint ``location`` names (``checkpoint_of``): its
    run's step (``TrainOptions`` from its manifest) compiled forward-only, scoring the
    run's validation tokens (``tokens`` and ``val_data`` where given, else the run's
    ``eval_tokens`` and ``val_data``, else its data's ``val`` shards). ``budget_bytes``
    and ``device`` default to the run's (the CPU where the run's is CUDA and there is
    none). Returns ``evaluate``'s metrics with ``step`` and ``checkpoint``; ``say`` gets
    the eval line."""
    checkpoint = checkpoint_of(location)
    manifest = read_manifest(checkpoint)
    raw = manifest.get("options")
    if not isinstance(raw, dict):
        raise CheckpointError(f"{checkpoint / MANIFEST_FILE} records no run options")
    fields = {f.name for f in attrs.fields(TrainOptions)} - {"profile"}
    o = TrainOptions(**{k: v for k, v in raw.items() if k in fields})
    changes: dict[str, Any] = {"val_data": val_data or o.val_data}
    if tokens is not None:
        changes["eval_tokens"] = tokens
    if budget_bytes is not None:
        changes["budget_bytes"] = budget_bytes
    if device is None and o.device.startswith("cuda") and not torch.cuda.is_available():
        device = "cpu"  # a run trained on a GPU, scored where there is none
    if device is not None:
        changes["device"] = device
    o = attrs.evolve(o, **changes)
    spec, split = val_feed_spec(o.data, o.val_data)
    family = load_family(o.family)
    evaluator = Evaluator.of(o, family, EvalOptions(spec, o.eval_tokens, None, split))
    if say is not None:
        say(evaluator.line())
    weights = read_checkpoint(checkpoint, weights_only=True)[0]
    metrics = evaluator.evaluate(weights)
    return {"step": int(manifest["step"]), "checkpoint": str(checkpoint), **metrics}
