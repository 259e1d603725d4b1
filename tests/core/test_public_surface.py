"""Plugins use only the public surface that docs/api.md lists (ARCHITECTURE.md rule 3).

Every ``import`` of a ``dataflow`` or ``dataflow_training`` module in the packages under
families/, resolvers/, kernels/, plugins/ and examples/ (sources and tests) must name a
module listed in docs/api.md, and every name imported from it must be listed under it. A
package's imports of its own modules are exempt (the training plugin's own modules may
use each other's internals). Every listed name must exist, so the page cannot rot.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
SCANNED = ("families", "resolvers", "kernels", "plugins", "examples")
GUARDED = ("dataflow", "dataflow_training")


def public_surface(text: str) -> dict[str, set[str]]:
    """module -> public names, from the page's ``## `module` `` sections and their
    bullets (every backticked name before the bullet's colon)."""
    surface: dict[str, set[str]] = {}
    module, bullet = None, None

    def flush() -> None:
        if module and bullet is not None:
            surface[module].update(re.findall(r"`(\w+)`", bullet.split(": ")[0]))

    for line in text.splitlines():
        heading = re.match(r"^## `([\w.]+)`", line)
        if line.startswith("- ") or line.startswith("#") or not line.strip():
            flush()
            bullet = line[2:] if line.startswith("- ") else None
        elif bullet is not None and line.startswith("  "):
            bullet += " " + line.strip()  # a bullet continued on the next line
        if heading:
            module = heading.group(1)
            surface[module] = set()
        elif line.startswith("## "):
            module = None
    flush()
    return surface


def imports(source: str) -> list[tuple[int, str, list[str]]]:
    """(line, module, imported names) of every absolute import in ``source``."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name, []) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module, [alias.name for alias in node.names]))
    return found


def offenders(source: str, surface: dict[str, set[str]], own: str | None) -> list[str]:
    bad = []
    for line, module, names in imports(source):
        top = module.split(".")[0]
        if top not in GUARDED or top == own:
            continue
        if module not in surface:
            bad.append(f"{line}: {module} (not a public module)")
            continue
        for name in names:
            if name not in surface[module] and f"{module}.{name}" not in surface:
                bad.append(f"{line}: {name} from {module} (not public)")
    return bad


def _own_package(path: Path) -> str | None:
    """The import name of the package a file belongs to (its ``src/<name>`` folder)."""
    for parent in path.parents:
        src = parent / "src"
        if (parent / "pyproject.toml").exists() and src.is_dir():
            names = [p.name for p in src.iterdir() if (p / "__init__.py").exists()]
            return names[0] if names else None
    return None


def test_plugins_import_only_the_public_surface() -> None:
    surface = public_surface(API.read_text())
    found = []
    files = [
        path
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob("*.py"))
        if ".egg-info" not in str(path) and ".nox" not in path.parts
    ]
    assert len(files) > 20, "the scan found almost nothing: is the layout different?"
    for path in files:
        for problem in offenders(path.read_text(), surface, _own_package(path)):
            found.append(f"{path.relative_to(ROOT)}:{problem}")
    assert found == [], "imports outside docs/api.md:\n" + "\n".join(found)


def test_every_listed_name_exists() -> None:
    missing = []
    for module, names in public_surface(API.read_text()).items():
        try:
            imported = importlib.import_module(module)
        except ImportError as error:
            if module.split(".")[0] == "dataflow_training":
                pytest.importorskip("dataflow_training")
            missing.append(f"{module}: {error}")
            continue
        missing += [f"{module}.{name}" for name in names if not _exists(imported, name)]
    assert missing == []


def _exists(module: object, name: str) -> bool:
    if hasattr(module, name):
        return True
    try:  # a submodule (``from dataflow_training import optimizers``)
        importlib.import_module(f"{module.__name__}.{name}")
    except ImportError:
        return False
    return True


def test_the_rule_catches_a_planted_offender() -> None:
    surface = public_surface("## `dataflow.engine`\n\n- `Engine`: runs programs\n")
    assert surface == {"dataflow.engine": {"Engine"}}
    planted = (
        "from dataflow.engine import Engine\n"
        "from dataflow.engine.dispatcher import Dispatcher\n"
        "from dataflow.engine import _internal\n"
        "import dataflow_training.step.lowering\n"
        "from dataflow_family_gpt2 import model\n"
    )
    assert offenders(planted, surface, own=None) == [
        "2: dataflow.engine.dispatcher (not a public module)",
        "3: _internal from dataflow.engine (not public)",
        "4: dataflow_training.step.lowering (not a public module)",
    ]
    assert offenders(planted, surface, own="dataflow_training")[-1].startswith("3:")
