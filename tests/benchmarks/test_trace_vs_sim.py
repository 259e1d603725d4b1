"""benchmarks/trace_vs_sim.py: a profiled step set beside its simulated step, on a
hand-made pair whose answers are known."""

from __future__ import annotations

import gzip
import json
from pathlib import Path

from benchmarks import trace_vs_sim

ROOT = Path(__file__).resolve().parents[2]


def kernel(name: str, ts: float, dur: float) -> dict:
    return {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur, "args": {}}


def write_pair(stem: Path) -> None:
    """Two rounds of one forward task each; the device runs every task 10 us later than
    simulated per round, with a memset and a 4 us gap inside each task."""
    sim = {
        "makespan_us": 300.0,
        "tasks": [
            ["embed_0_0_emb", 0.0, 10.0],
            ["fwd_0_0_0", 10.0, 100.0],
            ["embed_0_1_emb", 100.0, 110.0],
            ["fwd_0_1_0", 110.0, 200.0],
            ["embed_0_2_emb", 200.0, 210.0],
            ["fwd_0_2_0", 210.0, 300.0],
        ],
        "transfers": [
            ["w", "h2d", 1000, 0.0, 0.0, 20.0],
            ["w", "h2d", 1000, 100.0, 100.0, 120.0],
            ["a", "d2h", 500, 200.0, 200.0, 210.0],
        ],
    }
    events = [
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy HtoD (Pinned -> Device)",
            "ts": 1000.0 + 110.0 * r,
            "dur": 21.0,
            "args": {"bytes": 1000},
        }
        for r in range(2)
    ]
    events.append(
        {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": "Memcpy DtoH (Device -> Pinned)",
            "ts": 1000.0 + 220.0,
            "dur": 10.0,
            "args": {"bytes": 500},
        }
    )
    for r in range(3):
        t = 1000.0 + 110.0 * r
        events.append(kernel("vectorized_gather_kernel", t, 10.0))
        events.append(kernel("triton_per_fused_native_layer_norm_0", t + 10.0, 40.0))
        events.append(
            {"ph": "X", "cat": "gpu_memset", "name": "Memset", "ts": t + 54.0, "dur": 2.0}
        )
        events.append(kernel("gemm", t + 60.0, 44.0))
    with gzip.open(f"{stem}.sim.json.gz", "wt") as f:
        json.dump(sim, f)
    with gzip.open(f"{stem}.trace.json.gz", "wt") as f:
        json.dump({"traceEvents": events}, f)


def test_links_drift_rounds_and_memset_gaps_are_read_from_the_pair(tmp_path) -> None:
    stem = tmp_path / "pair"
    write_pair(stem)
    out = tmp_path / "report.json"
    report = trace_vs_sim.main([str(stem), "--out", str(out)])
    assert json.loads(out.read_text()) == report
    h2d = report["links"]["h2d"]
    assert (h2d["sim_transfers"], h2d["trace_copies"]) == (2, 2)
    assert (h2d["sim_bytes"], h2d["trace_bytes"]) == (2000, 2000)
    assert (h2d["sim_busy_ms"], h2d["trace_busy_ms"]) == (0.04, 0.042)
    # the second h2d copy starts at 110 us traced, 100 us simulated; d2h 220 vs 200
    assert report["drift"]["h2d"]["drift_ms"][-1] == 0.01
    assert report["drift"]["d2h"]["drift_ms"] == [0.02] * 11
    # one whole round between the second and third gathers: 110 us traced, 100 simulated
    tasks = report["tasks"]
    assert (tasks["rounds_matched"], tasks["round_trace_us"], tasks["round_sim_us"]) == (
        1,
        110.0,
        100.0,
    )
    gaps = report["compute_gaps"]
    assert (gaps["kernels"], gaps["memsets"]) == (9, 3)
    # per round: 4 us before and 4 us after the memset; 6 us from the gemm to the next
    # round's gather (twice)
    assert gaps["gaps_next_to_memsets_ms"] == 0.024
    assert gaps["other_gaps_ms"] == 0.012


def test_copy_rates_are_split_by_what_ran_beside_each_copy() -> None:
    def copy(tag: str, ts: float, dur: float, size: int) -> dict:
        name = f"Memcpy {tag} (Pinned -> Device)"
        return {
            "ph": "X",
            "cat": "gpu_memcpy",
            "name": name,
            "ts": ts,
            "dur": dur,
            "args": {"bytes": size},
        }

    mb = 1 << 20
    events = [
        kernel("gemm", 0.0, 100.0),
        copy("HtoD", 10.0, 40.0, 2 * mb),  # under the gemm: compute busy
        copy("HtoD", 200.0, 20.0, 1 * mb),  # nothing beside it
        copy("HtoD", 300.0, 40.0, 2 * mb),  # beside a d2h: duplex
        copy("DtoH", 310.0, 40.0, 2 * mb),
        copy("HtoD", 400.0, 1.0, 4096),  # too small to count
    ]
    rates = trace_vs_sim.copy_rates(sorted(events, key=lambda e: e["ts"]))
    assert rates["h2d"] == {
        "duplex": {"copies": 1, "median_gb_s": round(2 * mb / 40 / 1e3, 1)},
        "compute_busy": {"copies": 1, "median_gb_s": round(2 * mb / 40 / 1e3, 1)},
        "compute_idle": {"copies": 1, "median_gb_s": round(mb / 20 / 1e3, 1)},
    }
    assert rates["d2h"] == {"duplex": {"copies": 1, "median_gb_s": round(2 * mb / 40 / 1e3, 1)}}
