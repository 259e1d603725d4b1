"""benchmarks/ as a toolbox (docs: benchmarks/README.md): the scripts import the harness
as a package, with no ``sys.path`` edit; every probe says what it answered and when; the
README maps every script, and every committed result, to where it belongs; and every
script imports, so that a harness or API rename cannot leave one behind unseen."""

from __future__ import annotations

import ast
import fnmatch
import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
BENCHMARKS = ROOT / "benchmarks"
README = (BENCHMARKS / "README.md").read_text()
#: an edit of the module path, in any form (insert, append, extend, assignment, slicing)
PATH_EDIT = re.compile(r"\bsys\s*\.\s*path\s*(\.\s*(insert|append|extend)\b|\[|\+?=)")
SCRIPTS = sorted(
    path
    for path in [*BENCHMARKS.rglob("*.py"), *BENCHMARKS.glob("*.sh")]
    if path.name != "__init__.py" and "results" not in path.parts
)
PROBES = sorted(p for p in (BENCHMARKS / "probes").glob("*.py") if p.name != "__init__.py")


def sources() -> list[Path]:
    return [*BENCHMARKS.rglob("*.py"), *(ROOT / "tests" / "benchmarks").glob("*.py")]


def test_nothing_edits_sys_path() -> None:
    edits = [
        f"{path.relative_to(ROOT)}:{number}: {line.strip()}"
        for path in sources()
        if path != Path(__file__).resolve()
        for number, line in enumerate(path.read_text().splitlines(), 1)
        if PATH_EDIT.search(line)
    ]
    assert edits == []


def test_the_path_edit_pattern_finds_each_form() -> None:
    for line in ["sys.path.insert(0, x)", "sys.path.append(x)", "sys.path[:0] = [x]"]:
        assert PATH_EDIT.search(line), line
    assert not PATH_EDIT.search("print(sys.path)")


@pytest.mark.parametrize("probe", PROBES, ids=lambda path: path.stem)
def test_each_probe_starts_with_what_it_answered_and_when(probe: Path) -> None:
    docstring = ast.get_docstring(ast.parse(probe.read_text()))
    first = (docstring or "").splitlines()[0] if docstring else ""
    assert re.fullmatch(r"Probe, \d{4}-\d{2}-\d{2}[^:]*: .+\?", first), first
    assert f"`probes/{probe.name}`" in README


@pytest.mark.parametrize("script", SCRIPTS, ids=lambda path: path.name)
def test_the_readme_maps_each_script(script: Path) -> None:
    assert f"`{script.relative_to(BENCHMARKS).as_posix()}`" in README


def test_the_readme_maps_each_committed_result() -> None:
    named = re.findall(r"`results/([^`\s]+)`", README)
    patterns = [name.split("/")[0] for name in named]
    unmapped = [
        entry.name
        for entry in (BENCHMARKS / "results").iterdir()
        if not any(fnmatch.fnmatch(entry.name, pattern) for pattern in patterns)
    ]
    assert unmapped == []


def module(path: Path) -> str:
    return ".".join(path.relative_to(ROOT).with_suffix("").parts)


@pytest.mark.parametrize(
    "script", [p for p in SCRIPTS if p.suffix == ".py"], ids=lambda path: path.stem
)
def test_each_script_imports(script: Path) -> None:
    pytest.importorskip("torch")
    importlib.import_module(module(script))
