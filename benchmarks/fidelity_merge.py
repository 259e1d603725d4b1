"""Merge the JSON files of ``benchmarks/fidelity.sh`` (one ``dataflow measure --json`` per
sequence length and T_round) into ``benchmarks/results/fidelity.json``:
``{"meta": {...}, "rows": [...]}``, each row with issue 14's fields (``preset``,
``t_round``, ``seq_len``, ``budget_bytes``, ``predicted_step_s``, ``measured_step_s``,
``ratio``; the last three null in a cell that cannot be planned, whose ``reason`` says
why) and the rest of what ``measure`` wrote. Rows are sorted by sequence length, T_round
and budget (largest first); the table for docs/throughput.md is printed.

Run: ``python benchmarks/fidelity_merge.py OUT/fidelity_*.json [--out PATH] [--note TEXT]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dataflow.units import format_size

OUT = Path(__file__).parent / "results" / "fidelity.json"
FIELDS = ("preset", "t_round", "seq_len", "budget_bytes")
MEASURED = ("predicted_step_s", "measured_step_s", "ratio")


def merged(paths: list[Path]) -> tuple[list[dict], list[str]]:
    rows, commands = [], []
    for path in paths:
        document = json.loads(path.read_text())
        commands.append(document["command"])
        for row in document["rows"]:
            missing = [field for field in FIELDS if field not in row]
            if missing:
                raise SystemExit(f"{path}: a row lacks {', '.join(missing)}")
            rows.append({field: row.get(field) for field in FIELDS + MEASURED} | row)
    rows.sort(key=lambda r: (r["seq_len"], r["t_round"], -r["budget_bytes"]))
    return rows, commands


def table(rows: list[dict]) -> str:
    lines = [
        "| seq | T_round | budget | batch x rounds | predicted s | measured s "
        "| measured/predicted | recomputed blocks | allocator peak |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        head = f"| {r['seq_len']} | {r['t_round']} | {format_size(r['budget_bytes'])} |"
        if not r.get("feasible", True):
            lines.append(f"{head} | cannot be planned (below) | | | | |")
            continue
        lines.append(
            f"{head} {r['batch']} x {r['rounds']} | {r['predicted_step_s']:.4f} "
            f"| {r['measured_step_s']:.4f} | {r['ratio']:.3f} "
            f"| {len(r.get('recomputed_layers') or [])} | {r['allocator_peak_bytes']:,} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--note", default=None, help="when and where it ran")
    args = parser.parse_args()
    rows, commands = merged(args.files)
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    meta = {"commands": commands, "note": args.note}
    if ratios:
        meta |= {"ratio_min": min(ratios), "ratio_max": max(ratios), "cells": len(rows)}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {args.out}: {len(rows)} rows, ratios {min(ratios):.3f} to {max(ratios):.3f}")


if __name__ == "__main__":
    main()
