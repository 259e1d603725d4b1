"""Merge the JSON files of ``benchmarks/fidelity.sh`` (one ``dataflow measure --json`` per
sequence length and T_round; or an earlier merged file, whose rows and commands are kept:
``results/fidelity.json`` given first keeps gpt2_124m's grid beside a new l3_1b one) into
``benchmarks/results/fidelity.json``:
``{"meta": {...}, "rows": [...]}``, each row with issue 14's fields (``preset``,
``t_round``, ``seq_len``, ``budget_bytes``, ``predicted_step_s``, ``measured_step_s``,
``ratio``; the last three null in a cell that cannot be planned, whose ``reason`` says
why) and the rest of what ``measure`` wrote. Rows are sorted by preset (in the order
first given), sequence length, T_round and budget (largest first); the table for
docs/throughput.md is printed, with a preset column when there is more than one.

Run: ``python -m benchmarks.fidelity_merge [results/fidelity.json] OUT/fidelity_*.json [--out PATH]
[--note TEXT]``
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from dataflow.units import format_size

OUT = Path(__file__).parent / "results" / "fidelity.json"
FIELDS = ("preset", "t_round", "seq_len", "budget_bytes")
MEASURED = ("predicted_step_s", "measured_step_s", "ratio")


def merged(paths: list[Path]) -> tuple[list[dict], list[str], list[str]]:
    """Every file's rows (a merged file's as they are), the commands that made them and a
    merged file's notes."""
    rows, commands, notes = [], [], []
    for path in paths:
        document = json.loads(path.read_text())
        if "meta" in document:  # a merged file: its commands and note are in its meta
            commands.extend(document["meta"]["commands"])
            if document["meta"].get("note"):
                notes.append(document["meta"]["note"])
        else:
            commands.append(document["command"])
        for row in document["rows"]:
            missing = [field for field in FIELDS if field not in row]
            if missing:
                raise SystemExit(f"{path}: a row lacks {', '.join(missing)}")
            rows.append({field: row.get(field) for field in FIELDS + MEASURED} | row)
    presets = list(dict.fromkeys(r["preset"] for r in rows))
    rows.sort(
        key=lambda r: (presets.index(r["preset"]), r["seq_len"], r["t_round"], -r["budget_bytes"])
    )
    return rows, commands, notes


def _count(value: int | None) -> str:
    """A byte count with thousands separators; "-" where none was measured (a CPU run)."""
    return "-" if value is None else f"{value:,}"


def table(rows: list[dict]) -> str:
    several = len({r["preset"] for r in rows}) > 1
    lines = [
        ("| preset " if several else "")
        + "| seq | T_round | budget | batch x rounds | predicted s | measured s "
        "| measured/predicted | recomputed blocks | allocator peak |",
        ("| --- " if several else "") + "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        head = f"| {r['seq_len']} | {r['t_round']} | {format_size(r['budget_bytes'])} |"
        if several:
            head = f"| {r['preset']} {head}"
        if not r.get("feasible", True):
            lines.append(f"{head} | cannot be planned (below) | | | | |")
            continue
        lines.append(
            f"{head} {r['batch']} x {r['rounds']} | {r['predicted_step_s']:.4f} "
            f"| {r['measured_step_s']:.4f} | {r['ratio']:.3f} "
            f"| {len(r.get('recomputed_layers') or [])} | {_count(r['allocator_peak_bytes'])} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("files", nargs="+", type=Path)
    parser.add_argument("--out", type=Path, default=OUT)
    parser.add_argument("--note", default=None, help="when and where it ran")
    args = parser.parse_args()
    rows, commands, notes = merged(args.files)
    ratios = [r["ratio"] for r in rows if r.get("ratio") is not None]
    note = "; ".join([*notes, *([args.note] if args.note else [])]) or None
    meta = {"commands": commands, "note": note}
    if ratios:
        meta |= {"ratio_min": min(ratios), "ratio_max": max(ratios), "cells": len(rows)}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {args.out}: {len(rows)} rows, ratios {min(ratios):.3f} to {max(ratios):.3f}")


if __name__ == "__main__":
    main()
