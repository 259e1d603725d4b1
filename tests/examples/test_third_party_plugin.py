"""The example plugin package's own tests (keep-all, and the planner conformance base) pass."""

from __future__ import annotations

import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "third_party_plugin"


def _installed() -> bool:
    try:
        metadata.distribution("dataflow-planner-example")
    except metadata.PackageNotFoundError:
        return False
    return True


@pytest.mark.skipif(
    not _installed(),
    reason="dataflow-planner-example is not installed (pip install -e examples/third_party_plugin)",
)
def test_the_example_plugin_tests_pass() -> None:
    command = [sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider"]
    command += ["-p", "no:hypothesispytest", "-p", "no:benchmark"]
    result = subprocess.run(command, cwd=EXAMPLE, capture_output=True, text=True)
    assert result.returncode == 0, result.stdout + result.stderr
    assert " passed" in result.stdout and "skipped" not in result.stdout
