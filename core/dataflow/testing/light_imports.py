"""Which heavy modules an entry-point module pulls in when it is imported.

dataflow imports every selected entry-point module on each CLI call, so one that imports
torch (about 2 s) slows every command down; ``heavy_imports`` imports the module in a fresh
interpreter and names what it loaded of ``forbidden``. ``PluginConformance`` and the
core's own test of every installed plugin use it.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections.abc import Sequence

#: What an entry-point module must not import: records import these in their callables.
HEAVY_MODULES: tuple[str, ...] = ("torch", "triton")


def entry_point_module(entry_point: str) -> str:
    """The module of an entry point written ``NAME = MODULE[:ATTR]`` (or ``MODULE[:ATTR]``)."""
    value = entry_point.split(" = ", 1)[-1]
    return value.partition(":")[0].strip()


def heavy_imports(module: str, forbidden: Sequence[str] = HEAVY_MODULES) -> list[str]:
    """The modules of ``forbidden`` that importing ``module`` loads, in a fresh interpreter
    that sees this one's ``sys.path``. Raises ``ImportError`` (with the child's stderr)
    when the module cannot be imported at all."""
    code = (
        "import importlib, json, sys\n"
        f"importlib.import_module({module!r})\n"
        f"print(json.dumps([m for m in {list(forbidden)!r} if m in sys.modules]))\n"
    )
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, sys.path))}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=False, env=env
    )
    if result.returncode != 0:
        raise ImportError(f"importing {module} failed:\n{result.stderr}")
    return json.loads(result.stdout.strip().splitlines()[-1])
