"""``examples/demo.py`` with the core alone (no plugin packages, no pytest): part 1 runs,
part 2 says it is skipped and why, and the budgets it reports all plan and place."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

DEMO = Path(__file__).parents[2] / "examples" / "demo.py"


def test_the_demo_runs_on_the_core_alone() -> None:
    code = (
        "import runpy, sys\n"
        "for name in ('pytest', 'dataflow_training', 'dataflow_family_gpt2'):\n"
        "    sys.modules[name] = None  # as in a core-only install\n"
        f"sys.argv = [{str(DEMO)!r}]\n"
        f"runpy.run_path({str(DEMO)!r}, run_name='__main__')\n"
    )
    env = {**os.environ, "DATAFLOW_LOAD_PLUGINS": "dataflow", "COLUMNS": "200"}
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=300
    )
    assert result.returncode == 0, result.stdout + result.stderr
    out = result.stdout
    assert "smallest budget that plans and places" in out
    assert (
        "does not pack"
        not in out.split("smallest budget that plans and places")[1].split("\n", 1)[1]
    )  # no row of the table fails to pack
    assert "gpt2_tiny training skipped" in out and "nox -s demo" in out
