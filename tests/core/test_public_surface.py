"""Plugins use only the public facades that docs/api.md documents (ARCHITECTURE.md rule 3).

Every ``import`` of a ``dataflow`` or ``dataflow_training`` module in the packages under
families/, resolvers/, kernels/, plugins/ and examples/ (sources and tests), and in the
Python blocks of the docs and of those packages' pages, must name a facade (a module with
a ``## `module` `` section on the page), and every name imported from it must be listed
there. A package's imports of its own modules are exempt (the training plugin's own modules
may use each other's internals). Each facade's ``__all__`` is exactly what its section
lists, every name in it resolves, and importing a facade imports no torch.
"""

from __future__ import annotations

import ast
import importlib
import re
from pathlib import Path

import pytest

from dataflow.testing import heavy_imports

ROOT = Path(__file__).resolve().parents[2]
API = ROOT / "docs" / "api.md"
SCANNED = ("families", "resolvers", "kernels", "plugins", "examples")
GUARDED = ("dataflow", "dataflow_training")
FENCE = re.compile(r"^[ \t]*```python\n(?P<body>.*?)^[ \t]*```[ \t]*$", re.MULTILINE | re.DOTALL)


def public_surface(text: str) -> dict[str, list[str]]:
    """facade -> its public names in page order, from the page's ``## `module` `` sections
    and their bullets (every backticked name before the bullet's colon); ``###``
    subsections group a facade's bullets."""
    surface: dict[str, list[str]] = {}
    module, bullet = None, None

    def flush() -> None:
        if module and bullet is not None:
            surface[module] += re.findall(r"`(\w+)`", bullet.split(": ")[0])

    for line in text.splitlines():
        heading = re.match(r"^## `([\w.]+)`", line)
        if line.startswith("- ") or line.startswith("#") or not line.strip():
            flush()
            bullet = line[2:] if line.startswith("- ") else None
        elif bullet is not None and line.startswith("  "):
            bullet += " " + line.strip()  # a bullet continued on the next line
        if heading:
            module = heading.group(1)
            surface[module] = []
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


def offenders(source: str, surface: dict[str, list[str]], own: str | None) -> list[str]:
    bad = []
    for line, module, names in imports(source):
        top = module.split(".")[0]
        if top not in GUARDED or top == own:
            continue
        if module not in surface:
            bad.append(f"{line}: {module} (not a facade)")
            continue
        bad += [
            f"{line}: {name} from {module} (not public)"
            for name in names
            if name not in surface[module]
        ]
    return bad


def _own_package(path: Path) -> str | None:
    """The import name of the package a file belongs to (its ``src/<name>`` folder)."""
    for parent in path.parents:
        src = parent / "src"
        if (parent / "pyproject.toml").exists() and src.is_dir():
            names = [p.name for p in src.iterdir() if (p / "__init__.py").exists()]
            return names[0] if names else None
    return None


def _scanned(suffix: str) -> list[Path]:
    return [
        path
        for folder in SCANNED
        for path in sorted((ROOT / folder).rglob(f"*{suffix}"))
        if ".egg-info" not in str(path) and ".nox" not in path.parts
    ]


def python_blocks(text: str) -> list[tuple[int, str]]:
    """(line, source) of every ``python`` block of a Markdown page, dedented."""
    blocks = []
    for match in FENCE.finditer(text):
        body = match["body"]
        indent = min((len(s) - len(s.lstrip()) for s in body.splitlines() if s.strip()), default=0)
        source = "\n".join(s[indent:] for s in body.splitlines())
        blocks.append((text.count("\n", 0, match.start()) + 1, source))
    return blocks


def test_plugins_import_only_the_facades() -> None:
    surface = public_surface(API.read_text())
    files = _scanned(".py")
    assert len(files) > 20, "the scan found almost nothing: is the layout different?"
    found = [
        f"{path.relative_to(ROOT)}:{problem}"
        for path in files
        for problem in offenders(path.read_text(), surface, _own_package(path))
    ]
    assert found == [], "imports past the facades of docs/api.md:\n" + "\n".join(found)


def test_the_docs_show_only_facade_imports() -> None:
    surface = public_surface(API.read_text())
    pages = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md")), *_scanned(".md")]
    found = []
    for page in pages:
        for line, source in python_blocks(page.read_text()):
            for problem in offenders(source, surface, own=None):
                number, _, rest = problem.partition(": ")
                found.append(f"{page.relative_to(ROOT)}:{line + int(number)}: {rest}")
    assert found == [], "docs importing past the facades:\n" + "\n".join(found)


@pytest.mark.parametrize("facade", list(public_surface(API.read_text())))
def test_each_facade_exports_exactly_what_the_page_lists(facade: str) -> None:
    if facade.split(".")[0] == "dataflow_training":
        pytest.importorskip("dataflow_training")
    module = importlib.import_module(facade)
    listed = public_surface(API.read_text())[facade]
    assert len(listed) == len(set(listed)), f"a name listed twice under {facade}"
    assert len(module.__all__) == len(set(module.__all__)), f"{facade}.__all__ repeats a name"
    assert sorted(module.__all__) == sorted(listed)
    unresolved = [name for name in module.__all__ if getattr(module, name, None) is None]
    assert unresolved == []
    assert sorted(set(dir(module)) & set(listed)) == sorted(listed)


@pytest.mark.parametrize("facade", list(public_surface(API.read_text())))
def test_importing_a_facade_imports_no_torch(facade: str) -> None:
    if facade.split(".")[0] == "dataflow_training":
        pytest.importorskip("dataflow_training")
    assert heavy_imports(facade) == []


def test_the_rule_catches_a_planted_offender() -> None:
    surface = public_surface("## `dataflow`\n\n### Engine\n\n- `Engine`, `plan`: runs programs\n")
    assert surface == {"dataflow": ["Engine", "plan"]}
    planted = (
        "from dataflow import Engine\n"
        "from dataflow.engine import Engine\n"
        "from dataflow import _internal\n"
        "import dataflow_training.step.lowering\n"
        "from dataflow_family_gpt2 import model\n"
        "import dataflow\n"
    )
    assert offenders(planted, surface, own=None) == [
        "2: dataflow.engine (not a facade)",
        "3: _internal from dataflow (not public)",
        "4: dataflow_training.step.lowering (not a facade)",
    ]
    assert offenders(planted, surface, own="dataflow_training")[-1].startswith("3:")
    page = "Text.\n\n```python\nfrom dataflow import plan\nfrom dataflow.sim import simulate\n```\n"
    [(line, source)] = python_blocks(page)
    assert [line + int(p.split(":")[0]) for p in offenders(source, surface, None)] == [5]
