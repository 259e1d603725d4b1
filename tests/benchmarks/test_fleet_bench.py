"""benchmarks/fleet.py (issue 18's fleet benchmark) on the CPU over gloo at a tiny size, so
its code paths cannot rot: a 1-rank and a weighted 3:1 fleet run, and the JSON document
and the table carry every field issue 18 names."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

pytest.importorskip("dataflow_family_gpt2")

ROOT = Path(__file__).resolve().parents[2]


def test_the_fleet_benchmark_runs_on_cpu(tmp_path):
    out = tmp_path / "fleet.json"
    cmd = [sys.executable, "-m", "benchmarks.fleet", "--preset", "gpt2_tiny"]
    cmd += ["--device", "cpu", "--budget", "64MiB", "--seq-len", "16", "--batch", "2"]
    cmd += ["--steps", "2", "--warmup", "1", "--configs", "1 rank,3:1", "--out", str(out)]
    done = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert done.returncode == 0, done.stdout + done.stderr
    rows = json.loads(out.read_text())["rows"]
    assert [(row["config"], row["rounds"]) for row in rows] == [("1 rank", [2]), ("3:1", [3, 1])]
    single, weighted = rows
    assert single["scaling_efficiency"] == 1.0
    # 4 rounds of 2 x 16 tokens a step, over the measured median step of rank 0
    assert weighted["tokens_per_step"] == 4 * 2 * 16
    assert weighted["tok_s"] == pytest.approx(128 / weighted["step_s"])
    assert weighted["scaling_efficiency"] == pytest.approx(
        weighted["tok_s"] / (2 * single["tok_s"])
    )
    for member in weighted["members"]:
        # the all-reduce ran (one per parameter group) and its exposed part is part of it
        assert member["allreduce_ms"] > 0 and 0 <= member["exposed_ms"] <= member["allreduce_ms"]
        assert 0 <= member["predicted_exposed_ms"] <= member["predicted_allreduce_ms"]
    assert [m["rounds"] for m in weighted["members"]] == [3, 1]
    assert "| 3:1 | 2 | 3,1 |" in out.with_suffix(".md").read_text()
