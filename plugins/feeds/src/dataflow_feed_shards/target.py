"""Where ``prepare`` writes: a folder beside the target, claimed as new, continued or
replacing, and renamed into place once complete.

``claim`` looks at the target and at the folders earlier prepares of it left beside it
(``prepared.leftovers``) and decides, by ``mode``:

- ``new``: the target must be new or an empty folder, and nothing be left beside it;
- ``resume``: continue the newest killed prepare's folder (its options and text must be
  this run's), keeping its complete shards; with none, a target already complete with
  these options is left as it is, and an absent or empty one prepared afresh;
- ``replace``: remove what killed prepares left and start afresh; the target, if it holds
  a dataset, stays readable until ``place`` swaps the new one in.

A prepare still running on this host (its pid alive) is never touched.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any

import attrs

from dataflow import fsync_path
from dataflow_feed_shards.errors import FeedError
from dataflow_feed_shards.prepared import (
    MANIFEST,
    REPLACED,
    WRITING,
    Leftover,
    beside,
    leftovers,
    manifest_or_none,
    resume_command,
    write_manifest,
)
from dataflow_feed_shards.shard_format import read_header
from dataflow_feed_shards.tokenizing import META, TOKENIZER_JSON

#: The files a prepared folder holds: what ``--replace`` may remove.
PREPARED_FILES = (MANIFEST, META, TOKENIZER_JSON)


@attrs.frozen
class Claim:
    """The folder this prepare writes (``folder``) and its manifest so far."""

    folder: Path
    manifest: dict[str, Any]
    complete_already: bool = False

    def abandon(self) -> None:
        """Remove the folder: the prepare failed on its input, nothing to continue."""
        shutil.rmtree(self.folder, ignore_errors=True)


def _prepared_only(folder: Path) -> str | None:
    """The first entry of ``folder`` that a prepare did not write, or None."""
    for entry in sorted(folder.iterdir()):
        name = entry.name.removesuffix(".partial")
        if not (entry.is_file() and (name.endswith(".bin") or name in PREPARED_FILES)):
            return entry.name
    return None


def _difference(saved: dict[str, Any], fresh: dict[str, Any]) -> str | None:
    """Why the prepare of ``saved`` cannot be continued by one of ``fresh``, or None."""
    for key, value in fresh["options"].items():
        if saved.get("options", {}).get(key) != value:
            flag = "--" + key.replace("_", "-")
            return f"it was started with {flag} {saved.get('options', {}).get(key)}, this run has {value}"
    if saved.get("source", {}).get("listing_sha256") != fresh["source"]["listing_sha256"]:
        return "the text files changed since (names, sizes or modification times)"
    return None


def _intact(leftover: Leftover) -> None:
    """Check the shards a killed prepare recorded are there as recorded."""
    for shard in leftover.manifest["shards"]:
        path = leftover.path / shard["name"]
        if not path.is_file() or read_header(path)[1] != shard["tokens"]:
            raise FeedError(
                f"{path}: not the shard of {shard['tokens']} tokens {MANIFEST} records; "
                "pass --replace to start over"
            )


def claim(out: Path, mode: str, fresh: dict[str, Any], say: Callable[[str], None]) -> Claim:
    """Decide where this prepare writes (see the module docstring)."""
    here = Path.cwd().resolve()
    if out.resolve() == here or out.resolve() in here.parents:
        # the dataset is renamed into place: never onto the folder the user works in
        raise FeedError(
            f"{out}: is the working directory or holds it; -o takes a folder of the dataset's "
            "own, e.g. -o data/shards"
        )
    found = leftovers(out)
    for leftover in found:
        if leftover.live:
            raise FeedError(
                f"{out}: another dataflow data prepare (pid {leftover.pid}) is writing it now, "
                f"in {leftover.path}; wait for it to finish"
            )
    writing = [leftover for leftover in found if leftover.kind == WRITING]
    if out.exists() and not out.is_dir():
        raise FeedError(f"{out}: is a file; -o takes a folder")
    holds = out.is_dir() and any(out.iterdir())
    manifest = manifest_or_none(out) if holds else None
    folder = beside(out, WRITING, os.getpid())
    if mode == "new":
        if writing:
            raise FeedError(
                f"{out}: a dataflow data prepare of it was killed and left {writing[-1].path} "
                f"({writing[-1].shards} shard(s) written); pass --resume to continue it or "
                "--replace to start over"
            )
        if holds:
            what = (
                f"a prepared dataset ({len(manifest['shards'])} shard(s))"
                if manifest and manifest.get("complete")
                else f"files ({sorted(out.iterdir())[0].name}, ...)"
            )
            raise FeedError(
                f"{out}: already holds {what}; pass --replace to prepare it again, or write "
                "to a new or empty folder"
            )
    if mode == "resume" and holds and not writing:
        if manifest is None or not manifest.get("complete"):
            raise FeedError(
                f"{out}: holds files but no complete {MANIFEST} saying what was written, so "
                "there is nothing to continue; pass --replace to start over"
            )
        problem = _difference(manifest, fresh)
        if problem:
            raise FeedError(
                f"{out}: holds a dataset prepared otherwise ({problem}); pass --replace to "
                "prepare it again"
            )
        _remove([leftover.path for leftover in found], say)
        return Claim(out, manifest, complete_already=True)
    if holds:  # replaced once the new dataset is complete: only what a prepare writes
        foreign = _prepared_only(out)
        if foreign is not None:
            raise FeedError(
                f"{out / foreign}: not a file dataflow data prepare writes; a prepare replaces "
                "only prepared datasets: move it away, or write to another folder"
            )
    out.parent.mkdir(parents=True, exist_ok=True)
    if mode == "resume" and writing:
        latest = writing[-1]
        if latest.manifest is None:
            raise FeedError(
                f"{latest.path}: killed before it recorded anything to continue; pass "
                "--replace to start over"
            )
        problem = _difference(latest.manifest, fresh)
        if problem:
            raise FeedError(
                f"cannot continue {latest.path}: {problem}; pass --replace to start over, or "
                f"continue it as it was started: {resume_command(latest.manifest)}"
            )
        _intact(latest)
        latest.path.rename(folder)  # ours now: a second resume finds it live
        say(f"resume: continuing {latest.path} ({latest.shards} shard(s) kept) in {folder}")
        _remove([leftover.path for leftover in found if leftover is not latest], say)
        manifest = dict(latest.manifest, host=fresh["host"])
        return Claim(folder, manifest)
    if mode == "resume":
        say(f"resume: no unfinished prepare of {out} to continue; preparing it from the start")
    _remove([leftover.path for leftover in found], say)
    folder.mkdir()
    write_manifest(folder, fresh)
    return Claim(folder, fresh)


def _remove(paths: list[Path], say: Callable[[str], None]) -> None:
    for path in paths:
        shutil.rmtree(path)
        say(f"removed {path}, left by an earlier dataflow data prepare")


def place(claimed: Claim, out: Path, say: Callable[[str], None]) -> None:
    """Rename the complete ``claimed.folder`` to ``out``, swapping out a dataset there."""
    fsync_path(claimed.folder)
    old = None
    if out.is_dir() and any(out.iterdir()):
        old = beside(out, REPLACED, os.getpid())
        out.rename(old)
    os.replace(claimed.folder, out)  # onto an empty folder, or none
    fsync_path(out.parent)
    if old is not None:
        shutil.rmtree(old)
        say(f"replaced the dataset that was in {out}")
