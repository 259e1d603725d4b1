"""The core's import rules (ARCHITECTURE.md section 2).

1. Importing the pure-Python core (``dataflow``, its schema, simulator, planner) never
   imports torch.
2. No module under core/ imports a plugin package (``dataflow_<kind>_<name>``).
3. torch is imported at module level only inside ``dataflow/engine/backends/torch*``.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

CORE = Path(__file__).resolve().parents[2] / "core" / "dataflow"
PURE_MODULES = ["dataflow", "dataflow.schema", "dataflow.sim", "dataflow.planning"]


def _core_files() -> list[Path]:
    files = sorted(CORE.rglob("*.py"))
    assert files, f"no Python files under {CORE}"
    return files


def _imported_modules(tree: ast.AST, *, module_level_only: bool) -> list[tuple[int, str]]:
    nodes = ast.iter_child_nodes(tree) if module_level_only else ast.walk(tree)
    found = []
    for node in nodes:
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
    return found


@pytest.mark.parametrize("module", PURE_MODULES)
def test_pure_modules_do_not_import_torch(module: str) -> None:
    code = (
        f"import sys, importlib; importlib.import_module({module!r}); "
        "leaked = sorted(m for m in sys.modules if m == 'torch' or m.startswith('torch.')); "
        "print(leaked[:3]); sys.exit(1 if leaked else 0)"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, (
        f"importing {module} imported torch: {result.stdout}{result.stderr}"
    )


def test_core_never_imports_a_plugin_package() -> None:
    offenders = [
        f"{path.relative_to(CORE.parent)}:{line}: {name}"
        for path in _core_files()
        for line, name in _imported_modules(ast.parse(path.read_text()), module_level_only=False)
        if name.split(".")[0].startswith("dataflow_")
    ]
    assert offenders == []


def test_torch_at_module_level_only_in_torch_backends() -> None:
    allowed = CORE / "engine" / "backends"
    offenders = []
    for path in _core_files():
        if path.is_relative_to(allowed) and path.name.startswith("torch"):
            continue
        for line, name in _imported_modules(ast.parse(path.read_text()), module_level_only=True):
            if name.split(".")[0] in ("torch", "triton"):
                offenders.append(f"{path.relative_to(CORE.parent)}:{line}: {name}")
    assert offenders == []


def test_the_rules_catch_an_offender(tmp_path: Path) -> None:
    """The scanners above are not vacuous: they see a plugin and a torch import."""
    tree = ast.parse("import torch\nfrom dataflow_family_gpt2 import model\n")
    names = [name for _, name in _imported_modules(tree, module_level_only=True)]
    assert names == ["torch", "dataflow_family_gpt2"]
    nested = ast.parse("def f():\n    import dataflow_kernels_torch\n")
    assert _imported_modules(nested, module_level_only=True) == []
    assert _imported_modules(nested, module_level_only=False) == [(2, "dataflow_kernels_torch")]
