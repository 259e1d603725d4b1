"""benchmarks/fidelity_merge.py: ``dataflow measure --json`` files merged into the
committed fidelity results, an earlier merged file's rows, commands and note kept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

BENCHMARKS = Path(__file__).resolve().parents[2] / "benchmarks"
RESULTS = BENCHMARKS / "results" / "fidelity.json"


def _cell(preset: str, seq: int, t_round: int, budget: int, ratio: float | None) -> dict:
    measured = None if ratio is None else 1.0 * ratio
    return {
        "preset": preset,
        "t_round": t_round,
        "seq_len": seq,
        "budget_bytes": budget,
        "batch": t_round // seq,
        "rounds": 4,
        "feasible": ratio is not None,
        "predicted_step_s": None if ratio is None else 1.0,
        "measured_step_s": measured,
        "ratio": ratio,
        "recomputed_layers": [],
        "allocator_peak_bytes": None,  # a CPU run measures none
    }


def _merge(tmp_path: Path, *files: Path, note: str | None = None) -> tuple[dict, str]:
    out = tmp_path / "merged.json"
    command = [sys.executable, str(BENCHMARKS / "fidelity_merge.py"), *map(str, files)]
    command += ["--out", str(out), *(["--note", note] if note else [])]
    printed = subprocess.run(command, check=True, capture_output=True, text=True).stdout
    return json.loads(out.read_text()), printed


def test_the_committed_results_merge_into_themselves(tmp_path) -> None:
    merged, printed = _merge(tmp_path, RESULTS)
    assert merged == json.loads(RESULTS.read_text())
    assert "| preset |" not in printed  # one preset: no preset column


def test_new_cells_join_the_committed_ones_after_them_with_both_notes(tmp_path) -> None:
    committed = json.loads(RESULTS.read_text())
    new = tmp_path / "fidelity_l3_1b_4096_16384.json"
    cells = [
        _cell("l3_1b", 4096, 16384, 4 * 2**30, 1.02),
        _cell("l3_1b", 4096, 16384, 8 * 2**30, None),
        _cell("l3_1b", 4096, 16384, 8 * 2**30 + 1, 0.98),
    ]
    new.write_text(json.dumps({"command": "dataflow measure --preset l3_1b", "rows": cells}))
    merged, printed = _merge(tmp_path, RESULTS, new, note="the l3_1b grid")
    rows = merged["rows"]
    assert rows[: len(committed["rows"])] == committed["rows"]
    added = rows[len(committed["rows"]) :]
    assert [r["budget_bytes"] for r in added] == [8 * 2**30 + 1, 8 * 2**30, 4 * 2**30]
    assert merged["meta"]["commands"] == [
        *committed["meta"]["commands"],
        "dataflow measure --preset l3_1b",
    ]
    assert merged["meta"]["note"] == f"{committed['meta']['note']}; the l3_1b grid"
    assert merged["meta"]["ratio_max"] == max(committed["meta"]["ratio_max"], 1.02)
    assert "| preset |" in printed and "| l3_1b | 4096 | 16384 | 4 GiB |" in printed
    assert "cannot be planned" in printed and "| 0 | - |" in printed
