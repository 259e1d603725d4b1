"""HF safetensors checkpoints in and out, for any family, driven by its key map.

``read_state`` reads ``model.safetensors`` or a sharded ``model.safetensors.index.json``
into family state (key -> tensor); ``write_state`` writes one file or shards plus an
index. Both check everything before they touch a tensor's data or the disk, and report
every problem at once in one ``CheckpointError``: each part starts with the file at fault
and names the tensors (a shard the index names that is missing, a tensor a shard lacks, a
shape, missing and unexpected tensors, a tied tensor that differs). Only safetensors are
ever read: nothing is unpickled, and ``.bin`` / ``.pt`` files are refused by name.

The family's specifics live in its ``KeyMap`` (``hf_keys.py``): names, transposes,
per-tensor conversions, stacked experts, skipped and tied tensors. ``config.json`` is read
and written here as a plain dict; turning it into a family config is the family's job.
"""

from __future__ import annotations

import json
import os
import uuid
from collections.abc import Iterator, Mapping, Sequence
from contextlib import ExitStack, contextmanager
from math import prod
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open
from safetensors.torch import save_file

from dataflow_training.kit.hf_keys import (
    IDENTITY,
    TRANSPOSE,
    Conversion,
    Entry,
    KeyMap,
    KeyRule,
    offset,
)

__all__ = [
    "CONFIG",
    "IDENTITY",
    "SAFETENSORS",
    "SAFETENSORS_INDEX",
    "TRANSPOSE",
    "CheckpointError",
    "Conversion",
    "Entry",
    "KeyMap",
    "KeyRule",
    "checkpoint_folder",
    "offset",
    "read_config",
    "read_state",
    "write_config",
    "write_state",
]

SAFETENSORS = "model.safetensors"
SAFETENSORS_INDEX = "model.safetensors.index.json"
CONFIG = "config.json"
#: Suffixes of pickle-based checkpoints, which are refused (loading them runs code).
PICKLE_SUFFIXES = frozenset({".bin", ".pt", ".pth", ".ckpt", ".pkl"})


class CheckpointError(ValueError):
    """A checkpoint that cannot be read or written; the message names the file and the
    tensors or fields at fault."""


def _listed(names: Sequence[str], noun: str = "tensor") -> str:
    """``tensor 'a'`` or ``tensors 'a', 'b'``."""
    return f"{noun}{'s' if len(names) > 1 else ''} {', '.join(map(repr, names))}"


def checkpoint_folder(path: str | Path) -> Path:
    """The folder of a checkpoint given as the folder or as a file inside it."""
    path = Path(path)
    return path if path.is_dir() else path.parent


# -- config.json -----------------------------------------------------------------------


def read_config(path: str | Path) -> dict[str, Any]:
    """The ``config.json`` beside a checkpoint (``path``: its folder or a file in it)."""
    folder = checkpoint_folder(path)
    file = folder / CONFIG
    if not file.is_file():
        raise CheckpointError(f"{folder}: no {CONFIG} beside the weights")
    try:
        config = json.loads(file.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as error:
        raise CheckpointError(f"{file}: not valid JSON ({error})") from None
    if not isinstance(config, dict):
        raise CheckpointError(f"{file}: holds a {type(config).__name__}, not a JSON object")
    return config


def write_config(path: str | Path, config: Mapping[str, Any]) -> Path:
    """Write ``config`` as ``path/config.json`` (folder created; replaced atomically)."""
    folder = Path(path)
    folder.mkdir(parents=True, exist_ok=True)
    with _replacing(folder, [CONFIG]) as (temp,):
        temp.write_text(json.dumps(dict(config), indent=2) + "\n")
    return folder / CONFIG


# -- Reading ---------------------------------------------------------------------------

# A stored tensor's file and open handle, or None where its shard could not be opened.
_Located = dict[str, tuple[Path, Any] | None]


def read_state(
    path: str | Path,
    keymap: KeyMap,
    expected: Mapping[str, Sequence[int]],
    *,
    dtype: torch.dtype | None = None,
) -> dict[str, torch.Tensor]:
    """The family state (``expected``'s keys, in its order, contiguous tensors) of the
    checkpoint at ``path``: a folder, a ``.safetensors`` file, or an index file.

    Tensors keep the checkpoint's dtype unless ``dtype`` is given. ``expected`` maps each
    state key to its family shape; every HF tensor the key map derives from it must be
    present with its shape, and every stored tensor must be expected, tied or skipped."""
    entries = keymap.expand(expected)
    with ExitStack() as files:
        where, located, problems = _locate(Path(path), files)
        stored: dict[str, str] = {}  # canonical name -> stored name
        for name in located:
            canonical = keymap.canonical(name)
            if canonical in stored:
                first, second = sorted((stored[canonical], name))
                problems.append(
                    f"{where}: tensors {first!r} and {second!r} are both {canonical!r} under "
                    f"{keymap.family}'s aliases"
                )
            stored[canonical] = name
        problems += _check(entries, keymap, where, located, stored)
        if problems:
            raise CheckpointError("; ".join(problems))

        def read(name: str) -> torch.Tensor:
            _, handle = located[stored[name]]
            return handle.get_tensor(stored[name])

        differ = [
            f"{located[stored[tied]][0]}: tensor {stored[tied]!r} differs from "
            f"{stored[entry.hf_names[0]]!r}, but {keymap.family} ties them (key {entry.key!r})"
            for entry in entries
            for tied in entry.tied
            if tied in stored and not _equal(read(tied), read(entry.hf_names[0]))
        ]
        if differ:
            raise CheckpointError("; ".join(differ))
        return {
            entry.key: entry.from_hf({name: read(name) for name in entry.hf_names}, dtype)
            for entry in entries
        }


def _check(
    entries: Sequence[Entry],
    keymap: KeyMap,
    where: Path,
    located: _Located,
    stored: Mapping[str, str],
) -> list[str]:
    """Missing, mis-shaped and unexpected tensors, without reading any tensor's data."""
    problems: list[str] = []
    missing: dict[str, str] = {}  # HF name -> state key
    wanted: set[str] = set()
    for entry in entries:
        shapes = entry.hf_shapes()
        main = shapes[entry.hf_names[0]]
        shapes.update(dict.fromkeys(entry.tied, main))
        for name, shape in shapes.items():
            wanted.add(name)
            if name not in stored:
                if name not in entry.tied:
                    missing[name] = entry.key
                continue
            if located[stored[name]] is None:
                continue  # its shard is already reported
            file, handle = located[stored[name]]
            found = tuple(handle.get_slice(stored[name]).get_shape())
            if found != shape:
                problems.append(
                    f"{file}: tensor {stored[name]!r} has shape {found}, expected {shape} "
                    f"({keymap.family} key {entry.key!r})"
                )
    if missing:
        keys = list(dict.fromkeys(missing.values()))
        problems.append(
            f"{where}: {_listed(list(missing))} {'are' if len(missing) > 1 else 'is'} missing "
            f"(for {keymap.family} {_listed(keys, 'key')})"
        )
    unexpected: dict[Path, list[str]] = {}
    for canonical, name in stored.items():
        if canonical not in wanted and not keymap.skipped(canonical) and located[name]:
            unexpected.setdefault(located[name][0], []).append(name)
    problems += [
        f"{file}: unexpected {_listed(names)} (no {keymap.family} state key maps to "
        f"{'them' if len(names) > 1 else 'it'})"
        for file, names in unexpected.items()
    ]
    return problems


def _equal(copy: torch.Tensor, original: torch.Tensor) -> bool:
    return torch.equal(copy.to(original.dtype), original)


def _locate(path: Path, files: ExitStack) -> tuple[Path, _Located, list[str]]:
    """(the file that names the tensors, stored name -> (file, handle) or None, problems
    with shards) of the checkpoint at ``path``; handles stay open until ``files`` closes."""
    if not path.exists():
        raise CheckpointError(f"{path}: no such file or folder")
    if path.is_dir():
        if (path / SAFETENSORS).is_file():  # transformers' order: a single file first
            path = path / SAFETENSORS
        elif (path / SAFETENSORS_INDEX).is_file():
            path = path / SAFETENSORS_INDEX
        else:
            present = sorted(p.name for p in path.iterdir())
            pickles = [name for name in present if Path(name).suffix in PICKLE_SUFFIXES]
            raise CheckpointError(
                f"{path}: no {SAFETENSORS} or {SAFETENSORS_INDEX} (found: "
                f"{', '.join(present) or 'nothing'}); only safetensors checkpoints are read"
                + (f" ({', '.join(pickles)}: pickle, never loaded)" if pickles else "")
            )
    if path.suffix in PICKLE_SUFFIXES:
        raise CheckpointError(
            f"{path}: a pickle checkpoint; only safetensors checkpoints are read (nothing is "
            "unpickled: convert it to safetensors first)"
        )
    if path.name.endswith(".index.json"):
        return path, *_locate_shards(path, files)
    if path.suffix != ".safetensors":
        raise CheckpointError(f"{path}: not a .safetensors file or a .index.json index")
    handle = _open(path, files)
    if handle is None:
        raise CheckpointError(f"{path}: not a readable safetensors file")
    return path, dict.fromkeys(handle.keys(), (path, handle)), []


def _locate_shards(index: Path, files: ExitStack) -> tuple[_Located, list[str]]:
    try:
        weight_map = json.loads(index.read_text()).get("weight_map")
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError) as error:
        raise CheckpointError(f"{index}: not a safetensors index ({error})") from None
    if not isinstance(weight_map, dict) or not all(
        isinstance(value, str) for value in weight_map.values()
    ):
        raise CheckpointError(f"{index}: no 'weight_map' object of tensor name -> file name")
    by_file: dict[str, list[str]] = {}
    for name, file in weight_map.items():
        by_file.setdefault(file, []).append(name)
    located: _Located = {}
    problems = []
    for file, names in by_file.items():
        shard = index.parent / file
        located.update(dict.fromkeys(names))
        if Path(file).is_absolute() or ".." in Path(file).parts:
            problems.append(f"{index}: names file {file!r}, outside the checkpoint's folder")
        elif shard.suffix != ".safetensors":
            problems.append(f"{index}: names file {file!r}, which is not a .safetensors file")
        elif not shard.is_file():
            problems.append(
                f"{index}: names file {file!r}, which does not exist (it holds {_listed(names)})"
            )
        elif (handle := _open(shard, files)) is None:
            problems.append(f"{shard}: not a readable safetensors file")
        else:
            present = set(handle.keys())
            lacking = [name for name in names if name not in present]
            if lacking:
                problems.append(f"{shard}: lacks {_listed(lacking)} that {index.name} puts there")
            located.update({name: (shard, handle) for name in names if name in present})
    return located, problems


def _open(file: Path, files: ExitStack) -> Any | None:
    try:
        return files.enter_context(safe_open(file, framework="pt"))
    except (SafetensorError, OSError):
        return None


# -- Writing ---------------------------------------------------------------------------


def write_state(
    path: str | Path,
    keymap: KeyMap,
    state: Mapping[str, torch.Tensor],
    expected: Mapping[str, Sequence[int]],
    *,
    max_shard_bytes: int | None = None,
    metadata: Mapping[str, str] | None = None,
) -> list[Path]:
    """Write ``state`` (``expected``'s keys and shapes) into the folder ``path``: one
    ``model.safetensors``, or, when the tensors exceed ``max_shard_bytes``, shards
    ``model-00001-of-0000N.safetensors`` and a ``model.safetensors.index.json``. Returns the
    files written.

    Nothing is written unless every key is present with its shape. Each file is written
    under a temporary name and renamed into place, so a failure leaves no half-written
    file; a previous checkpoint of the other layout in the folder is removed. ``metadata``
    goes into each file's header (``format: pt`` always)."""
    folder = Path(path)
    entries = keymap.expand(expected)
    missing = [entry.key for entry in entries if entry.key not in state]
    problems = [f"state has no {_listed(missing)}"] if missing else []
    extra = [key for key in state if key not in expected]
    if extra:
        problems.append(
            f"state has {_listed(extra)} that the expected {keymap.family} state does not have"
        )
    problems += [
        f"tensor {entry.key!r} has shape {tuple(state[entry.key].shape)}, expected {entry.shape}"
        for entry in entries
        if entry.key in state and tuple(state[entry.key].shape) != entry.shape
    ]
    if problems:
        raise CheckpointError(f"export to {folder}: " + "; ".join(problems))
    if max_shard_bytes is not None and max_shard_bytes < 1:
        raise CheckpointError(f"export to {folder}: max_shard_bytes = {max_shard_bytes} < 1")

    header = {"format": "pt", **(metadata or {})}
    sizes = {
        name: prod(shape) * state[entry.key].element_size()
        for entry in entries
        for name, shape in entry.hf_shapes().items()
    }
    total = sum(sizes.values())
    shards = _shards(sizes, total if max_shard_bytes is None else max_shard_bytes)
    tensors = _hf_tensors(entries, state)
    folder.mkdir(parents=True, exist_ok=True)
    old_shards = _indexed_files(folder)
    if len(shards) == 1:
        with _replacing(folder, [SAFETENSORS]) as (temp,):
            save_file(_take(tensors, shards[0]), str(temp), metadata=header)
        for file in (*old_shards, SAFETENSORS_INDEX):
            (folder / file).unlink(missing_ok=True)
        return [folder / SAFETENSORS]

    names = [f"model-{i:05d}-of-{len(shards):05d}.safetensors" for i in range(1, len(shards) + 1)]
    # A single file would shadow the new index (readers try it first): it goes first.
    with _replacing(folder, [*names, SAFETENSORS_INDEX], before=SAFETENSORS) as temps:
        for temp, shard in zip(temps, shards, strict=False):
            save_file(_take(tensors, shard), str(temp), metadata=header)
        weight_map = {
            name: file for file, shard in zip(names, shards, strict=True) for name in shard
        }
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        temps[-1].write_text(json.dumps(index, indent=2) + "\n")
    for file in old_shards - set(names):
        (folder / file).unlink(missing_ok=True)
    return [folder / name for name in (*names, SAFETENSORS_INDEX)]


def _shards(sizes: Mapping[str, int], max_bytes: int) -> list[list[str]]:
    """HF names in order, cut into runs of at most ``max_bytes`` (a larger tensor alone)."""
    shards: list[list[str]] = [[]]
    filled = 0
    for name, size in sizes.items():
        if shards[-1] and filled + size > max_bytes:
            shards.append([])
            filled = 0
        shards[-1].append(name)
        filled += size
    return shards


def _hf_tensors(
    entries: Sequence[Entry], state: Mapping[str, torch.Tensor]
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) in the order of ``sizes``, converted one entry at a time."""
    for entry in entries:
        yield from entry.to_hf(state[entry.key].detach().cpu()).items()


def _take(
    tensors: Iterator[tuple[str, torch.Tensor]], names: Sequence[str]
) -> dict[str, torch.Tensor]:
    """The next ``len(names)`` HF tensors (which are ``names``), copied where their bytes
    overlap another's in the file (safetensors refuses that: two state keys holding one
    tensor). Disjoint views of one buffer, the usual family state, are not copied."""
    taken: dict[int, list[tuple[int, int]]] = {}  # storage -> byte ranges in this file
    out = {}
    for expected, (name, tensor) in zip(names, tensors, strict=False):  # leaves the rest
        assert name == expected, (name, expected)  # sizes and tensors walk the same entries
        start = tensor.data_ptr()
        ranges = taken.setdefault(tensor.untyped_storage().data_ptr(), [])
        if any(start < end and begin < start + tensor.nbytes for begin, end in ranges):
            tensor = tensor.clone()
        else:
            ranges.append((start, start + tensor.nbytes))
        out[name] = tensor
    return out


@contextmanager
def _replacing(
    folder: Path, names: Sequence[str], before: str | None = None
) -> Iterator[list[Path]]:
    """Temporary paths for ``names`` in ``folder``; when the block succeeds the file
    ``before`` is removed and they are renamed into place in order; when it fails they are
    deleted and nothing else changes."""
    tag = uuid.uuid4().hex[:8]
    temps = [folder / f".{name}.{tag}.tmp" for name in names]
    try:
        yield temps
        if before is not None:
            (folder / before).unlink(missing_ok=True)
        for temp, name in zip(temps, names, strict=True):
            os.replace(temp, folder / name)
    finally:
        for temp in temps:
            temp.unlink(missing_ok=True)


def _indexed_files(folder: Path) -> set[str]:
    """The shard files an existing index in ``folder`` names (plain names only)."""
    index = folder / SAFETENSORS_INDEX
    if not index.is_file():
        return set()
    try:
        files = set(json.loads(index.read_text()).get("weight_map", {}).values())
    except (json.JSONDecodeError, UnicodeDecodeError, AttributeError):
        return set()
    return {
        file
        for file in files
        if isinstance(file, str)
        and Path(file).name == file
        and file.endswith(".safetensors")
        and file != SAFETENSORS
    }
