"""benchmarks/bf16_update.py and benchmarks/loss_plot.py on the CPU: the four curves of
gpt2_tiny for a few real steps (bf16-plain, bf16, mixed and int8 moments), each run
started with ``--resume auto`` in an empty folder (a fresh start), the plot of their
metrics with one curve each, the Markdown table, a second call that finds every run
complete and trains nothing, and ``--curves`` running one curve."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET

import pytest

pytest.importorskip("dataflow_family_gpt2")

from benchmarks import bf16_update, loss_plot

SVG = "{http://www.w3.org/2000/svg}"
TINY = ["--preset", "gpt2_tiny", "--device", "cpu", "--batch", "2", "--seq-len", "16"]
TINY += ["--ga-rounds", "1", "--warmup", "1", "--checkpoint-every", "2"]


def test_four_curves_run_resumably_and_plot(tmp_path, capfd) -> None:
    runs, results = tmp_path / "runs", tmp_path / "results"
    args = [*TINY, "--steps", "3", "--runs", str(runs), "--results", str(results)]
    bf16_update.main(args)
    assert list(bf16_update.CURVES) == ["bf16-plain", "bf16", "mixed", "int8"]
    for curve in bf16_update.CURVES:
        metrics = (results / f"{curve}.metrics.jsonl").read_text().splitlines()
        assert [json.loads(line)["step"] for line in metrics] == [1, 2, 3]
    summary = json.loads((results / "summary.json").read_text())
    assert set(summary) == set(bf16_update.CURVES)
    assert all(row["steps"] == 3 for row in summary.values())
    manifest = json.loads(next((runs / "int8").glob("step_*/manifest.json")).read_text())
    assert manifest["train"]["optimizer"]["name"] == "adamw_int8"
    table = (results / "summary.md").read_text().splitlines()
    assert table[0].startswith("| curve | AdamW state B/param | last loss |")
    rows = {line.split(" | ")[0][2:]: line.split(" | ") for line in table[2:]}
    assert list(rows) == list(bf16_update.CURVES)
    assert rows["int8"][1] == "2.031" and rows["bf16-plain"][5] == "+0.0000"
    assert float(rows["int8"][2]) == pytest.approx(summary["int8"]["last_loss"], abs=1e-4)

    svg = ET.parse(results / "loss.svg").getroot()
    curves = svg.findall(f"{SVG}polyline")
    assert [c.get("data-label") for c in curves] == list(bf16_update.CURVES)
    assert all(len(c.get("points").split()) == 3 for c in curves)
    legend = " ".join(t.text or "" for t in svg.iter(f"{SVG}text"))
    last = loss_plot.read_losses(results / "bf16.metrics.jsonl")[-1][1]
    assert f"bf16: {last:.4f} at step 3" in legend  # --smooth default: 1 step here

    capfd.readouterr()
    bf16_update.main(args)  # every run complete: nothing trains
    out = capfd.readouterr().out
    assert "$ dataflow train" not in out
    assert out.count("complete (3 steps)") == 4


def test_curves_runs_the_ones_named_and_refuses_an_unknown_one(tmp_path, capfd) -> None:
    runs, results = tmp_path / "runs", tmp_path / "results"
    args = [*TINY, "--steps", "2", "--runs", str(runs), "--results", str(results)]
    bf16_update.main([*args, "--curves", "int8"])
    assert [p.name for p in runs.iterdir()] == ["int8"]
    assert set(json.loads((results / "summary.json").read_text())) == {"int8"}
    with pytest.raises(SystemExit):
        bf16_update.main([*args, "--curves", "int4"])
    assert "--curves: int4: each one of bf16-plain, bf16, mixed, int8" in capfd.readouterr().err


def test_the_running_mean_and_the_ticks() -> None:
    points = [(1, 4.0), (2, 2.0), (3, 6.0), (4, 0.0)]
    assert loss_plot.smoothed(points, 2) == [(1, 4.0), (2, 3.0), (3, 4.0), (4, 3.0)]
    assert loss_plot.ticks(3.05, 3.92) == pytest.approx([3.2, 3.4, 3.6, 3.8])
    assert loss_plot.ticks(1, 2000) == [500, 1000, 1500, 2000]
