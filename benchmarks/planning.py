"""How well, and how fast, PressureFit plans chains of several shapes at every budget.

For each shape of ``dataflow.testing.shapes`` (training steps whose transfers fit under
their compute, training steps with a link-bound optimizer, training steps with a large
tied embedding and a link-bound forward pass, weight streaming, random chains) and each
of ``--seeds`` seeds, it finds the smallest budget that plans (``minimal_budget``) and
the no-offload peak, and plans at ``--rungs`` budgets evenly spaced from the peak down to
that minimum, through ``dataflow.planning.plan`` (the
planner registry, with the simulator re-validating every plan). Per shape it reports:
the share of cases planned validly, makespan over the best lower bound (median, p90,
max), planning time, and the share whose static placement fits the budget.

Then it plans one chain of about 2,000 tasks per shape at four budgets (the peak, half and
a quarter of the way down to the largest task's base, and that base) and reports the
planning time (the target: under 2 s on the CI machine, 2 cores).

Run: ``python benchmarks/planning.py`` (``--no-write`` to only print; ``--ablation`` to
also compare single portfolio members against the whole portfolio). It writes
``benchmarks/results/planning.json`` (summary), ``planning_cases.jsonl`` (one line per
planned case) and ``planning.md`` (the tables).
"""

from __future__ import annotations

import argparse
import datetime
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
from pathlib import Path

from dataflow.planning import PlanningError, minimal_budget, plan
from dataflow.planning.intervals import build_chain, no_offload_peak_bytes
from dataflow.planning.placement import place
from dataflow.planning.pressurefit import ALTERNATIVES, PORTFOLIO, search
from dataflow.schema import Program
from dataflow.testing.shapes import SHAPES

RESULTS = Path(__file__).parent / "results"
#: Budgets of the large chains: this share of the way from the floor up to the peak.
SHARES = (1.0, 0.5, 0.25, 0.0)
#: shape -> keyword that makes a chain of about 2,000 tasks
LARGE = {
    "training": {"layers": 665, "rounds": 1},
    "training-linkbound": {"layers": 665, "rounds": 1},
    "tied-embedding": {"layers": 665, "rounds": 1},
    "streaming": {"layers": 499, "passes": 4},
    "random": {"tasks": 2000},
}


def quantile(values: list[float], share: float) -> float:
    """Nearest-rank quantile."""
    ordered = sorted(values)
    return ordered[max(0, math.ceil(share * len(ordered)) - 1)]


def ladder(low: int, high: int, rungs: int) -> list[int]:
    """``rungs`` budgets from ``high`` down to ``low`` (distinct, ascending)."""
    if high <= low:
        return [low]
    return sorted({low + (high - low) * k // (rungs - 1) for k in range(rungs)})


def run_case(program: Program, budget: int, placement: bool) -> dict:
    row: dict = {"program": program.name, "tasks": len(program.tasks), "budget_bytes": budget}
    try:
        planned = plan(program, budget)
    except PlanningError as exc:
        row.update(valid=False, error=str(exc).splitlines()[0])
        return row
    row.update(
        valid=planned.sim.valid,
        makespan_us=planned.makespan_us,
        lower_bound_us=planned.lower_bound_us,
        ratio=planned.makespan_ratio,
        planning_s=planned.planning_s,
        moved_bytes=planned.moved_bytes,
        idle_fraction=planned.sim.compute_idle_fraction,
    )
    if placement:
        try:
            placed = place(planned)
            row.update(
                placed=True,
                arena_bytes=placed.arena_bytes,
                replanned=placed.plan.budget_bytes != budget,
            )
        except PlanningError:
            row.update(placed=False)
    return row


def run_shape(shape: str, seeds: int, rungs: int, placement: bool) -> list[dict]:
    rows = []
    for seed in range(seeds):
        program = SHAPES[shape](random.Random(seed))
        low = minimal_budget(program)
        high = max(low, no_offload_peak_bytes(build_chain(program)))
        for rung, budget in enumerate(ladder(low, high, rungs)):
            row = run_case(program, budget, placement)
            row.update(shape=shape, seed=seed, rung=rung, minimal_bytes=low, peak_bytes=high)
            rows.append(row)
    return rows


def summarize(shape: str, rows: list[dict]) -> dict:
    valid = [row for row in rows if row["valid"]]
    ratios = [row["ratio"] for row in valid]
    times = [row["planning_s"] for row in valid]
    placed = [row for row in valid if "placed" in row]
    return {
        "shape": shape,
        "cases": len(rows),
        "valid_pct": 100 * len(valid) / len(rows),
        "ratio_median": statistics.median(ratios),
        "ratio_p90": quantile(ratios, 0.9),
        "ratio_max": max(ratios),
        "planning_s_median": statistics.median(times),
        "planning_s_max": max(times),
        "placed_pct": 100 * sum(row["placed"] for row in placed) / len(placed) if placed else None,
    }


def run_large(shape: str) -> dict:
    """Plan one chain of about 2,000 tasks at the peak, half and a quarter of the way down
    to the floor (the largest base), and at the floor itself."""
    program = SHAPES[shape](random.Random(0), **LARGE[shape])
    chain = build_chain(program)
    high = no_offload_peak_bytes(chain)
    low = max(chain.base_bytes)
    planner_s, total_s, ratios = [], [], []
    for share in SHARES:
        budget = int(low + (high - low) * share)
        started = time.perf_counter()
        try:
            planned = plan(program, budget)
        except PlanningError:
            planner_s.append(None)
            total_s.append(round(time.perf_counter() - started, 3))
            ratios.append(None)
            continue
        total_s.append(round(time.perf_counter() - started, 3))
        planner_s.append(round(planned.planning_s, 3))
        ratios.append(planned.makespan_ratio)
    return {
        "shape": shape,
        "tasks": len(program.tasks),
        "planning_s": planner_s,
        "plan_call_s": total_s,
        "ratio": ratios,
    }


def ablation(seeds: int, rungs: int) -> list[dict]:
    """Makespan ratio of the portfolio, of the portfolio with every alternative added, and
    of each member and alternative alone."""
    members = [("portfolio", PORTFOLIO), ("portfolio + alternatives", PORTFOLIO + ALTERNATIVES)]
    members += [(str(s), (s,)) for s in PORTFOLIO + ALTERNATIVES]
    out = []
    for shape in SHAPES:
        cases = []
        for seed in range(seeds):
            program = SHAPES[shape](random.Random(seed))
            low = minimal_budget(program)
            high = max(low, no_offload_peak_bytes(build_chain(program)))
            cases += [(program, budget) for budget in ladder(low, high, rungs)]
        for name, portfolio in members:
            ratios, failed = [], 0
            for program, budget in cases:
                found = search(program, budget, portfolio=portfolio)
                if found.best is None:
                    failed += 1
                    continue
                ratios.append(found.best.sim.makespan_us / found.lower_bound.best_us)
            out.append(
                {
                    "shape": shape,
                    "strategy": name,
                    "failed": failed,
                    "ratio_median": statistics.median(ratios),
                    "ratio_p90": quantile(ratios, 0.9),
                    "ratio_max": max(ratios),
                    "ratio_mean": statistics.mean(ratios),
                }
            )
    return out


def markdown(summary: list[dict], large: list[dict], ablations: list[dict] | None) -> str:
    lines = [
        "| shape | cases | valid | makespan / lower bound: median | p90 | max "
        "| planning s: median | max | placed within budget |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        placed = "n/a" if s["placed_pct"] is None else f"{s['placed_pct']:.0f} %"
        lines.append(
            f"| {s['shape']} | {s['cases']} | {s['valid_pct']:.0f} % | {s['ratio_median']:.4f} "
            f"| {s['ratio_p90']:.4f} | {s['ratio_max']:.4f} | {s['planning_s_median']:.3f} "
            f"| {s['planning_s_max']:.3f} | {placed} |"
        )
    lines += [
        "",
        "| shape (about 2,000 tasks) | tasks | planner s at the peak / 50 % / 25 % / the floor "
        "| whole `plan()` s | makespan / lower bound |",
        "|---|---|---|---|---|",
    ]

    def cells(values: list, form: str) -> str:
        return " / ".join("infeasible" if v is None else format(v, form) for v in values)

    for r in large:
        lines.append(
            f"| {r['shape']} | {r['tasks']} | {cells(r['planning_s'], '.2f')} | "
            f"{cells(r['plan_call_s'], '.2f')} | {cells(r['ratio'], '.3f')} |"
        )
    if ablations:
        lines += [
            "",
            "| shape | strategy | failed | median | p90 | max | mean |",
            "|---|---|---|---|---|---|---|",
        ]
        for a in ablations:
            lines.append(
                f"| {a['shape']} | {a['strategy']} | {a['failed']} | "
                f"{a['ratio_median']:.4f} | {a['ratio_p90']:.4f} | "
                f"{a['ratio_max']:.4f} | {a['ratio_mean']:.4f} |"
            )
    return "\n".join(lines) + "\n"


def machine() -> dict:
    commit = subprocess.run(
        ["git", "rev-parse", "--short", "HEAD"],
        capture_output=True,
        text=True,
        cwd=Path(__file__).parent,
    ).stdout.strip()
    return {
        "date": datetime.date.today().isoformat(),
        "commit": commit,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "cpus": os.cpu_count(),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--rungs", type=int, default=8)
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--no-placement", action="store_true")
    parser.add_argument("--no-large", action="store_true")
    parser.add_argument("--ablation", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows, summary = [], []
    for shape in args.shapes.split(","):
        shape_rows = run_shape(shape, args.seeds, args.rungs, not args.no_placement)
        rows += shape_rows
        summary.append(summarize(shape, shape_rows))
        print(json.dumps(summary[-1]), flush=True)
    large = [] if args.no_large else [run_large(shape) for shape in args.shapes.split(",")]
    ablations = ablation(max(4, args.seeds // 2), args.rungs) if args.ablation else None
    table = markdown(summary, large, ablations)
    print(table)
    print(f"total {time.perf_counter() - started:.0f} s")
    if not args.no_write:
        RESULTS.mkdir(exist_ok=True)
        document = {
            "machine": machine(),
            "seeds": args.seeds,
            "rungs": args.rungs,
            "summary": summary,
            "large": large,
            "ablation": ablations,
        }
        (RESULTS / "planning.json").write_text(json.dumps(document, indent=1) + "\n")
        (RESULTS / "planning_cases.jsonl").write_text(
            "".join(json.dumps(row, sort_keys=True) + "\n" for row in rows)
        )
        info = document["machine"]
        header = (
            f"Planning benchmark, {info['date']}, commit {info['commit']}, "
            f"{info['cpus']} CPUs, Python {info['python']}: "
            f"`python benchmarks/planning.py --seeds {args.seeds} --rungs {args.rungs}"
            f"{' --ablation' if args.ablation else ''}`\n\n"
        )
        (RESULTS / "planning.md").write_text(header + table)
    invalid = sum(not row["valid"] for row in rows)
    return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main())
