"""``prepared.json``: the record ``data prepare`` keeps of a dataset, and the folders a
killed prepare leaves beside its target.

``prepare`` writes into ``.NAME.prepare-PID`` beside the target folder ``NAME``. Its
``prepared.json`` is rewritten after every shard (``complete: false``, the shards so far,
each with where in the text the next one starts) and, last, with ``complete: true``; only
then is the folder renamed to ``NAME``. So a folder whose ``prepared.json`` is not
complete is a prepare that was killed or is still running, and the shards feed refuses
it; a folder without one (shards from llm.c's own scripts, or from an older dataflow) is
read as before.
"""

from __future__ import annotations

import glob
import json
import os
import shlex
import socket
from pathlib import Path
from typing import Any

import attrs

from dataflow_feed_shards.errors import FeedError

MANIFEST = "prepared.json"
FORMAT = "dataflow.prepared/v1"
#: The suffixes of the folders a prepare keeps beside its target: the one it writes, and
#: the old dataset a ``--replace`` moves aside for the moment it swaps the new one in.
WRITING, REPLACED = "prepare", "replaced"


def read_manifest(folder: Path) -> dict[str, Any] | None:
    """The ``prepared.json`` of ``folder``, or None when it has none."""
    path = folder / MANIFEST
    if not path.is_file():
        return None
    try:
        manifest = json.loads(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise FeedError(f"{path}: not readable JSON ({exc})") from None
    if not isinstance(manifest, dict) or manifest.get("format") != FORMAT:
        raise FeedError(f"{path}: not a {FORMAT} manifest of dataflow data prepare")
    return manifest


def write_manifest(folder: Path, manifest: dict[str, Any]) -> None:
    """Write ``prepared.json`` whole or not at all (a temporary file, fsynced, renamed)."""
    partial = folder / (MANIFEST + ".partial")
    with open(partial, "w", encoding="utf-8") as out:
        out.write(json.dumps(manifest, indent=1) + "\n")
        out.flush()
        os.fsync(out.fileno())
    partial.replace(folder / MANIFEST)


def resume_command(manifest: dict[str, Any]) -> str:
    """The ``dataflow data prepare ... --resume`` that finishes the prepare of ``manifest``."""
    options = manifest.get("options") or {}
    words = ["dataflow", "data", "prepare", "--text", str(options.get("text"))]
    words += ["--tokenizer", str(options.get("tokenizer")), "-o", str(manifest.get("target"))]
    words += ["--shard-tokens", str(options.get("shard_tokens"))]
    if options.get("val_tokens"):
        words += ["--val-tokens", str(options.get("val_tokens"))]
    return shlex.join([*words, "--resume"])


def unfinished(folder: Path, manifest: dict[str, Any], spec: str) -> FeedError:
    """The error for a folder an unfinished prepare wrote: what it is, and what to run."""
    shards = len(manifest.get("shards") or [])
    return FeedError(
        f"{spec}: {folder} is an unfinished dataflow data prepare ({shards} shard(s) "
        f"written, its {MANIFEST} not complete); finish it with: {resume_command(manifest)}"
    )


@attrs.frozen
class Leftover:
    """A folder a prepare of ``target`` keeps beside it: ``kind`` ``WRITING`` (the dataset
    being written) or ``REPLACED`` (the old one, during a ``--replace``'s swap)."""

    path: Path
    kind: str
    pid: int
    manifest: dict[str, Any] | None

    @property
    def live(self) -> bool:
        """Whether the prepare that owns it still runs (on this host)."""
        manifest = self.manifest or {}
        if manifest.get("host") not in (None, socket.gethostname()):
            return False  # another machine's: not ours to judge, and not ours to wait for
        try:
            os.kill(self.pid, 0)
        except ProcessLookupError:
            return False
        except PermissionError:  # another user's process
            return True
        return self.pid != os.getpid()

    @property
    def shards(self) -> int:
        return len((self.manifest or {}).get("shards") or [])


def beside(target: Path, kind: str, pid: int) -> Path:
    """The folder of ``kind`` that process ``pid`` keeps beside ``target``."""
    return target.parent / f".{target.name}.{kind}-{pid}"


def leftovers(target: Path) -> list[Leftover]:
    """The folders prepares of ``target`` keep beside it, oldest first."""
    if not target.parent.is_dir():
        return []
    found = []
    for kind in (WRITING, REPLACED):
        for path in target.parent.glob(f".{glob.escape(target.name)}.{kind}-*"):
            pid = path.name.rpartition("-")[2]
            if path.is_dir() and pid.isdigit():
                manifest = manifest_or_none(path)
                found.append(Leftover(path, kind, int(pid), manifest))
    return sorted(found, key=lambda leftover: leftover.path.stat().st_mtime)


def manifest_or_none(folder: Path) -> dict[str, Any] | None:
    """The ``prepared.json`` of ``folder``, or None when it has none or none readable."""
    try:
        return read_manifest(folder)
    except FeedError:  # a kill before the first manifest was whole: nothing to continue
        return None


def missing_target_error(target: Path, spec: str) -> FeedError | None:
    """For a ``target`` that does not exist: what a prepare of it left beside it, or None."""
    writing = [leftover for leftover in leftovers(target) if leftover.kind == WRITING]
    if not writing:
        return None
    latest = writing[-1]
    if latest.live:
        return FeedError(
            f"{spec}: {target} does not exist yet: dataflow data prepare (pid {latest.pid}) "
            f"is writing it now, in {latest.path}; wait for it to finish"
        )
    if latest.manifest:
        finish = resume_command(latest.manifest)
    else:  # killed before its first manifest: only the command line knows what it was
        finish = f"dataflow data prepare ... -o {target} --replace"
    return FeedError(
        f"{spec}: {target} does not exist: a dataflow data prepare of it did not finish "
        f"({latest.shards} shard(s) written, in {latest.path}); finish it with: {finish}"
    )


def check_listing(folder: Path, names: list[str], spec: str) -> dict[str, int] | None:
    """The shards (name -> tokens) ``prepared.json`` of ``folder`` lists, checked against
    the ``*.bin`` ``names`` the folder holds; None for a folder without one."""
    manifest = read_manifest(folder)
    if manifest is None:
        return None
    if manifest.get("complete") is not True:
        raise unfinished(folder, manifest, spec)
    listed = {shard["name"]: shard["tokens"] for shard in manifest.get("shards") or []}
    missing = sorted(listed.keys() - set(names))
    if missing:
        raise FeedError(
            f"{spec}: {folder / missing[0]} is missing: {MANIFEST} lists {len(listed)} "
            f"shard(s) and {len(missing)} of them are gone; prepare the folder again "
            "(dataflow data prepare ... --replace)"
        )
    extra = sorted(set(names) - listed.keys())
    if extra:
        raise FeedError(
            f"{spec}: {folder / extra[0]} is not one of the {len(listed)} shard(s) "
            f"{MANIFEST} lists: move it out of the folder"
        )
    return listed
