"""Probe, 2026-12-05 (issue 45, item 10): how much memory a task costs to read, validate and plan?

Answer: linear in the program, no blow-up: see results/program_memory.json and
docs/program_schema.md ("Limits"), which quote its bytes per task.

For each size, a bare training chain (``dataflow.testing.training_chain``, about three
tasks a layer) is written as JSON, then read and validated in a fresh interpreter, and
read and planned (PressureFit, the default planner, at a budget that forces streaming)
in another. Each child reports its resident memory after its imports and its peak
resident memory while it works (Linux's ``VmHWM``); the difference over the task count
is the figure. The
plugins are not loaded (no torch), so the baseline is the core alone.

    python -m benchmarks.probes.program_memory --out benchmarks/results/program_memory.json
    python -m benchmarks.probes.program_memory --tasks 1000 10000 --no-write

A size of 1e5 tasks takes about two minutes on a laptop core, most of it planning.
"""

from __future__ import annotations

import argparse
import json
import platform
import subprocess
import sys
import tempfile
from pathlib import Path

#: Run in a fresh interpreter: resident memory after the imports, then the peak while it
#: works, as one JSON line. The peak is Linux's VmHWM, reset after the imports (writing 5
#: to clear_refs); ``ru_maxrss`` would not do, as Linux carries it over from the parent
#: process, which built the program.
CHILD = """
import json, sys, time
from dataflow.schema import Program, validate
from dataflow.planning import plan

def status_kib(key):
    for line in open("/proc/self/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1])

path, phase = sys.argv[1], sys.argv[2]
with open("/proc/self/clear_refs", "w") as file:
    file.write("5")
before = status_kib("VmRSS")
started = time.perf_counter()
program = Program.from_json(path)
if phase == "validate":
    assert not validate(program)
else:
    plan(program, int(sys.argv[3]))
seconds = time.perf_counter() - started
after = status_kib("VmHWM")
print(json.dumps({"before_kib": before, "after_kib": after, "seconds": seconds,
                  "tasks": len(program.tasks), "objects": len(program.objects)}))
"""


def chain_file(tasks: int, folder: Path) -> tuple[Path, int]:
    """A training chain of about ``tasks`` tasks written to ``folder``; its path and a
    budget that makes PressureFit stream (a quarter of keeping everything)."""
    from dataflow.testing import keep_all_bytes, largest_footprint_bytes, training_chain

    program = training_chain(layers=max(1, (tasks - 5) // 3))
    path = folder / f"chain_{len(program.tasks)}.json"
    path.write_text(program.to_json())
    budget = max(largest_footprint_bytes(program) * 2, keep_all_bytes(program) // 4)
    return path, budget


def measure(path: Path, phase: str, budget_bytes: int) -> dict:
    found = subprocess.run(
        [sys.executable, "-c", CHILD, str(path), phase, str(budget_bytes)],
        check=True,
        capture_output=True,
        text=True,
    )
    row = json.loads(found.stdout)
    peak_bytes = (row["after_kib"] - row["before_kib"]) * 1024
    return {
        "phase": phase,
        "tasks": row["tasks"],
        "objects": row["objects"],
        "file_bytes": path.stat().st_size,
        "peak_rss_above_imports_bytes": peak_bytes,
        "bytes_per_task": round(peak_bytes / row["tasks"]),
        "seconds": round(row["seconds"], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--tasks", type=int, nargs="+", default=[1_000, 10_000, 100_000])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/program_memory.json"))
    parser.add_argument("--no-write", action="store_true")
    args = parser.parse_args()
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        for tasks in args.tasks:
            path, budget = chain_file(tasks, Path(folder))
            for phase in ("validate", "plan"):
                rows.append({**measure(path, phase, budget), "budget_bytes": budget})
                print(json.dumps(rows[-1]), flush=True)
            path.unlink()
    if not args.no_write:
        document = {
            "question": __doc__.splitlines()[0],
            "command": "python -m benchmarks.probes.program_memory " + " ".join(sys.argv[1:]),
            "python": platform.python_version(),
            "machine": platform.machine(),
            "rows": rows,
        }
        args.out.write_text(json.dumps(document, indent=1) + "\n")
        print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
