"""The step search's results kept on disk (``SearchCache``), so that a second ``dataflow
train`` or ``dataflow predict`` of the same inputs prints the same ``search:`` line at
once, saying it came from the cache.

A result is kept in one small JSON file per key under ``searches/`` in the profile
cache's folder (``profile.default_cache_dir``: ``$DATAFLOW_PROFILE_CACHE`` names it,
``off`` turns both off; removing the folder removes the profiles a measured search was
priced by and the searches together). The key (``search_key``) is a digest of
everything the search reads: the family and its preset's config (overrides applied),
the step it starts from (``TrainConfig``: precision, optimizer, clip, freezing, LoRA),
the budget, the backing budget, the host's memory, the pins and what is left to the
search, the pricing's identity (``Pricing.identity``: a hardware entry's roofline and
links, or the profile cache's key: the device, kernels and their code) and the code
that searches (``search_code``: the source of dataflow, the training plugin and the
family). Any of them changing is a miss. A search priced by measurements with no
identity (the profile cache off, or a ``measure`` that names none) is not kept. An
unreadable file is ignored with a one-line warning and written again.
"""

from __future__ import annotations

import hashlib
import json
import os
import sys
import types
import warnings
from functools import cache
from pathlib import Path
from typing import Any

import cattrs

from dataflow_training.plan.search import Searched

#: The version of what a cache file holds (``Searched``'s fields); part of every key
SEARCH_CACHE_VERSION = 1

_CONVERTER = cattrs.Converter(forbid_extra_keys=True)


class SearchCache:
    """Searches on disk, one JSON file per key (module docstring)."""

    def __init__(self, directory: str | Path) -> None:
        self.directory = Path(directory)

    @classmethod
    def default(cls) -> SearchCache | None:
        """The cache beside the profile cache (None when that is off)."""
        from dataflow_training.plan.profile import default_cache_dir  # loads torch

        profiles = default_cache_dir()
        return None if profiles is None else cls(profiles / "searches")

    def path(self, key: str) -> Path:
        return self.directory / f"{key[:32]}.json"

    def get(self, key: str) -> Searched | None:
        """The search kept for ``key`` (``from_cache`` set), or None: none, another key's,
        or unreadable (said in a warning; the caller's search writes it again)."""
        path = self.path(key)
        try:
            text = path.read_text()
        except FileNotFoundError:
            return None
        except OSError as exc:
            _unreadable(path, exc)
            return None
        try:
            entry = json.loads(text)
            if entry.get("key") != key:
                return None  # another key's file (a 128-bit prefix clash)
            found = _CONVERTER.structure(entry["searched"], Searched)
        except (ValueError, TypeError, KeyError, AttributeError, cattrs.BaseValidationError) as exc:
            _unreadable(path, exc)
            return None
        return found.from_the_cache()

    def put(self, key: str, found: Searched) -> None:
        path = self.path(key)
        self.directory.mkdir(parents=True, exist_ok=True)
        partial = path.with_suffix(f".{os.getpid()}.tmp")
        entry = {"key": key, "searched": _CONVERTER.unstructure(found)}
        partial.write_text(json.dumps(entry, indent=None) + "\n")
        partial.replace(path)


def _unreadable(path: Path, exc: Exception) -> None:
    reason = " ".join(str(exc).split()) or type(exc).__name__
    warnings.warn(
        f"the step search's cache file {path} could not be read ({reason[:200]}): searched "
        "again, and written anew",
        RuntimeWarning,
        stacklevel=3,
    )


def search_key(parts: dict[str, Any], family: Any) -> str:
    """The cache key of a search whose inputs are ``parts`` (JSON-able, or given by their
    ``repr``), with the code that searches (``search_code``) and this file's version."""
    whole = {**parts, "code": search_code(_top_package(family)), "version": SEARCH_CACHE_VERSION}
    text = json.dumps(whole, sort_keys=True, default=repr)
    return hashlib.sha256(text.encode()).hexdigest()


def _top_package(family: Any) -> str:
    name = family.__name__ if isinstance(family, types.ModuleType) else type(family).__module__
    return name.partition(".")[0]


@cache
def search_code(family_package: str) -> str:
    """A hash of the Python source of dataflow, the training plugin and the family's
    package (by path and content): what plans, prices and lowers a search's steps."""
    digest = hashlib.sha256()
    for name in sorted({"dataflow", "dataflow_training", family_package}):
        module = sys.modules.get(name)
        path = getattr(module, "__file__", None)
        if path is None:
            continue
        root = Path(path).parent
        for source in sorted(root.rglob("*.py")):
            digest.update(f"{name}/{source.relative_to(root)}".encode())
            digest.update(source.read_bytes())
    return digest.hexdigest()[:16]
