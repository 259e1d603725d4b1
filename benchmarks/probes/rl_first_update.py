"""Probe, 2026-12-06 (session 35): what does the first RL update allocate beside its plan?

Asked because on the H100 both CUDA trainer tests of the example (llama3_tiny, no budget
given, so a budget of every object plus the workspace estimate and the CUDA libraries'
reserve: 42 MB) broke it: the allocator's peak was 87 MB against a ledger peak of 1 MB.
Guessed, not seen: the cuBLAS workspace of the compute stream (33.5 MB, in the reserve)
and something that runs once, when the first update compiles the blocks (inductor's
benchmarking, whose buffer to clear the L2 cache is the L2's size: 52 MB on an H100).
Whichever of the two tests ran first in its process broke the budget; the other, run
after it, passed: what the 45 MB are is allocated once a process. The trainer no longer
claims a budget when none is given; a given one still counts the first update.

Runs two updates under ``torch.cuda.memory._record_memory_history`` and prints, for
each, the allocator's peak above what was allocated before it, and the allocations alive
at that peak, largest first, each with the innermost frames of its stack that are not
torch's own (``--frames`` of them)::

    python -m benchmarks.probes.rl_first_update --preset llama3_tiny --rows 8 --budget 256MiB

(64 MiB, the first example here, is below what the update needs: the H100 refused it,
session 36, at least 103 MiB: a plan of 24.4 MiB and 78.5 MiB of task workspace.)

It takes ``benchmarks/rl_update.py``'s options (one ``--budget``, or none).
"""

from __future__ import annotations

import json
from typing import Any

import torch

from benchmarks.rl_update import arguments, probe_trainer

#: allocations listed at each peak
LISTED = 8


def live_at_peak(trace: list[dict[str, Any]]) -> tuple[int, list[dict[str, Any]]]:
    """The bytes alive at the trace's highest point (counted from its start) and the
    allocations alive then."""
    live: dict[int, dict[str, Any]] = {}
    total = peak = 0
    at_peak: list[dict[str, Any]] = []
    for event in trace:
        action = event["action"]
        if action == "alloc":
            live[event["addr"]] = event
            total += event["size"]
            if total > peak:
                peak, at_peak = total, list(live.values())
        elif action == "free_completed" and event["addr"] in live:
            total -= live.pop(event["addr"])["size"]
    return peak, at_peak


def where(event: dict[str, Any], frames: int) -> list[str]:
    """The innermost ``frames`` frames of an allocation's stack outside torch itself."""
    found = []
    for frame in event.get("frames", ()):
        name = frame.get("filename", "")
        if "/torch/" in name or name.startswith("??") or not name.endswith(".py"):
            continue
        found.append(f"{name.rsplit('/', 1)[-1]}:{frame.get('line')} {frame.get('name')}")
        if len(found) == frames:
            break
    return found


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.add_argument("--frames", type=int, default=3)
    parser.set_defaults(preset="llama3_tiny", rows=8, rounds=1)
    args, budget, trainer, rollouts = probe_trainer(parser, workspaces=True)
    for update in range(2):
        torch.cuda.synchronize()
        before = torch.cuda.memory_allocated()
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.memory._record_memory_history(max_entries=500_000)
        trainer.update(rollouts, lr=1e-6)
        torch.cuda.synchronize()
        snapshot = torch.cuda.memory._snapshot()
        torch.cuda.memory._record_memory_history(enabled=None)
        trace = snapshot["device_traces"][torch.cuda.current_device()]
        peak, alive = live_at_peak(trace)
        print(
            json.dumps(
                {
                    "update": update,
                    "budget": budget,
                    "allocated_before": before,
                    "peak_above_before": torch.cuda.max_memory_allocated() - before,
                    "traced_peak": peak,
                    "ledger_peak": trainer.last_run.fast_peak_bytes,
                }
            )
        )
        for event in sorted(alive, key=lambda e: -e["size"])[:LISTED]:
            print(f"  {event['size'] / 1e6:9.2f} MB  {' <- '.join(where(event, args.frames))}")


if __name__ == "__main__":
    main()
