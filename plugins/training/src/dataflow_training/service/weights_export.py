"""``export_weights``: the run's weights as a Hugging Face folder an inference engine
reloads, whole or only the tensors that changed since the last export.

The folder is the family's own HF export (``export_hf``: ``config.json`` and
``model.safetensors``, or shards and their ``model.safetensors.index.json``, as ``dataflow
export --hf`` writes), plus ``EXPORT_FILE``: the step, the SHA-256 of every HF tensor
(its dtype, shape and bytes) and which tensors the folder holds. With ``changed_only`` the
folder keeps only the tensors whose hash differs from the previous export's (an engine
that updates weights in place loads just those; the index names them); a first export has
nothing to compare with and is whole, as its ``changed_only`` field says.

It is written beside its place under a ``.tmp-`` name and renamed into place whole: a
reader never sees half of one (an earlier export at the same place is moved aside first).
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dataflow import fsync_path
from dataflow_training.kit.hf import SAFETENSORS, SAFETENSORS_INDEX

EXPORT_FILE = "dataflow_export.json"
FORMAT = "dataflow.weights_export/v1"


def tensor_sha256(t: torch.Tensor) -> str:
    """The SHA-256 of a tensor's dtype, shape and bytes."""
    digest = hashlib.sha256(f"{t.dtype}:{tuple(t.shape)}:".encode())
    digest.update(t.detach().cpu().contiguous().view(-1).view(torch.uint8).numpy().tobytes())
    return digest.hexdigest()


def export_weights(
    family: Any,
    config: Any,
    weights: Mapping[str, torch.Tensor],
    folder: str | Path,
    *,
    step: int,
    previous: Mapping[str, str] | None,
    changed_only: bool,
    max_shard_bytes: int | None = None,
) -> dict[str, Any]:
    """Write the export (module docstring) into ``folder``; returns its record (what
    ``EXPORT_FILE`` holds), whose ``tensors`` are the hashes the next export compares with.
    ``previous``: the last export's hashes (None: there was none)."""
    final = Path(folder)
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.parent / f".tmp-{final.name}-{os.getpid()}"
    shutil.rmtree(tmp, ignore_errors=True)
    shards = {} if max_shard_bytes is None else {"max_shard_bytes": max_shard_bytes}
    try:
        family.export_hf(config, weights, tmp, **shards)
        tensors = _read_all(tmp)
        hashes = {name: tensor_sha256(t) for name, t in tensors.items()}
        partial = changed_only and previous is not None
        kept = (
            sorted(n for n in hashes if previous.get(n) != hashes[n]) if partial else sorted(hashes)
        )
        if partial:
            _rewrite(tmp, {n: tensors[n] for n in kept}, max_shard_bytes)
        record = {
            "format": FORMAT,
            "step": step,
            "changed_only": partial,
            "tensors": hashes,
            "written": kept,
            "files": sorted(p.name for p in tmp.iterdir()),
        }
        (tmp / EXPORT_FILE).write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        for path in tmp.iterdir():
            fsync_path(path)
        _replace(tmp, final)
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    return record


def _read_all(folder: Path) -> dict[str, torch.Tensor]:
    tensors = {}
    for file in sorted(folder.glob("*.safetensors")):
        with safe_open(str(file), "pt") as opened:
            for name in opened.keys():  # noqa: SIM118 (safe_open is no mapping)
                tensors[name] = opened.get_tensor(name)
    return tensors


def _rewrite(folder: Path, tensors: dict[str, torch.Tensor], max_shard_bytes: int | None) -> None:
    """Replace the folder's tensor files with ``tensors`` alone (shards of at most
    ``max_shard_bytes`` and their index where it is given and they exceed it)."""
    for file in [*folder.glob("*.safetensors"), folder / SAFETENSORS_INDEX]:
        file.unlink(missing_ok=True)
    if not tensors:
        return
    header = {"format": "pt"}
    limit = max_shard_bytes or sum(t.nbytes for t in tensors.values())
    shards: list[list[str]] = [[]]
    filled = 0
    for name, t in tensors.items():
        if shards[-1] and filled + t.nbytes > limit:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += t.nbytes
    if len(shards) == 1:
        save_file(tensors, str(folder / SAFETENSORS), metadata=header)
        return
    weight_map = {}
    for i, shard in enumerate(shards, start=1):
        name = f"model-{i:05d}-of-{len(shards):05d}.safetensors"
        save_file({n: tensors[n] for n in shard}, str(folder / name), metadata=header)
        weight_map |= dict.fromkeys(shard, name)
    total = sum(t.nbytes for t in tensors.values())
    index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
    (folder / SAFETENSORS_INDEX).write_text(json.dumps(index, indent=2) + "\n")


def _replace(tmp: Path, final: Path) -> None:
    """Put ``tmp`` at ``final`` in one rename; an earlier export there goes first."""
    fsync_path(tmp)
    old = None
    if final.exists():
        old = final.parent / f".old-{final.name}-{os.getpid()}"
        os.replace(final, old)
    os.replace(tmp, final)
    fsync_path(final.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
