"""How well, and how fast, PressureFit plans chains of several shapes at every budget.

For each shape of ``dataflow.testing.shapes`` (training steps whose transfers fit under
their compute, training steps with a link-bound optimizer, training steps with a large
tied embedding and a link-bound forward pass, weight streaming, random chains) and each
of ``--seeds`` seeds, it finds the smallest budget that plans (``minimal_budget``) and
the no-offload peak, and plans at ``--rungs`` budgets evenly spaced from the peak down to
that minimum (a dense ladder, 16 by default), through ``dataflow.planning.plan`` (the
simulator re-validating every plan). Per shape it reports: the share of cases planned
validly, makespan over the best lower bound (median, p90, max) and over the compute-only
one, planning time, the share whose static placement fits the budget, and how many rungs
got a plan slower than the best at a smaller rung (monotonicity violations). Shapes whose
weights and optimizer state are persistent are also planned cyclically (steady state).

Then it plans one chain of about 2,000 tasks per shape at four budgets (the peak, half and
a quarter of the way down to the largest task's base, and that base) and reports the
planning time (wall, and the CPU time of the whole ``plan()`` call, which a shared machine
inflates less), and the 10,000-task training chain the same way (targets: 0.5 s and 2 s
on the CI machine, 2 cores). Each of those is the fastest of ``--repeats`` (3) plans of
the same chain and budget.

Run: ``python -m benchmarks.planning`` (``--no-write`` to only print; ``--ablation`` to
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

from dataflow.planning import PlanningError, minimal_budget, place, plan
from dataflow.planning.intervals import build_chain, no_offload_peak_bytes
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
#: The 10,000-task training chain (1427 layers, 3 rounds).
HUGE = {"shape": "training", "layers": 1427, "rounds": 3}
#: Shapes planned cyclically too (their weights and optimizer state are persistent).
CYCLIC_SHAPES = ("training", "training-linkbound", "tied-embedding")


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
        compute_bound_us=planned.lower_bound.compute_us,
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
        best = math.inf
        for rung, budget in enumerate(ladder(low, high, rungs)):
            row = run_case(program, budget, placement)
            row.update(shape=shape, seed=seed, rung=rung, minimal_bytes=low, peak_bytes=high)
            if row["valid"]:
                # a larger budget slower than the best plan at any smaller one
                row["monotone"] = row["makespan_us"] <= best * (1 + 1e-9)
                row["slower_pct"] = max(0.0, 100 * (row["makespan_us"] / best - 1))
                best = min(best, row["makespan_us"])
            rows.append(row)
    return rows


def run_cyclic(shape: str, seeds: int, rungs: int) -> dict:
    """Cyclic plans of ``shape`` at ``rungs`` budgets: whether the cycle repeats, the
    steady-state iteration over one whole run (the first iteration, loads included), and
    over the cyclic lower bound."""
    rows = []
    for seed in range(seeds):
        program = SHAPES[shape](random.Random(seed))
        low = minimal_budget(program)
        high = max(low, no_offload_peak_bytes(build_chain(program)))
        for budget in ladder(low, high, rungs):
            try:
                planned = plan(program, budget, cyclic=True)
            except PlanningError as exc:
                rows.append({"valid": False, "error": str(exc).splitlines()[0]})
                continue
            one = plan(program, budget)
            rows.append(
                {
                    "valid": planned.cycle.valid,
                    "iteration_over_one_run": planned.cycle.iteration_us / one.makespan_us,
                    "ratio": planned.makespan_ratio,
                    "planning_s": planned.planning_s,
                }
            )
    valid = [row for row in rows if row["valid"]]
    return {
        "shape": shape,
        "cases": len(rows),
        "valid_pct": 100 * len(valid) / len(rows),
        "iteration_over_one_run_median": statistics.median(
            row["iteration_over_one_run"] for row in valid
        ),
        "ratio_median": statistics.median(row["ratio"] for row in valid),
        "ratio_p90": quantile([row["ratio"] for row in valid], 0.9),
        "planning_s_max": max(row["planning_s"] for row in valid),
    }


def summarize(shape: str, rows: list[dict]) -> dict:
    valid = [row for row in rows if row["valid"]]
    ratios = [row["ratio"] for row in valid]
    times = [row["planning_s"] for row in valid]
    placed = [row for row in valid if "placed" in row]
    compute = [row["makespan_us"] / row["compute_bound_us"] for row in valid]
    return {
        "shape": shape,
        "cases": len(rows),
        "valid_pct": 100 * len(valid) / len(rows),
        "monotone_violations": sum(not row["monotone"] for row in valid),
        "slower_pct_max": max(row["slower_pct"] for row in valid),
        "compute_ratio_median": statistics.median(compute),
        "ratio_median": statistics.median(ratios),
        "ratio_p90": quantile(ratios, 0.9),
        "ratio_max": max(ratios),
        "planning_s_median": statistics.median(times),
        "planning_s_max": max(times),
        "placed_pct": 100 * sum(row["placed"] for row in placed) / len(placed) if placed else None,
    }


def run_large(shape: str, sizes: dict | None = None, repeats: int = 1) -> dict:
    """Plan one chain of about 2,000 tasks (or ``sizes``) at the peak, half and a quarter
    of the way down to the floor (the largest base), and at the floor itself.

    Each budget is planned ``repeats`` times and the fastest of each timing is kept: the
    plan is deterministic (the repeats must give the same makespan), so they differ only
    by what the machine adds, which never makes a run faster."""
    program = SHAPES[shape](random.Random(0), **(sizes or LARGE[shape]))
    chain = build_chain(program)
    high = no_offload_peak_bytes(chain)
    low = max(chain.base_bytes)
    planner_s, total_s, cpu_s, ratios = [], [], [], []
    for share in SHARES:
        budget = int(low + (high - low) * share)
        runs = [_timed_plan(program, budget) for _ in range(max(1, repeats))]
        if len({makespan for makespan, *_ in runs}) != 1:
            raise RuntimeError(f"{program.name} at {budget} bytes planned differently twice")
        makespan, _, _, _, ratio = runs[0]
        planner_s.append(None if makespan is None else min(r[1] for r in runs))
        total_s.append(min(r[2] for r in runs))
        cpu_s.append(min(r[3] for r in runs))
        ratios.append(ratio)
    return {
        "shape": shape,
        "tasks": len(program.tasks),
        "repeats": max(1, repeats),
        "planning_s": planner_s,
        "plan_call_s": total_s,
        "plan_call_cpu_s": cpu_s,
        "ratio": ratios,
    }


def _timed_plan(program: Program, budget: int) -> tuple:
    """(makespan or None when infeasible, planner s, whole call s, its CPU s, ratio)."""
    started, started_cpu = time.perf_counter(), time.process_time()
    try:
        planned = plan(program, budget)
    except PlanningError:
        planned = None
    total = round(time.perf_counter() - started, 3)
    cpu = round(time.process_time() - started_cpu, 3)
    if planned is None:
        return None, None, total, cpu, None
    return planned.makespan_us, round(planned.planning_s, 3), total, cpu, planned.makespan_ratio


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


def markdown(
    summary: list[dict],
    large: list[dict],
    ablations: list[dict] | None,
    cyclic: list[dict] | None = None,
) -> str:
    lines = [
        "| shape | cases | valid | makespan / lower bound: median | p90 | max "
        "| / compute only: median | planning s: median | max | placed within budget "
        "| monotonicity violations (worst) |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for s in summary:
        placed = "n/a" if s["placed_pct"] is None else _pct(s["placed_pct"])
        lines.append(
            f"| {s['shape']} | {s['cases']} | {s['valid_pct']:.0f} % | {s['ratio_median']:.4f} "
            f"| {s['ratio_p90']:.4f} | {s['ratio_max']:.4f} | {s['compute_ratio_median']:.4f} "
            f"| {s['planning_s_median']:.3f} | {s['planning_s_max']:.3f} | {placed} "
            f"| {s['monotone_violations']} (+{s['slower_pct_max']:.2f} %) |"
        )
    lines += [
        "",
        "| shape (about 2,000 tasks) | tasks | planner s at the peak / 50 % / 25 % / the floor "
        "| whole `plan()` s | its CPU s | makespan / lower bound |",
        "|---|---|---|---|---|---|",
    ]

    def cells(values: list, form: str) -> str:
        return " / ".join("infeasible" if v is None else format(v, form) for v in values)

    for r in large:
        lines.append(
            f"| {r['shape']} | {r['tasks']} | {cells(r['planning_s'], '.2f')} | "
            f"{cells(r['plan_call_s'], '.2f')} | {cells(r['plan_call_cpu_s'], '.2f')} | "
            f"{cells(r['ratio'], '.3f')} |"
        )
    if cyclic:
        lines += [
            "",
            "| shape (cyclic) | cases | cycle repeats | steady iteration / one run: median "
            "| iteration / cyclic bound: median | p90 | planning s: max |",
            "|---|---|---|---|---|---|---|",
        ]
        for c in cyclic:
            lines.append(
                f"| {c['shape']} | {c['cases']} | {c['valid_pct']:.0f} % "
                f"| {c['iteration_over_one_run_median']:.4f} | {c['ratio_median']:.4f} "
                f"| {c['ratio_p90']:.4f} | {c['planning_s_max']:.2f} |"
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


def _pct(value: float) -> str:
    """A share as the tables print it: "100 %" only when it is all (99.6 is not rounded up)."""
    return "100 %" if value == 100 else f"{min(value, 99.9):.1f} %"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, default=16)
    parser.add_argument("--rungs", type=int, default=16)
    parser.add_argument("--cyclic-seeds", type=int, default=4)
    parser.add_argument("--no-huge", action="store_true")
    parser.add_argument("--shapes", default=",".join(SHAPES))
    parser.add_argument("--no-placement", action="store_true")
    parser.add_argument("--no-large", action="store_true")
    parser.add_argument("--ablation", action="store_true")
    parser.add_argument("--no-write", action="store_true")
    parser.add_argument(
        "--repeats", type=int, default=3, help="plans of each large chain (fastest kept)"
    )
    args = parser.parse_args(argv)
    started = time.perf_counter()
    rows, summary = [], []
    for shape in args.shapes.split(","):
        shape_rows = run_shape(shape, args.seeds, args.rungs, not args.no_placement)
        rows += shape_rows
        summary.append(summarize(shape, shape_rows))
        print(json.dumps(summary[-1]), flush=True)
    large = (
        []
        if args.no_large
        else [run_large(shape, repeats=args.repeats) for shape in args.shapes.split(",")]
    )
    if not args.no_huge:
        sizes = {k: v for k, v in HUGE.items() if k != "shape"}
        large.append(run_large(HUGE["shape"], sizes, args.repeats))
        print(json.dumps(large[-1]), flush=True)
    cyclic = [
        run_cyclic(shape, args.cyclic_seeds, 4)
        for shape in CYCLIC_SHAPES
        if args.cyclic_seeds and shape in args.shapes.split(",")
    ]
    for row in cyclic:
        print(json.dumps(row), flush=True)
    ablations = ablation(max(4, args.seeds // 2), args.rungs) if args.ablation else None
    table = markdown(summary, large, ablations, cyclic)
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
            "cyclic": cyclic,
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
            f"`python -m benchmarks.planning --seeds {args.seeds} --rungs {args.rungs} "
            f"--cyclic-seeds {args.cyclic_seeds} --repeats {args.repeats}"
            f"{' --ablation' if args.ablation else ''}` (each large chain's timings: the "
            f"fastest of {args.repeats} plans)\n\n"
        )
        (RESULTS / "planning.md").write_text(header + table)
    invalid = sum(not row["valid"] for row in rows)
    return 1 if invalid else 0


if __name__ == "__main__":
    sys.exit(main())
