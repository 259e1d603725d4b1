"""benchmarks/bf16_update.py and benchmarks/loss_plot.py on the CPU: the three curves of
gpt2_tiny for a few real steps, each run started with ``--resume auto`` in an empty
folder (a fresh start), the plot of their metrics with one curve per policy, and a
second call that finds every run complete and trains nothing."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("dataflow_family_gpt2")

from benchmarks import bf16_update, loss_plot

SVG = "{http://www.w3.org/2000/svg}"
TINY = ["--preset", "gpt2_tiny", "--device", "cpu", "--batch", "2", "--seq-len", "16"]
TINY += ["--ga-rounds", "1", "--warmup", "1", "--checkpoint-every", "2"]


def test_three_curves_run_resumably_and_plot(tmp_path, capfd) -> None:
    runs, results = tmp_path / "runs", tmp_path / "results"
    args = [*TINY, "--steps", "3", "--runs", str(runs), "--results", str(results)]
    bf16_update.main(args)
    for policy in bf16_update.POLICIES:
        metrics = (results / f"{policy}.metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3]
    summary = json.loads((results / "summary.json").read_text())
    assert set(summary) == set(bf16_update.POLICIES)
    assert all(row["steps"] == 3 for row in summary.values())

    svg = ET.parse(results / "loss.svg").getroot()
    curves = svg.findall(f"{SVG}polyline")
    assert [c.get("data-label") for c in curves] == list(bf16_update.POLICIES)
    assert all(len(c.get("points").split()) == 3 for c in curves)
    legend = " ".join(t.text or "" for t in svg.iter(f"{SVG}text"))
    last = loss_plot.read_losses(results / "bf16.metrics.jsonl")[-1][1]
    assert f"bf16: {last:.4f} at step 3" in legend  # --smooth default: 1 step here

    capfd.readouterr()
    bf16_update.main(args)  # every run complete: nothing trains
    out = capfd.readouterr().out
    assert "$ dataflow train" not in out
    assert out.count("complete (3 steps)") == 3


def test_the_running_mean_and_the_ticks() -> None:
    points = [(1, 4.0), (2, 2.0), (3, 6.0), (4, 0.0)]
    assert loss_plot.smoothed(points, 2) == [(1, 4.0), (2, 3.0), (3, 4.0), (4, 3.0)]
    assert loss_plot.ticks(3.05, 3.92) == pytest.approx([3.2, 3.4, 3.6, 3.8])
    assert loss_plot.ticks(1, 2000) == [500, 1000, 1500, 2000]
