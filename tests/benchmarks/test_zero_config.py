"""benchmarks/zero_config.py's CPU-side pieces: the plain command's search line and
metrics read back from a real run (gpt2_tiny on the CPU), the fastest compare.py rows of
the committed results, the rows merged by cell and the table (the device runs the rest)."""

from __future__ import annotations

import json
import shlex
from pathlib import Path

import pytest

from benchmarks import zero_config
from dataflow.testing import invoke

pytest.importorskip("dataflow_family_gpt2")

ROOT = Path(__file__).resolve().parents[2]


def test_a_plain_run_gives_its_row_fields(tmp_path) -> None:
    command = zero_config.plain_command("gpt2_tiny", "2MiB", 4, tmp_path / "run", "cpu")
    args = shlex.split(command)
    assert args[:2] == ["dataflow", "train"] and "--batch" not in args
    result = invoke(*args[1:])
    assert result.exit_code == 0, result.output
    searched = zero_config.read_search(result.output)
    assert searched["chosen"].startswith("seq 128, batch ")
    assert searched["search_s"] > 0
    assert zero_config.median_tok_s(tmp_path / "run" / "metrics.jsonl", 1) > 0
    with pytest.raises(ValueError, match="no step after the first 4"):
        zero_config.median_tok_s(tmp_path / "run" / "metrics.jsonl", 4)
    with pytest.raises(ValueError, match="no search: line"):
        zero_config.read_search("plan: ...")


def test_the_fastest_rows_of_a_compare_run() -> None:
    doc = json.loads((ROOT / "benchmarks/results/compare.json").read_text())
    gib4 = 4 * 2**30
    best = zero_config.fastest(doc, "gpt2_124m", ("dataflow",), gib4)
    rows = [r for r in doc["rows"] if r["model"] == "gpt2_124m" and r["tok_s"]]
    assert best == max(
        r["tok_s"] for r in rows if r["engine"].startswith("dataflow") and r["budget_bytes"] == gib4
    )
    stock = zero_config.fastest(doc, "gpt2_124m", ("pytorch",), None)
    assert stock == max(r["tok_s"] for r in rows if r["engine"].startswith("pytorch"))
    assert zero_config.fastest(doc, "no_such_model", ("pytorch",), None) is None
    # a faster row of another mode (a LoRA step) is not the full step's
    lora = [dict(r, mode="lora", tok_s=10 * r["tok_s"]) for r in rows]
    doc["rows"] += lora
    assert zero_config.fastest(doc, "gpt2_124m", ("dataflow",), gib4) == best
    assert zero_config.fastest(doc, "gpt2_124m", ("pytorch",), None) == stock


def test_rows_merge_by_cell_and_tabulate(tmp_path) -> None:
    fields = (
        "model",
        "budget_bytes",
        "command",
        "tok_s",
        "best_row_tok_s",
        "stock_tok_s",
        "chosen",
        "search_s",
    )
    old = dict(zip(fields, ("gpt2_124m", 2**30, "old", 1.0, 2.0, 4.0, "x", 1.0), strict=True))
    path = tmp_path / "zero_config.json"
    path.write_text(json.dumps({"rows": [old]}))
    new = old | {"command": "new", "tok_s": 3.0, "stock_tok_s": None}
    rows = zero_config.merge(path, [new])
    assert rows == [new] and tuple(rows[0]) == fields
    text = zero_config.table(rows)
    assert "| gpt2_124m | 1 GiB | 3 | 2 | 1.500 | - | - | x | 1.0 |" in text
