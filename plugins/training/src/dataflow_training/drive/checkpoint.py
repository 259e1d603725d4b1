"""Training checkpoints: safetensors for tensors, a JSON manifest for everything else.

A checkpoint is a folder ``step_NNNNNN`` holding

- ``model.safetensors``: the model state, ``{"<layer>.<param>": tensor}``;
- ``optimizer.safetensors``: each ``O_*`` object's raw bytes (uint8), plus the RNG
  states under ``rng/<name>``;
- ``manifest.json``, written last: its format (the schema version), step, TrainConfig,
  family/preset/overrides, plan hash, package versions, the SHA-256 of each tensor file
  (``files``) and whatever the driver adds (feed position, loss history tail, schedule).

It is written into ``.tmp-<name>-<pid>`` beside its final place, every file fsynced, then
renamed in one step and the parent folder fsynced: a folder named ``step_*`` is always
complete. A checkpoint is *intact* when its manifest reads, names its own folder's step
and every file's checksum matches (``problem_of``); reading one checks that, and
``--resume auto`` takes the newest intact one (``intact_checkpoint``), saying which it
skipped and why. Nothing is ever unpickled (safetensors and JSON only). See
docs/checkpointing.md.
"""

from __future__ import annotations

import errno
import hashlib
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
from safetensors import SafetensorError
from safetensors.torch import load_file, save_file

from dataflow import fsync_path
from dataflow_training.step.config import TrainConfig, omit_empty_freeze

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
omit_empty_freeze(_CONVERTER)


class CheckpointError(ValueError):
    """A checkpoint that cannot be read: names the folder or file and what is wrong."""


class CheckpointWriteError(RuntimeError):
    """A checkpoint that could not be written: names it and the cause; nothing of it is
    left behind."""


def step_name(step: int) -> str:
    return f"step_{step:06d}"


def train_dict(train: TrainConfig) -> dict[str, Any]:
    return _CONVERTER.unstructure(train)


def train_from_dict(data: Mapping[str, Any]) -> TrainConfig:
    return _CONVERTER.structure(dict(data), TrainConfig)


def plan_hash(program: Any) -> str:

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


def write_checkpoint(
    path: str | Path,
    weights: Mapping[str, torch.Tensor],
    opt_state: Mapping[str, torch.Tensor],
    manifest: Mapping[str, Any],
) -> Path:
    """Write a complete checkpoint at ``path`` (which must not exist yet), atomically."""

    final = Path(path)
    if final.exists():
        raise FileExistsError(f"checkpoint {final} already exists")
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f"{TMP_PREFIX}{final.name}-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    try:
        tmp.mkdir()
        tensors = {k: v.detach().cpu().contiguous() for k, v in weights.items()}
        save_file(tensors, tmp / MODEL_FILE)
        extra = {f"rng/{k}": v.contiguous() for k, v in rng_state().items()}
        opt = {k: v.detach().cpu().contiguous() for k, v in opt_state.items()}
        save_file({**opt, **extra}, tmp / OPTIMIZER_FILE)
        files = {name: file_sha256(tmp / name) for name in (MODEL_FILE, OPTIMIZER_FILE)}
        body = {"format": FORMAT, **manifest, "files": files, "written_unix_s": time.time()}
        (tmp / MANIFEST_FILE).write_text(json.dumps(body, indent=1, sort_keys=True) + "\n")
        slow_step, _, pause = os.environ.get(SLOW_WRITE_ENV, "").partition(":")
        if slow_step and int(slow_step) == manifest.get("step"):
            time.sleep(float(pause))
        for name in (MODEL_FILE, OPTIMIZER_FILE, MANIFEST_FILE):
            fsync_path(tmp / name)
        fsync_path(tmp)
        os.replace(tmp, final)
        fsync_path(final.parent)
    except Exception as exc:  # a full disk, a read-only or vanished folder: keep nothing
        shutil.rmtree(tmp, ignore_errors=True)
        if isinstance(exc, OSError) or type(exc).__name__ == "SafetensorError":
            raise CheckpointWriteError(
                f"cannot write checkpoint {final}: {os_cause(exc)}; what this write had "
                "written is removed and the earlier checkpoints are intact"
            ) from exc
        raise
    return final


def os_cause(exc: BaseException) -> str:
    """What an I/O error was, in words a user acts on: no space, read-only, permission."""
    number = getattr(exc, "errno", None)
    if number is None:  # safetensors reports the OS error inside its message
        match = re.search(r"os error (\d+)", str(exc))
        number = int(match.group(1)) if match else None
    names = {
        errno.ENOSPC: "no space left on the device",
        errno.EDQUOT: "the disk quota is used up",
        errno.EROFS: "the file system is read-only",
        errno.EACCES: "permission denied",
        errno.EPERM: "permission denied",
    }
    if number in names:
        return f"{names[number]} ({errno.errorcode[number]})"
    return getattr(exc, "strerror", None) or str(exc)


def remove_leftovers(out: str | Path) -> list[Path]:
    """Delete the partial ``.tmp-*`` checkpoint folders under ``out`` whose writing
    process is gone (a kill mid-write); returns what was deleted."""
    doomed = []
    for partial in Path(out).glob(f"{TMP_PREFIX}*"):
        pid = partial.name.rsplit("-", 1)[-1]
        if pid.isdigit() and int(pid) != os.getpid() and not _alive(int(pid)):
            doomed.append(partial)
            shutil.rmtree(partial, ignore_errors=True)
    return doomed


#: digests this process computed, by (file, size, modification time): a resume checks the
#: checkpoint it picks (``intact_checkpoint``), then reads it (``read_checkpoint``), and the
#: command line read its options first; a file not changed since is not read again
_DIGESTS: dict[tuple[str, int, int], str] = {}


def file_sha256(path: Path) -> str:
    """The SHA-256 of a file, read in 16 MiB pieces (about 1-2 GB/s: a minute for an 8B
    model's 64 GB of weights and AdamW state), once per process while the file is
    unchanged (same size and modification time)."""
    stat = path.stat()
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    if key not in _DIGESTS:
        digest = hashlib.sha256()
        with path.open("rb") as file:
            while piece := file.read(16 * 2**20):
                digest.update(piece)
        _DIGESTS[key] = digest.hexdigest()
    return _DIGESTS[key]


def read_manifest(folder: Path) -> dict[str, Any]:
    """A checkpoint's manifest; ``CheckpointError`` naming the file when it is missing,
    not JSON, not a manifest of this format, or of another step than its folder's."""
    path = folder / MANIFEST_FILE
    try:
        manifest = json.loads(path.read_text())
    except FileNotFoundError:
        raise CheckpointError(f"checkpoint {folder}: no {MANIFEST_FILE}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise CheckpointError(f"checkpoint file {path} is corrupt: {exc}") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise CheckpointError(f"checkpoint file {path} is not a {FORMAT} manifest")
    named = STEP_PATTERN.match(folder.name)
    if named and manifest.get("step") != int(named.group(1)):
        raise CheckpointError(
            f"checkpoint file {path} says step {manifest.get('step')!r}; its folder is "
            f"step {int(named.group(1))}"
        )
    return manifest


def problem_of(
    folder: str | Path, files: tuple[str, ...] = (MODEL_FILE, OPTIMIZER_FILE)
) -> str | None:
    """Why the checkpoint at ``folder`` is not intact (its manifest, or one of ``files``
    missing or not matching the manifest's checksum), or None when it is. A manifest
    written before checksums were kept is taken as it is."""
    folder = Path(folder)
    try:
        manifest = read_manifest(folder)
    except CheckpointError as exc:
        return str(exc)
    sums = manifest.get("files", {})
    for name in files:
        file = folder / name
        if not file.is_file():
            return f"checkpoint {folder}: no {name}"
        if name in sums and file_sha256(file) != sums[name]:
            return f"checkpoint file {file} is corrupt: its checksum is not the manifest's"
    return None


def read_checkpoint(
    path: str | Path, *, weights_only: bool = False
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, Any], dict]:
    """``(weights, optimizer state, manifest, rng states)`` of an intact checkpoint; a
    missing, truncated, corrupt or damaged file (``problem_of``) is one ``CheckpointError``
    naming it. ``weights_only`` reads and checks the model file alone (an export needs no
    optimizer state): the optimizer state and rng states come back empty."""

    folder = Path(path)
    if not folder.is_dir():
        raise CheckpointError(f"checkpoint {folder} is not a folder")
    names = (MODEL_FILE,) if weights_only else (MODEL_FILE, OPTIMIZER_FILE)
    problem = problem_of(folder, names)
    if problem is not None:
        raise CheckpointError(problem)
    manifest = read_manifest(folder)
    loaded = {OPTIMIZER_FILE: {}}
    for name in names:
        file = folder / name
        try:
            loaded[name] = load_file(file)
        except (SafetensorError, OSError, ValueError, RuntimeError) as exc:
            raise CheckpointError(f"checkpoint file {file} is corrupt: {exc}") from None
    opt = {k: v for k, v in loaded[OPTIMIZER_FILE].items() if not k.startswith("rng/")}
    rng = {
        k.removeprefix("rng/"): v for k, v in loaded[OPTIMIZER_FILE].items() if k.startswith("rng/")
    }
    return loaded[MODEL_FILE], opt, manifest, rng


def intact_checkpoint(out: str | Path, say: Any = None) -> Path | None:
    """The newest intact checkpoint under ``out`` (``problem_of``), saying of each newer
    one that is not why it was skipped (``say``); None where there is no checkpoint. When
    there are checkpoints but none is intact, a ``CheckpointError`` with the newest one's
    problem (a run never starts over in a folder whose checkpoints it cannot read)."""
    found = checkpoints(out)
    problems = []
    for folder in reversed(found):
        problem = problem_of(folder)
        if problem is None:
            return folder
        problems.append(problem)
        if say is not None:
            say(f"resume: skipped {folder.name}: {problem}")
    if problems:
        raise CheckpointError(f"no intact checkpoint in {out}: {problems[0]}")
    return None


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
    folder = intact_checkpoint(out) if resume == "auto" else Path(resume)
    if folder is None:
        return None
    try:
        manifest = read_manifest(folder)
    except CheckpointError:
        if resume != "auto":  # the checkpoint asked for: say what is wrong with it
            raise
        return None
    options = manifest.get("options") if isinstance(manifest, dict) else None
    return (folder, options) if isinstance(options, dict) else None


def prune(out: str | Path, keep: int) -> list[Path]:
    """Delete all but the newest ``keep`` complete checkpoints, and leftover partial
    folders of processes that are gone; returns what was deleted."""
    found = checkpoints(out)
    doomed = found[:-keep] if keep > 0 else []
    for path in doomed:
        shutil.rmtree(path, ignore_errors=True)
    return doomed + remove_leftovers(out)


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True
