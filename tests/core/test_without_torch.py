"""torch is an extra of ``dataflow-runtime``: without it the CLI still validates, plans and
simulates, and what needs the engine's torch backend says what to install.

Each CLI run is a fresh interpreter in which ``import torch`` fails (``sys.modules['torch']
= None``), as on a machine where only ``pip install dataflow-runtime`` ran. ``nox -s
isolated`` checks the same with the built wheel in an environment that has no torch.
"""

from __future__ import annotations

import os
import subprocess
import sys
from importlib import metadata
from pathlib import Path

import pytest

import dataflow
from dataflow.engine import Engine
from dataflow.extras import MissingExtraError, require_torch
from dataflow.plugins import LOAD_PLUGINS_ENV

ROOT = Path(__file__).resolve().parents[2]
PROGRAM = ROOT / "examples" / "programs" / "training_step.json"
INSTALL_HINT = "pip install 'dataflow-runtime[torch]'"
WITHOUT_TORCH = (
    "import sys\n"
    "sys.modules['torch'] = None\n"
    "from dataflow.cli.main import cli\n"
    "cli(sys.argv[1:], prog_name='dataflow')\n"
)


def _dataflow_without_torch(*args: str) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, LOAD_PLUGINS_ENV: dataflow.DISTRIBUTION}  # the core's builtins only
    return subprocess.run(
        [sys.executable, "-c", WITHOUT_TORCH, *args], capture_output=True, text=True, env=env
    )


def test_the_distribution_is_dataflow_runtime() -> None:
    assert dataflow.DISTRIBUTION == "dataflow-runtime"
    assert dataflow.__version__ == metadata.version("dataflow-runtime")


def test_plan_and_simulate_run_without_torch(tmp_path: Path) -> None:
    planned = tmp_path / "planned.json"
    plan = _dataflow_without_torch("plan", str(PROGRAM), "--budget", "300MiB", "-o", str(planned))
    assert plan.returncode == 0, plan.stderr
    assert planned.exists() and f"wrote {planned}" in plan.stdout
    simulated = _dataflow_without_torch("simulate", str(planned))
    assert simulated.returncode == 0, simulated.stderr
    assert "valid" in simulated.stdout and "invalid" not in simulated.stdout


def test_trace_without_torch_says_what_to_install() -> None:
    result = _dataflow_without_torch("trace", str(PROGRAM), "--resolver", "torch")
    assert result.returncode == 1
    assert "Traceback" not in result.stderr
    assert result.stderr.strip() == (
        f"error: dataflow trace needs torch, which is not installed; install it with: "
        f"{INSTALL_HINT}"
    )


def test_the_torch_engine_without_torch_says_what_to_install(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setitem(sys.modules, "torch", None)
    Engine("virtual")  # needs no torch
    with pytest.raises(MissingExtraError, match=r"the engine's torch backend needs torch") as info:
        Engine("torch")
    assert INSTALL_HINT in str(info.value)
    assert isinstance(info.value, ImportError)


def test_require_torch_passes_where_torch_is_installed() -> None:
    pytest.importorskip("torch")
    require_torch("anything")  # no error
