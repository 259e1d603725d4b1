"""The throughput rows of docs/throughput.md planned and placed on the CPU from the H200
profile archives (``place_llama3_8b.py``'s ``place_row`` for each), beside the fastest
stock row of ``results/compare.json``: what the recompute planner and PressureFit make of
each row today, to see what a planner change does to every row before the device runs
them. The step times are simulations with measured task costs; the device rows have run
1-4 % slower than their own predictions (compare.json's measured/predicted).

Each row is a ``place_llama3_8b.py`` command line (``ROWS``: the shapes ``compare.py``
runs for each row now, by ``model_rows.sh``). ``vs stock`` is the fastest stock row's
seconds for the row's tokens over the planned (placed, where it places) step.

Run: ``python -m benchmarks.plan_rows [--only TEXT ...] [--out PATH]`` (about 4 minutes
on 2 cores; ``--only`` keeps the rows whose name contains any TEXT). Writes
``results/plan_rows.json`` and prints a Markdown table.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import time
from pathlib import Path

from benchmarks import place_llama3_8b
from benchmarks.harness import compare_doc

RESULTS = Path(__file__).parent / "results"
GPT2 = [
    "--preset",
    "gpt2_124m",
    "--seq-len",
    "1024",
    "--profiles",
    str(RESULTS / "profiles_gpt2.tgz"),
    # the archive was profiled before the vocabulary was stored padded (issue 44): the
    # head's and embedding's tasks at 50,257 rows; re-profile on the device to drop this
    "--vocab-multiple",
    "1",
]
L3_1B = [
    "--preset",
    "l3_1b",
    "--seq-len",
    "4096",
    "--profiles",
    str(RESULTS / "profiles_l3_1b.tgz"),
]
OLMOE = ["--preset", "olmoe_1b_7b", "--seq-len", "4096"]
OLMOE += ["--profiles", str(RESULTS / "profiles_olmoe16.tgz")]
# the llama3_8b archive predates the embedding's row gradient (session 17): its backward's
# workspace is priced as the row gradient's (ROWS_TEMPORARIES float32 (tokens, dim))
LLAMA3_8B = ["--preset", "llama3_8b", "--workspace", "llama3.embed.backward=403MB"]

#: name -> place_llama3_8b.py arguments
ROWS: dict[str, list[str]] = {
    "gpt2_124m 16 GiB, 64 x 8": [*GPT2, "--budget", "16GiB", "--batch", "64", "--rounds", "8"],
    "gpt2_124m 8 GiB, 32 x 16": [*GPT2, "--budget", "8GiB", "--batch", "32", "--rounds", "16"],
    "gpt2_124m 4 GiB, 16 x 32": [*GPT2, "--budget", "4GiB", "--batch", "16", "--rounds", "32"],
    "gpt2_124m 2 GiB, 32 x 16, early": [
        *GPT2, "--budget", "2GiB", "--batch", "32", "--rounds", "16", "--updates", "early"
    ],
    "gpt2_124m 1 GiB, 16 x 32, early": [
        *GPT2, "--budget", "1GiB", "--batch", "16", "--rounds", "32", "--updates", "early"
    ],
    "l3_1b 4 GiB by layer, 4 x 8": [
        *L3_1B, "--budget", "4GiB", "--batch", "4", "--rounds", "8", "--order", "layer"
    ],
    "l3_1b 4 GiB, 4 x 8": [*L3_1B, "--budget", "4GiB", "--batch", "4", "--rounds", "8"],
    "olmoe_1b_7b 16 GiB by layer, 4 x 16": [
        *OLMOE, "--budget", "16GiB", "--batch", "4", "--rounds", "16", "--order", "layer"
    ],
    "olmoe_1b_7b 8 GiB by layer, 2 x 32": [
        *OLMOE, "--budget", "8GiB", "--batch", "2", "--rounds", "32", "--order", "layer",
        "--workspace", "olmoe.moe.backward=2250MB",
    ],
    "llama3_8b 16 GiB by layer:2, 2 x 16, early, 95 GiB backing": [
        *LLAMA3_8B, "--budget", "16GiB", "--order", "layer:2", "--updates", "early",
        "--backing", "95GiB",
    ],
    "llama3_8b 8 GiB by layer:4, 2 x 16, 90 GiB backing": [
        *LLAMA3_8B, "--budget", "8GiB", "--order", "layer:4", "--backing", "90GiB",
    ],
}  # fmt: skip


def stock_tok_s(compare: Path) -> dict[str, float]:
    """Each model's fastest stock row (tokens/s) in compare.json, as its tables rate rows."""
    return compare_doc.fastest_stock(compare_doc.load_doc(compare)["rows"])


def planned(name: str, argv: list[str], stock: dict[str, float]) -> dict:
    """One row: its arguments, what ``place_row`` made of them and the stock ratio."""
    args = place_llama3_8b.parser().parse_args(argv)
    started = time.perf_counter()
    row = place_llama3_8b.place_row(args, say=lambda line: None)
    tokens = args.batch * args.rounds * args.seq_len
    step = row["placed_s"] or row["planned_s"]
    model_tok_s = stock.get(args.preset)
    ratio = None
    if step and model_tok_s:
        ratio = tokens / model_tok_s / step
    return {
        "name": name,
        "args": argv,
        "tokens": tokens,
        **row,
        "stock_tok_s": model_tok_s,
        "vs_stock": ratio,
        "wall_s": time.perf_counter() - started,
    }


def _seconds(row: dict, key: str) -> str:
    return "" if row.get(key) is None else f"{row[key]:.3f}"


def table(rows: list[dict]) -> str:
    lines = [
        "| row | planned s | placed s | vs stock | re-derived (whole + partial) | re-derive s "
        "| h2d + d2h GB | slow pool GiB | note |",
        "| --- | --- | --- | --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        units = ""
        if r.get("rederived_whole") is not None:
            units = f"{r['rederived_whole']} + {r['rederived_partial']}"
        moved = "" if r.get("h2d_gb") is None else f"{r['h2d_gb'] + r['d2h_gb']:.0f}"
        pool = "" if r.get("slow_pool_bytes") is None else f"{r['slow_pool_bytes'] / 2**30:.1f}"
        ratio = "" if r["vs_stock"] is None else f"{r['vs_stock']:.2f}x"
        note = (r["error"] or "")[:120]
        if r.get("stand_ins"):
            note = f"{r['stand_ins']} signatures priced from others. {note}".strip()
        lines.append(
            f"| {r['name']} | {_seconds(r, 'planned_s')} | {_seconds(r, 'placed_s')} | {ratio} "
            f"| {units} | {_seconds(r, 'rederive_s')} | {moved} | {pool} | {note} |"
        )
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", nargs="*", default=None, help="rows whose name has TEXT")
    parser.add_argument("--out", type=Path, default=RESULTS / "plan_rows.json")
    parser.add_argument("--compare", type=Path, default=RESULTS / "compare.json")
    args = parser.parse_args()
    chosen = {
        name: argv
        for name, argv in ROWS.items()
        if not args.only or any(text in name for text in args.only)
    }
    if not chosen:
        parser.error(f"--only {' '.join(args.only)}: no row's name has it; rows: {list(ROWS)}")
    stock = stock_tok_s(args.compare)
    rows = []
    for name, argv in chosen.items():
        rows.append(planned(name, argv, stock))
        print(f"{name}: {rows[-1]['placed_s'] or rows[-1]['planned_s']}", flush=True)
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=False
    ).stdout.strip()
    meta = {"commit": commit, "python": platform.python_version(), "command": "plan_rows.py"}
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=1) + "\n")
    print(table(rows))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
