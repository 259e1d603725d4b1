"""The command group: the one-way dependency on the plugin manager, and the error lines."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import click
import pytest

import dataflow.plugins
from dataflow.cli.errors import describe, one_line
from dataflow.cli.main import split_debug


def _imported_modules(path: Path) -> set[str]:
    tree = ast.parse(path.read_text())
    found = set()
    for node in ast.walk(tree):  # module level and inside functions alike
        if isinstance(node, ast.Import):
            found |= {alias.name for alias in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module:
            found.add(node.module)
    return found


def test_the_plugin_manager_never_imports_the_cli() -> None:
    imported = _imported_modules(Path(dataflow.plugins.__file__))
    assert not [m for m in imported if m == "dataflow.cli" or m.startswith("dataflow.cli.")]
    assert "dataflow" in {m.split(".")[0] for m in imported}  # the scan sees imports at all


def test_importing_the_plugin_manager_loads_no_cli() -> None:
    code = (
        "import sys, dataflow.plugins\n"
        "print(sorted(m for m in sys.modules if m.startswith('dataflow.cli')))"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert result.stdout.strip() == "[]"


@pytest.mark.parametrize(
    ("args", "kept", "debug"),
    [
        (["plan", "x.json"], ["plan", "x.json"], False),
        (["--debug", "plan"], ["plan"], True),
        (["plan", "--debug", "x"], ["plan", "x"], True),
        (["hello", "--", "--debug"], ["hello", "--", "--debug"], False),  # an argument
    ],
)
def test_debug_is_taken_anywhere_before_a_double_dash(monkeypatch, args, kept, debug) -> None:
    monkeypatch.delenv("DATAFLOW_DEBUG", raising=False)
    assert split_debug(args) == (kept, debug)


@pytest.mark.parametrize(
    ("text", "line"),
    [
        ("one line", "one line"),
        (
            "x.json is not valid:\n  - $.a: missing\n  - $.b: extra",
            "x.json is not valid: $.a: missing; $.b: extra",
        ),
        ("wrapped\nprose", "wrapped prose"),
        ("", ""),
    ],
)
def test_one_line(text: str, line: str) -> None:
    assert one_line(text) == line


def test_describe_names_a_file_and_unquotes_a_key_error() -> None:
    assert describe(FileNotFoundError(2, "No such file or directory", "a.json")) == (
        "a.json: No such file or directory"
    )
    assert describe(KeyError("no object 'x' in the program")) == "no object 'x' in the program"
    assert describe(click.ClickException("plain")) == "plain"
