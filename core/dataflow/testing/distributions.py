"""Fake installed distributions, for tests of entry-point loading.

``write_distribution`` writes a ``NAME-VERSION.dist-info`` folder (METADATA and
entry_points.txt) and the modules its entry points name into a folder; with that folder on
``sys.path``, ``importlib.metadata`` sees an installed distribution.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path


def write_distribution(
    site: Path,
    name: str,
    *,
    entry_points: Mapping[str, str],
    modules: Mapping[str, str] | None = None,
    version: str = "1.0",
    group: str = "dataflow",
) -> Path:
    """Write distribution ``name`` into ``site``; returns its dist-info folder.

    ``entry_points`` maps entry-point names to ``module`` or ``module:attribute`` in
    ``group``; ``modules`` maps top-level module names to their source text.
    """
    for module, source in (modules or {}).items():
        if "." in module:
            raise ValueError(f"module {module!r}: only top-level modules are supported")
        (site / f"{module}.py").write_text(source)
    dist_info = site / f"{name.replace('-', '_')}-{version}.dist-info"
    dist_info.mkdir(parents=True)
    (dist_info / "METADATA").write_text(
        f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n"
    )
    lines = [f"[{group}]", *(f"{key} = {value}" for key, value in entry_points.items())]
    (dist_info / "entry_points.txt").write_text("\n".join(lines) + "\n")
    return dist_info
