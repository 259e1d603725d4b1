"""Issue 44's cells: the plain command (``dataflow train --preset P --budget B``, every
shape option left to the step search) against compare.py's fastest dataflow row and its
fastest stock row, measured in the same run on the device.

    python -m benchmarks.zero_config --cells gpt2           # gpt2_124m at 16, 4, 1 GiB
    python -m benchmarks.zero_config --cells llama3_8b      # llama3_8b at 16, 8 GiB (H200)
    SMOKE=1 python -m benchmarks.zero_config --cells gpt2   # the same on the CPU, tiny preset

Each cell runs the plain command as typed (``command``) for ``--steps`` steps and takes
its median tokens/s after the first ``--warmup`` steps (``tok_s``) and the search's
choice and time from its ``search:`` line (``chosen``, ``search_s``); then compare.py
(its stock and dataflow rows at the cell's budget, the arguments model_rows.sh gives
it) into a scratch JSON, whose fastest dataflow row is ``best_row_tok_s`` and fastest
stock row ``stock_tok_s``. Rows go to ``results/zero_config.json`` (one per cell,
replacing the cell's earlier row) and a Markdown table beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

RESULTS = Path(__file__).parent / "results"
OUT_JSON = RESULTS / "zero_config.json"

#: compare.py's arguments for each model, as model_rows.sh gives them on the device
COMPARE_ARGS = {
    "gpt2_124m": "--family gpt2 --preset gpt2_124m --seq-len 1024 --min-tokens 524288",
    "llama3_8b": "--family llama3 --preset llama3_8b --seq-len 4096 --min-tokens 131072 "
    "--dataflow-batches 4,2,1 --dataflow-orders round,layer,layer:8",
    "gpt2_tiny": "--family gpt2 --preset gpt2_tiny --seq-len 32 --min-tokens 512",
}
COMMON = "--stock-dtypes bf16 --dataflow-dtypes bf16 --no-checkpoint-row"

#: the cells of issue 44 (model, budget); SMOKE runs one tiny cell on the CPU
CELLS = {
    "gpt2": [("gpt2_124m", "16GiB"), ("gpt2_124m", "4GiB"), ("gpt2_124m", "1GiB")],
    "llama3_8b": [("llama3_8b", "16GiB"), ("llama3_8b", "8GiB")],
    "smoke": [("gpt2_tiny", "2MiB")],
}

SEARCH_LINE = re.compile(
    r"^search: seq (?P<seq>\d+) \([^)]*\); (?P<chosen>.+?): predicted [\d,]+ tok/s;.*"
    r"planned in (?P<search_s>[\d.]+) s(?P<cached>; from the search cache)?$"
)


def plain_command(model: str, budget: str, steps: int, out: Path, device: str | None) -> str:
    """The plain command of a cell, as typed: preset, budget, steps and a run folder
    (and ``--device cpu`` in a smoke run)."""
    command = f"dataflow train --preset {model} --budget {budget} --steps {steps} --out {out}"
    return command + (f" --device {device}" if device else "")


def read_search(output: str) -> dict[str, Any]:
    """The ``search:`` line of a run's output as ``chosen`` (seq and shape) and
    ``search_s``; a run without one is an error naming what it printed."""
    for line in output.splitlines():
        found = SEARCH_LINE.match(line.strip())
        if found:
            chosen = f"seq {found['seq']}, {found['chosen']}"
            return {"chosen": chosen, "search_s": float(found["search_s"])}
    raise ValueError(f"no search: line in the run's output: {output[-500:]!r}")


def median_tok_s(metrics: Path, warmup: int) -> float:
    """The median tokens/s of a run's metrics.jsonl after its first ``warmup`` steps."""
    rows = [json.loads(line) for line in metrics.read_text().splitlines() if line.strip()]
    measured = [row["tok_s"] for row in rows[warmup:] if row.get("tok_s")]
    if not measured:
        raise ValueError(f"{metrics}: no step after the first {warmup} measured")
    return statistics.median(measured)


def fastest(
    doc: dict[str, Any], model: str, engines: tuple[str, ...], budget: int | None
) -> float | None:
    """The fastest tokens/s among compare.json's full-training rows of ``model`` by
    ``engines`` (a dataflow row at ``budget``; a stock row at any): a LoRA or RL row
    trains another step."""
    rows = [
        row
        for row in doc["rows"]
        if row["model"] == model
        and row.get("mode", "full") == "full"
        and row["tok_s"]
        and any(row["engine"].startswith(engine) for engine in engines)
        and (budget is None or row.get("budget_bytes") == budget)
    ]
    return max((row["tok_s"] for row in rows), default=None)


def run_cell(
    model: str, budget: str, args: argparse.Namespace, scratch: Path, stock: dict[str, float]
) -> dict[str, Any]:
    """One cell's row (module docstring). The stock rows do not depend on the budget: they
    run with the first cell of each model and ``stock`` keeps their fastest for the rest."""
    from dataflow.units import parse_size

    out = scratch / f"{model}_{budget}"
    command = plain_command(model, budget, args.steps, out, args.device)
    # the search timed, not read back from the search cache
    searching = {**os.environ, "DATAFLOW_NO_SEARCH_CACHE": "1"}
    done = subprocess.run(
        shlex.split(command), capture_output=True, text=True, check=False, env=searching
    )
    if done.returncode:
        raise SystemExit(f"{command} failed ({done.returncode}): {done.stderr[-800:]}")
    row: dict[str, Any] = {"model": model, "budget_bytes": parse_size(budget), "command": command}
    row["tok_s"] = median_tok_s(out / "metrics.jsonl", args.warmup)
    searched = read_search(done.stdout)
    compared = scratch / f"compare_{model}_{budget}.json"
    compare = [sys.executable, "-m", "benchmarks.compare", *shlex.split(COMPARE_ARGS[model])]
    rows = "dataflow" if model in stock else "stock,dataflow"
    compare += [*shlex.split(COMMON), "--rows", rows, "--budgets", budget]
    compare += ["--out", str(compared)]
    page = scratch / "throughput.md"  # compare.py rewrites its tables: a scratch copy
    if not page.exists():
        page.write_text((Path(__file__).parents[1] / "docs" / "throughput.md").read_text())
    compare += ["--doc", str(page)]
    compare += args.compare_extra
    subprocess.run(compare, check=False)
    doc = json.loads(compared.read_text()) if compared.is_file() else {"rows": []}
    row["best_row_tok_s"] = fastest(doc, model, ("dataflow",), row["budget_bytes"])
    if model not in stock:
        stock[model] = fastest(doc, model, ("pytorch",), None)
    row["stock_tok_s"] = stock[model]
    return row | searched


def table(rows: list[dict[str, Any]]) -> str:
    """The rows as a Markdown table, with the plain command's ratio to each row."""
    lines = [
        "| model | budget | tok/s | best compare.py row | x best | stock | x stock | chosen | search s |",
        "| --- | --: | --: | --: | --: | --: | --: | --- | --: |",
    ]
    for row in rows:
        best, stock = row["best_row_tok_s"], row["stock_tok_s"]
        lines.append(
            f"| {row['model']} | {row['budget_bytes'] / 2**30:g} GiB | {row['tok_s']:,.0f} "
            f"| {_number(best)} | {_ratio(row['tok_s'], best)} | {_number(stock)} "
            f"| {_ratio(row['tok_s'], stock)} | {row['chosen']} | {row['search_s']:.1f} |"
        )
    return "\n".join(lines) + "\n"


def _number(value: float | None) -> str:
    return "-" if value is None else f"{value:,.0f}"


def _ratio(value: float, base: float | None) -> str:
    return "-" if not base else f"{value / base:.3f}"


def merge(path: Path, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``path``'s rows with each of ``rows`` replacing the one of its cell."""
    old = json.loads(path.read_text())["rows"] if path.is_file() else []
    cells = {(row["model"], row["budget_bytes"]) for row in rows}
    kept = [row for row in old if (row["model"], row["budget_bytes"]) not in cells]
    return kept + rows


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cells", choices=sorted(CELLS), default="gpt2")
    parser.add_argument(
        "--budgets", default=None, help="only these of the group's budgets (e.g. 16GiB,4GiB)"
    )
    parser.add_argument("--steps", type=int, default=30)
    parser.add_argument("--warmup", type=int, default=10)
    parser.add_argument("--device", default=None, help="only for a smoke run: cpu")
    parser.add_argument("--out", type=Path, default=OUT_JSON)
    parser.add_argument(
        "--compare-extra", type=shlex.split, default=[], help="more compare.py arguments"
    )
    args = parser.parse_args(argv)
    if os.environ.get("SMOKE") == "1":
        args.cells, args.device = "smoke", "cpu"
        args.compare_extra = [*args.compare_extra, "--device", "cpu", "--compile-backend", "eager"]
        if args.out == OUT_JSON:  # a smoke run's rows are not results
            args.out = Path(tempfile.gettempdir()) / "zero_config_smoke.json"
    cells = CELLS[args.cells]
    if args.budgets:
        wanted = args.budgets.split(",")
        cells = [(model, budget) for model, budget in cells if budget in wanted]
        if not cells:
            parser.error(f"--budgets {args.budgets}: none of {args.cells}'s cells")
    stock: dict[str, float] = {}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as scratch:
        for model, budget in cells:  # each cell written as it ends: a cut call keeps them
            rows = merge(args.out, [run_cell(model, budget, args, Path(scratch), stock)])
            args.out.write_text(json.dumps({"rows": rows}, indent=1) + "\n")
            args.out.with_suffix(".md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
