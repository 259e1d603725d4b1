"""Training checkpoints: safetensors for tensors, a JSON manifest for everything else.

A checkpoint is a folder ``step_NNNNNN`` holding

- ``model.safetensors``: the model state, ``{"<layer>.<param>": tensor}``;
- ``optimizer.safetensors``: each ``O_*`` object's raw bytes (uint8), plus the RNG
  states under ``rng/<name>``;
- ``manifest.json``: step, TrainConfig, family/preset/overrides, plan hash, package
  versions and whatever the driver adds (feed position, loss history tail, schedule).

It is written into ``.tmp-<name>-<pid>`` beside its final place, every file fsynced, then
renamed in one step and the parent folder fsynced: a folder named ``step_*`` is always
complete. Nothing is ever unpickled (safetensors and JSON only). See
docs/checkpointing.md.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import time
from collections.abc import Mapping
from importlib import metadata
from pathlib import Path
from typing import Any

import cattrs
import torch

from dataflow_training.step.config import TrainConfig

MODEL_FILE = "model.safetensors"
OPTIMIZER_FILE = "optimizer.safetensors"
MANIFEST_FILE = "manifest.json"
FORMAT = "dataflow.checkpoint/v1"
STEP_PATTERN = re.compile(r"^step_(\d{6,})$")
TMP_PREFIX = ".tmp-"
#: test hook, ``STEP:SECONDS``: sleep that long between writing checkpoint STEP's files and
#: its rename, so a test's kill lands inside the write
SLOW_WRITE_ENV = "DATAFLOW_CHECKPOINT_SLOW_WRITE"
#: distributions whose versions every manifest records
VERSIONED = ("dataflow-runtime", "dataflow-training", "torch", "safetensors")

_CONVERTER = cattrs.Converter()


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: names the folder or file and what is wrong."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def train_dict(train: TrainConfig) -> dict[str, Any]:
    return _CONVERTER.unstructure(train)


def train_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    return _CONVERTER.structure(dict(data), TrainConfig)


def plan_hash(program: Any) -> str:
    import hashlib

    return hashlib.sha256(program.to_json(indent=None).encode()).hexdigest()[:16]


def package_versions() -> dict[str, str]:
    out = {}
    for name in VERSIONED:
        try:
            out[name] = metadata.version(name)
        except metadata.PackageNotFoundError:
            out[name] = "not installed"
    return out


def rng_state() -> dict[str, torch.Tensor]:
    state = {"torch": torch.get_rng_state()}
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["cuda"] = torch.cuda.get_rng_state()
    return state


def set_rng_state(state: Mapping[str, torch.Tensor]) -> None:
    if "torch" in state:
        torch.set_rng_state(state["torch"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state(state["cuda"])


def _fsync(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def write_checkpoint(
    path: str | Path,
    weights: Mapping[str, torch.Tensor],
    opt_state: Mapping[str, torch.Tensor],
    manifest: Mapping[str, Any],
) -> Path:
    """Write a complete checkpoint at ``path`` (which must not exist yet), atomically."""
    from safetensors.torch import save_file

    final = Path(path)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
    save_file(tensors, tmp / MODEL_FILE)
    extra = {f"rng/{k}": v.contiguous() for k, v in rng_state().items()}
    opt = {k: v.detach().cpu().contiguous() for k, v in opt_state.items()}
    save_file({**opt, **extra}, tmp / OPTIMIZER_FILE)
    body = {"format": FORMAT, **manifest, "written_unix_s": time.time()}
    (tmp / MANIFEST_FILE).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
    slow_step, _, pause = os.environ.get(SLOW_WRITE_ENV, "").partition(":")
    if slow_step and int(slow_step) == manifest.get("step"):
        time.sleep(float(pause))
    for name in (MODEL_FILE, OPTIMIZER_FILE, MANIFEST_FILE):
        _fsync(tmp / name)
    _fsync(tmp)
    os.replace(tmp, final)
    _fsync(final.parent)
    return final


def read_checkpoint(
    path: str | Path,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict]:
    """``(weights, optimizer state, manifest, rng states)`` of a complete checkpoint; a
    missing, truncated or corrupt file is one ``CheckpointError`` naming it."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} is not a folder")
    manifest_path = folder / MANIFEST_FILE
    try:
        manifest = json.loads(manifest_path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder}: no {MANIFEST_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {manifest_path} is corrupt: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {manifest_path} is not a {FORMAT} manifest")
    loaded = {}
    for name in (MODEL_FILE, OPTIMIZER_FILE):
        file = folder / name
        if not file.is_file():
            raise CheckpointError(f"checkpoint {folder}: no {name}")
        try:
            loaded[name] = load_file(file)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint file {file} is corrupt: {exc}") from None
    opt = {k: v for k, v in loaded[OPTIMIZER_FILE].items() if not k.startswith("rng/")}
    rng = {
        k.removeprefix("rng/"): v for k, v in loaded[OPTIMIZER_FILE].items() if k.startswith("rng/")
    }
    return loaded[MODEL_FILE], opt, manifest, rng


def checkpoints(out: str | Path) -> list[Path]:
    """The complete checkpoints under ``out``, oldest first (partial ``.tmp-*`` folders
    are never listed)."""
    folder = Path(out)
    if not folder.is_dir():
        return []
    found = [
        (int(m.group(1)), p)
        for p in folder.iterdir()
        if p.is_dir() and (m := STEP_PATTERN.match(p.name))
    ]
    return [p for _, p in sorted(found)]


def latest_checkpoint(out: str | Path) -> Path | None:
    found = checkpoints(out)
    return found[-1] if found else None


def resumed_options(out: str | Path, resume: str) -> tuple[Path, dict[str, Any]] | None:
    """``(checkpoint, the options its run was started with)`` of the checkpoint ``--resume``
    names (``auto``: the newest in ``out``), from its manifest; None where there is none or
    its manifest cannot be read (the resume itself then says why, or starts afresh)."""
    folder = latest_checkpoint(out) if resume == "auto" else Path(resume)
    if folder is None:
        return None
    try:
        manifest = json.loads((folder / MANIFEST_FILE).read_text())
    except (OSError, ValueError):
        return None
    options = manifest.get("options") if isinstance(manifest, dict) else None
    return (folder, options) if isinstance(options, dict) else None


def prune(out: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and leftover partial
    folders of processes that are gone; returns what was deleted."""
    found = checkpoints(out)
    doomed = found[:-keep] if keep > 0 else []
    for partial in Path(out).glob(f"{TMP_PREFIX}*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            doomed.append(partial)
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
