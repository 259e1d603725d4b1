"""Every installed plugin's entry-point module stays light: importing it imports no torch.

dataflow imports each entry-point module on every CLI call; one that imports torch makes
every command about ten times slower to start.
"""

from __future__ import annotations

from importlib import metadata

import pytest

from dataflow.plugins import ENTRY_POINT_GROUP
from dataflow.testing import heavy_imports
from dataflow.testing.light_imports import entry_point_module

ENTRY_POINTS = sorted(
    {
        f"{ep.dist.name if ep.dist else '?'}: {ep.value}"
        for ep in metadata.entry_points(group=ENTRY_POINT_GROUP)
    }
)


@pytest.mark.parametrize("entry_point", ENTRY_POINTS)
def test_entry_point_module_imports_no_torch(entry_point: str) -> None:
    module = entry_point_module(entry_point.split(": ", 1)[1])
    assert heavy_imports(module) == [], f"{entry_point}: import torch inside the records' callables"


def test_the_check_finds_a_planted_offender(fake_distribution) -> None:
    fake_distribution(
        "dataflow-heavy",
        entry_points={"heavy": "dataflow_heavy_plugin"},
        modules={"dataflow_heavy_plugin": "import torch\n"},
    )
    assert heavy_imports("dataflow_heavy_plugin") == ["torch"]
    assert heavy_imports("dataflow_heavy_plugin", forbidden=("triton",)) == []


def test_a_module_that_cannot_be_imported_is_an_import_error() -> None:
    with pytest.raises(ImportError, match="importing dataflow_no_such_module failed"):
        heavy_imports("dataflow_no_such_module")


@pytest.mark.parametrize(
    ("entry_point", "module"),
    [("core = dataflow.builtins", "dataflow.builtins"), ("a.b:hooks", "a.b"), ("x = m:attr", "m")],
)
def test_entry_point_module(entry_point: str, module: str) -> None:
    assert entry_point_module(entry_point) == module


def test_the_test_kit_imports_without_pytest() -> None:
    """``dataflow.testing`` works in a core-only install; only the pytest classes need pytest."""
    import subprocess
    import sys

    code = (
        "import sys\n"
        "sys.modules['pytest'] = None  # as if it were not installed\n"
        "import dataflow.testing as kit\n"
        "from dataflow.testing.chains import training_chain\n"
        "assert kit.tiny_chain().tasks and training_chain(layers=2, rounds=1).tasks\n"
        "try:\n"
        "    kit.PlannerConformance\n"
        "except ImportError as exc:\n"
        "    print(exc)\n"
    )
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert result.returncode == 0, result.stderr
    assert "needs pytest: pip install 'dataflow[test]'" in result.stdout
