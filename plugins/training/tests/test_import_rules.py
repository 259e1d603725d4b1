"""The training plugin's import rules (docs/architecture.md, Training): no import circles,
and each stage imports only the stages before it, ``optim`` < ``step`` < ``kit`` < ``plan`` <
``drive`` < ``check`` < ``service`` < ``cli`` (``testing`` and the entry point may import any). Found by
reading the source: ``python -m dataflow.testing.import_cycles
plugins/training/src/dataflow_training dataflow_training`` lists the circles."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import dataflow_training

from dataflow.testing import import_cycles

ROOT = Path(dataflow_training.__file__).parent
STAGES = ("optim", "step", "kit", "plan", "drive", "check", "service", "cli")


def _stage(module: str) -> str | None:
    parts = module.split(".")
    return parts[1] if len(parts) > 1 and parts[1] in STAGES else None


def upward(imports: list[import_cycles.Import]) -> list[str]:
    """Each import of a later stage by an earlier one, as ``path:line: a -> b``."""
    found = []
    for item in imports:
        source, target = _stage(item.importer), _stage(item.imported)
        if source and target and STAGES.index(target) > STAGES.index(source):
            found.append(f"{item.path.name}:{item.line}: {item.importer} -> {item.imported}")
    return found


def test_the_training_plugin_has_no_import_circles() -> None:
    assert import_cycles.import_cycles(ROOT, "dataflow_training") == []


def test_each_stage_imports_only_the_stages_before_it() -> None:
    imports = import_cycles.imports_in(ROOT, "dataflow_training")
    assert len(imports) > 100, "the scan found almost nothing: is the layout different?"
    assert upward(imports) == []


def test_the_stage_rule_sees_an_upward_import() -> None:
    planted = import_cycles.Import(
        "dataflow_training.step.lowering", "dataflow_training.drive.run", ROOT, 7
    )
    allowed = import_cycles.Import(
        "dataflow_training.drive.run", "dataflow_training.step.lowering", ROOT, 8
    )
    assert upward([planted, allowed]) == [
        f"{ROOT.name}:7: dataflow_training.step.lowering -> dataflow_training.drive.run"
    ]


def test_listing_the_commands_imports_no_torch() -> None:
    """``dataflow --help`` (every command of every installed plugin listed) loads no torch:
    the command modules import what needs torch inside the command."""
    code = (
        "import sys\n"
        "sys.argv = ['dataflow', '--help']\n"
        "from dataflow.cli.main import main\n"
        "try:\n    main()\nexcept SystemExit:\n    pass\n"
        "sys.exit(3 if 'torch' in sys.modules else 0)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert "train" in result.stdout, result.stderr
    assert result.returncode == 0, "dataflow --help imported torch"


def local_imports_without_reason(root: Path) -> list[str]:
    """Each import inside a function that has no comment above it or beside it, nor an
    import just above it (one comment serves a run of imports), as ``path:line``."""
    found = []
    for path in sorted(root.rglob("*.py")):
        lines = path.read_text().splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if not isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                continue
            for inner in ast.walk(node):
                if not isinstance(inner, ast.Import | ast.ImportFrom):
                    continue
                above = lines[inner.lineno - 2].strip()
                if "#" in lines[inner.lineno - 1] or above.startswith(("#", "import ", "from ")):
                    continue
                found.append(f"{path.relative_to(root)}:{inner.lineno}")
    return sorted(set(found))


def test_each_function_local_import_says_why() -> None:
    """An import inside a function only where it must be (torch or an optional package
    kept out of a module that loads without it), with the reason beside it."""
    assert local_imports_without_reason(ROOT) == []


def test_the_reason_rule_sees_a_bare_local_import(tmp_path: Path) -> None:
    (tmp_path / "m.py").write_text(
        "def f():\n    import json\n\n\ndef g():\n    # why\n    import json\n"
    )
    assert local_imports_without_reason(tmp_path) == ["m.py:2"]
