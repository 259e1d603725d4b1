"""Which distributions' plugins load: ``DATAFLOW_LOAD_PLUGINS`` and
``DATAFLOW_DISABLE_PLUGIN_AUTOLOAD``, or the same choice made by arguments.

``DATAFLOW_LOAD_PLUGINS`` (comma-separated distribution names; set but empty = none)
selects exactly those distributions. Otherwise every distribution loads, unless
``DATAFLOW_DISABLE_PLUGIN_AUTOLOAD`` is set (to anything non-empty): then none does.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

import attrs

LOAD_PLUGINS_ENV = "DATAFLOW_LOAD_PLUGINS"
DISABLE_AUTOLOAD_ENV = "DATAFLOW_DISABLE_PLUGIN_AUTOLOAD"


def normalize_distribution(name: str) -> str:
    """A distribution name as packaging compares them: lower case, runs of ``-_.`` → ``-``."""
    return re.sub(r"[-_.]+", "-", name).lower()


@attrs.frozen
class Selection:
    """Which distributions' entry points load; ``why_not`` says why one is left out."""

    allow: frozenset[str] | None  # normalized names; None: decided by ``autoload``
    autoload: bool
    why_not: str

    def admits(self, distribution: str) -> bool:
        if self.allow is not None:
            return normalize_distribution(distribution) in self.allow
        return self.autoload


def select_distributions(autoload: bool | None, allow: Iterable[str] | None) -> Selection:
    """The selection that arguments make; an argument left None is read from the environment.

    ``allow`` (distribution names) selects exactly those; otherwise ``autoload`` decides
    between all and none.
    """
    names: list[str] | None = None
    if allow is not None:
        names = list(allow)
        why_not = f"not in allow={names!r}"
    elif (env := os.environ.get(LOAD_PLUGINS_ENV)) is not None:
        names = [name.strip() for name in env.split(",") if name.strip()]
        why_not = f"not in {LOAD_PLUGINS_ENV}={env!r}"
    if autoload is None:
        autoload = not os.environ.get(DISABLE_AUTOLOAD_ENV)
        off = f"{DISABLE_AUTOLOAD_ENV} is set"
    else:
        off = "autoload=False"
    if names is None:
        return Selection(None, autoload, off)
    return Selection(frozenset(map(normalize_distribution, names)), autoload, why_not)
