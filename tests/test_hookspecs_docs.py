"""Meta-tests that keep the hooks honest (in the manner of datasette's tests/test_docs.py).

Adding a hook to dataflow/hookspecs.py without a section in docs/plugin_hooks.md (with the
exact signature) or without a ``test_hook_<name>`` test somewhere under tests/ fails here.
"""

from __future__ import annotations

import ast
import inspect
import re
from collections.abc import Callable, Iterable
from pathlib import Path

import pytest

from dataflow import hookspecs
from dataflow.plugins import hook_names

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "plugin_hooks.md"
TESTS = ROOT / "tests"
FIRSTRESULT = "The first non-None result wins."
COLLECTED = "Every plugin's result is collected (not firstresult)."


def _specs() -> dict[str, Callable]:
    specs = {
        name: function
        for name, function in vars(hookspecs).items()
        if inspect.isfunction(function) and hasattr(function, "dataflow_spec")
    }
    assert specs, "no hook specs found: the meta-tests would pass vacuously"
    return specs


def rendered_signature(function: Callable) -> str:
    """``def name(arg: type, ...) -> type`` as the source writes it (annotations unevaluated)."""
    signature = inspect.signature(function)
    params = []
    star_written = False
    for param in signature.parameters.values():
        if param.kind is param.KEYWORD_ONLY and not star_written:
            params.append("*")
        star_written |= param.kind in (param.KEYWORD_ONLY, param.VAR_POSITIONAL)
        prefix = {param.VAR_POSITIONAL: "*", param.VAR_KEYWORD: "**"}.get(param.kind, "")
        text = prefix + param.name
        if param.annotation is not inspect.Parameter.empty:
            text += f": {param.annotation}"
        if param.default is not inspect.Parameter.empty:
            text += f" = {param.default!r}"
        params.append(text)
    returns = signature.return_annotation
    suffix = "" if returns is inspect.Signature.empty else f" -> {returns}"
    return f"def {function.__name__}({', '.join(params)}){suffix}"


def doc_sections(text: str) -> dict[str, str]:
    """``### name`` heading -> the section's text, up to the next heading."""
    parts = re.split(r"^(#{1,3}) (.+)$", text, flags=re.MULTILINE)
    return {
        parts[i + 1].strip(): parts[i + 2] for i in range(1, len(parts), 3) if parts[i] == "###"
    }


def first_code_line(section: str) -> str | None:
    match = re.search(r"```python\n(.+?)\n", section)
    return match.group(1) if match else None


def defined_functions(paths: Iterable[Path]) -> set[str]:
    names: set[str] = set()
    for path in paths:
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                names.add(node.name)
    return names


def test_every_hook_is_a_prefixed_spec() -> None:
    functions = [name for name, f in vars(hookspecs).items() if inspect.isfunction(f)]
    assert sorted(functions) == sorted(_specs()) == hook_names()
    assert all(name.startswith("dataflow_") for name in functions)


@pytest.mark.parametrize("name", hook_names())
def test_hook_docstring_says_when_what_and_how_results_combine(name: str) -> None:
    spec = _specs()[name]
    doc = " ".join((inspect.getdoc(spec) or "").split())
    assert "Called " in doc and "Returns " in doc, (
        f"{name}: say when it is called and what it returns"
    )
    expected = FIRSTRESULT if spec.dataflow_spec["firstresult"] else COLLECTED
    assert doc.endswith(expected), f"{name}: end the docstring with {expected!r}"


@pytest.mark.parametrize("name", hook_names())
def test_hook_has_a_doc_section_with_its_exact_signature(name: str) -> None:
    sections = doc_sections(DOC.read_text())
    assert name in sections, f"docs/plugin_hooks.md has no '### {name}' section"
    expected = f"{rendered_signature(_specs()[name])}: ..."
    assert first_code_line(sections[name]) == expected


def test_the_docs_document_no_hook_that_does_not_exist() -> None:
    documented = {title for title in doc_sections(DOC.read_text()) if title.startswith("dataflow_")}
    assert documented == set(hook_names())


@pytest.mark.parametrize("name", hook_names())
def test_hook_has_a_test_of_its_own(name: str) -> None:
    assert f"test_hook_{name}" in defined_functions(sorted(TESTS.rglob("test_*.py"))), (
        f"write a test named test_hook_{name} that exercises the hook through a plugin manager"
    )


def test_the_checks_are_not_vacuous(tmp_path: Path) -> None:
    def dataflow_example(program: int, *, budget: str = "x", **options: int) -> list[str]: ...

    def dataflow_other(*args, flag: bool) -> None: ...

    assert rendered_signature(dataflow_example) == (
        "def dataflow_example(program: int, *, budget: str = 'x', **options: int) -> list[str]"
    )
    assert rendered_signature(dataflow_other) == "def dataflow_other(*args, flag: bool) -> None"
    page = "## Phase\n\n### dataflow_a\n\n```python\ndef dataflow_a() -> int: ...\n```\n## End\n"
    assert first_code_line(doc_sections(page)["dataflow_a"]) == "def dataflow_a() -> int: ..."
    module = tmp_path / "test_x.py"
    module.write_text("def test_hook_dataflow_a():\n    pass\n")
    assert "test_hook_dataflow_a" in defined_functions([module])
    assert "test_hook_dataflow_b" not in defined_functions([module])
