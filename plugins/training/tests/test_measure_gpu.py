"""On CUDA: the profile cache behind TrainingRun (a second run measures nothing), and
``dataflow measure`` of a small grid with the recompute planner priced by measurements."""

from __future__ import annotations

import json

import pytest

from dataflow.testing import invoke

pytest.importorskip("dataflow_family_gpt2")


@pytest.mark.gpu
def test_a_second_cuda_run_takes_every_profile_from_disk(tmp_path, monkeypatch) -> None:
    from dataflow_training.drive.run import TrainingRun
    from dataflow_training.plan import profile
    from dataflow_training.step.config import DtypePolicy, TrainConfig

    monkeypatch.setenv(profile.CACHE_ENV, str(tmp_path))
    train = TrainConfig(seq_len=64, batch=4, rounds=2, dtype=DtypePolicy.named("bf16"))
    TrainingRun.of("gpt2", "gpt2_tiny", train, device="cuda", budget_bytes=2**30).close()
    written = {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.json")}
    assert written
    measured = []
    real = profile._measure
    monkeypatch.setattr(profile, "_measure", lambda *a: measured.append(a) or real(*a))
    TrainingRun.of("gpt2", "gpt2_tiny", train, device="cuda", budget_bytes=2**30).close()
    assert measured == []
    assert {p.name: p.stat().st_mtime_ns for p in tmp_path.glob("*.json")} == written


@pytest.mark.gpu
def test_measure_on_cuda_puts_each_cell_beside_its_prediction(tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("DATAFLOW_PROFILE_CACHE", str(tmp_path / "cache"))
    out = tmp_path / "fidelity.json"
    result = invoke(
        "measure", "--preset", "gpt2_tiny", "--t-round", "256", "--seq-len", "64",
        "--tokens-step", "512", "--budget", "1,0.002", "--steps", "4", "--warmup", "2",
        "--device", "cuda", "--json", out,
    )  # fmt: skip
    assert result.exit_code == 0, result.output
    rows = json.loads(out.read_text())["rows"]
    assert [r["costs"] for r in rows if r["feasible"]] == ["measured"] * sum(
        r["feasible"] for r in rows
    )
    for row in rows:
        if row["feasible"]:
            assert row["allocator_peak_bytes"] <= row["budget_bytes"]
            assert row["ratio"] == pytest.approx(row["measured_step_s"] / row["predicted_step_s"])
        else:
            assert row["reason"]
