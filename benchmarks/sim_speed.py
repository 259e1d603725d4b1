"""How fast the simulator prices a 10,000-task training step (the planner's inner loop).

The program: ``training_chain(layers=1427, rounds=3)`` (embed, 1427 forward layers, fused
head, 1427 backward layers, embed backward per gradient-accumulation round, then one
optimizer task per layer: 10,000 tasks) annotated by ``stream_all``: every weight,
optimizer state and gradient is prefetched two tasks ahead and dropped after use, and
every saved activation is offloaded in the forward pass and prefetched back for the
backward pass (about 31,000 transfers). The fast budget (120 MiB) is below what the
prefetches want, so transfers wait for room and the run exercises every rule.

Run: ``python -m benchmarks.sim_speed`` (add ``--no-write`` to only print). It writes
``benchmarks/results/sim_speed.json`` and appends a row to ``benchmarks/results/sim_speed.md``;
it exits 1 when ``record=False`` takes more than the limit (1 s).
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from dataflow.schema import validate
from dataflow.sim import simulate
from dataflow.testing.chains import stream_all, training_chain

RESULTS = Path(__file__).parent / "results"
LAYERS, ROUNDS = 1427, 3
BUDGET_BYTES = 120 * 2**20
LIMIT_S = 1.0
TABLE_HEADER = (
    "| date | commit | machine | tasks | transfers | record=False s | record=True s "
    "| validate + record s |\n|---|---|---|---|---|---|---|---|\n"
)


def best_of(repeat: int, call: Callable[[], object]) -> tuple[float, float]:
    """(best, median) wall seconds of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        call()
        times.append(time.perf_counter() - start)
    return min(times), statistics.median(times)


def measure(repeat: int) -> dict:
    program = stream_all(training_chain(LAYERS, ROUNDS))
    problems = validate(program)
    assert not problems, problems[:3]
    result = simulate(program, budget_bytes=BUDGET_BYTES, record=False)
    assert result.valid, result.error
    quiet = best_of(
        repeat,
        lambda: simulate(program, budget_bytes=BUDGET_BYTES, record=False, check=False),
    )
    recorded = best_of(
        repeat, lambda: simulate(program, budget_bytes=BUDGET_BYTES, record=True, check=False)
    )
    default = best_of(repeat, lambda: simulate(program, budget_bytes=BUDGET_BYTES))
    return {
        "benchmark": "sim_speed",
        "program": program.name,
        "tasks": len(program.tasks),
        "objects": len(program.objects),
        "transfers": result.h2d.transfers + result.d2h.transfers,
        "budget_bytes": BUDGET_BYTES,
        "valid": result.valid,
        "makespan_us": result.makespan_us,
        "fast_peak_bytes": result.fast_peak_bytes,
        "compute_idle_fraction": round(result.compute_idle_fraction, 4),
        "repeat": repeat,
        "seconds": {
            "record_false_best": round(quiet[0], 4),
            "record_false_median": round(quiet[1], 4),
            "record_true_best": round(recorded[0], 4),
            "record_true_median": round(recorded[1], 4),
            "validate_and_record_best": round(default[0], 4),
            "validate_and_record_median": round(default[1], 4),
        },
        "limit_s": LIMIT_S,
        "within_limit": quiet[1] < LIMIT_S,
        "machine": {
            "python": platform.python_version(),
            "platform": platform.platform(),
            "cpus": os.cpu_count(),
            "load_average_1min": round(os.getloadavg()[0], 2),
        },
        "commit": _commit(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%d"),
    }


def _commit() -> str:
    try:
        out = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"],
            capture_output=True,
            text=True,
            check=True,
            cwd=Path(__file__).parent,
        )
    except (OSError, subprocess.CalledProcessError):
        return "unknown"
    return out.stdout.strip()


def write(report: dict) -> None:
    RESULTS.mkdir(parents=True, exist_ok=True)
    (RESULTS / "sim_speed.json").write_text(json.dumps(report, indent=1) + "\n")
    table = RESULTS / "sim_speed.md"
    if not table.exists():
        table.write_text("# Simulator speed (`python -m benchmarks.sim_speed`)\n\n" + TABLE_HEADER)
    seconds = report["seconds"]
    info = report["machine"]
    machine = f"{info['cpus']} cpus (load {info['load_average_1min']}), Python {info['python']}"
    row = (
        f"| {report['date']} | {report['commit']} | {machine} | {report['tasks']:,} "
        f"| {report['transfers']:,} | {seconds['record_false_median']:.3f} "
        f"| {seconds['record_true_median']:.3f} | {seconds['validate_and_record_median']:.3f} |\n"
    )
    with table.open("a") as handle:
        handle.write(row)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=7, help="runs per mode (median reported)")
    parser.add_argument("--no-write", action="store_true", help="print only, write nothing")
    args = parser.parse_args()
    report = measure(args.repeat)
    print(json.dumps(report, indent=1))
    if not args.no_write:
        write(report)
    if not report["within_limit"]:
        print(f"record=False took {report['seconds']['record_false_median']} s > {LIMIT_S} s")
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
