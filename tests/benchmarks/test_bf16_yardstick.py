"""benchmarks/probes/bf16_yardstick.py on qwen3_tiny: one line per matched parameter kind and
step, every error finite and small (bf16 against float64), and its JSON."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dataflow_family_qwen3")
ROOT = Path(__file__).resolve().parents[2]


def test_the_yardstick_runs_on_a_tiny_preset(tmp_path) -> None:
    out = tmp_path / "errors.json"
    command = [sys.executable, "-m", "benchmarks.probes.bf16_yardstick"]
    command += ["--family", "qwen3", "--preset", "qwen3_tiny"]
    command += ["--steps", "2", "--match", "q_norm,mlp", "--json", str(out)]
    printed = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    lines = printed.splitlines()
    assert [line.split(":")[0] for line in lines] == [
        "step 0 q_norm",
        "step 0 mlp",
        "step 1 q_norm",
        "step 1 mlp",
    ]
    errors = json.loads(out.read_text())["errors"]
    assert {e["step"] for e in errors} == {0, 1}
    # bf16 against float64: above float32's rounding, far below 1
    assert all(1e-6 < e["rel"] < 0.2 for e in errors), errors
