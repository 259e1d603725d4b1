"""The training plugin's import rules (docs/architecture.md, Training): no import circles,
and each stage imports only the stages before it, ``step`` < ``kit`` < ``plan`` <
``drive`` < ``check`` < ``cli`` (``testing`` and the entry point may import any). Found by
reading the source: ``python -m dataflow.testing.import_cycles
plugins/training/src/dataflow_training dataflow_training`` lists the circles."""

from __future__ import annotations

from pathlib import Path

import dataflow_training

from dataflow.testing import import_cycles

ROOT = Path(dataflow_training.__file__).parent
STAGES = ("step", "kit", "plan", "drive", "check", "cli")


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
