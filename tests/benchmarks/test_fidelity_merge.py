"""benchmarks/fidelity_merge.py: ``dataflow measure --json`` files merged into the
committed fidelity results, an earlier merged file's rows, commands and note kept."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
RESULTS = ROOT / "benchmarks" / "results" / "fidelity.json"


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
    command = [sys.executable, "-m", "benchmarks.fidelity_merge", *map(str, files)]
    command += ["--out", str(out), *(["--note", note] if note else [])]
    printed = subprocess.run(command, check=True, capture_output=True, text=True, cwd=ROOT).stdout
    return json.loads(out.read_text()), printed


def test_the_committed_results_merge_into_themselves(tmp_path) -> None:
    merged, printed = _merge(tmp_path, RESULTS)
    assert merged == json.loads(RESULTS.read_text())
    # a preset column only when the rows have more than one preset
    assert ("| preset |" in printed) == (len({r["preset"] for r in merged["rows"]}) > 1)


def test_new_cells_join_the_committed_ones_after_them_with_both_notes(tmp_path) -> None:
    committed = json.loads(RESULTS.read_text())
    # a preset the committed rows lack: its cells go after theirs
    new = tmp_path / "fidelity_qwen3_0_6b_4096_16384.json"
    cells = [
        _cell("qwen3_0_6b", 4096, 16384, 4 * 2**30, 1.02),
        _cell("qwen3_0_6b", 4096, 16384, 8 * 2**30, None),
        _cell("qwen3_0_6b", 4096, 16384, 8 * 2**30 + 1, 0.98),
    ]
    command = "dataflow measure --preset qwen3_0_6b"
    new.write_text(json.dumps({"command": command, "rows": cells}))
    merged, printed = _merge(tmp_path, RESULTS, new, note="the qwen3 grid")
    rows = merged["rows"]
    assert rows[: len(committed["rows"])] == committed["rows"]
    added = rows[len(committed["rows"]) :]
    assert [r["budget_bytes"] for r in added] == [8 * 2**30 + 1, 8 * 2**30, 4 * 2**30]
    assert merged["meta"]["commands"] == [
        *committed["meta"]["commands"],
        command,
    ]
    assert merged["meta"]["note"] == f"{committed['meta']['note']}; the qwen3 grid"
    assert merged["meta"]["ratio_max"] == max(committed["meta"]["ratio_max"], 1.02)
    assert "| preset |" in printed and "| qwen3_0_6b | 4096 | 16384 | 4 GiB |" in printed
    assert "cannot be planned" in printed and "| 0 | - |" in printed
