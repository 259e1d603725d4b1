"""Probe, 2026-12-06 (session 33): where does an RL policy update's wall time go?

Asked because l3_1b's update of 128 rows in 16 rounds at 4 GiB took 3.32 s on the H100
(39.5k tok/s, 0.64x of stock's 61.7k) against its plan's 1.25 s (at the h200 entry's
rates), while stock took 0.265 s for 16 rows (2.12 s for 128 at its rate).

Answer (H100, each figure one update after warm-up, ms):

| | wall | carry-over | makespan | recompute | backward | head | AdamW | task gaps |
| --- | --- | --- | --- | --- | --- | --- | --- | --- |
| eager blocks and head | 3,161-3,315 | 442-596 | 2,695-2,710 | 679-689 | 1,283-1,302 | 479-483 | 72-77 | 123 |
| blocks compiled | 2,881-2,887 | 454 | 2,418-2,423 | 572-573 | 1,155-1,158 | 475 | 69 | 102 |
| and head fused, copy split in 4 | 2,863-2,991 | 236-274 | 2,578-2,660 | 701-725 | 1,295-1,316 | 299-301 | 88-94 | 147-172 |

(the last row ran on another H100 machine; its blocks were slower than the second row's
on the same code). The carry-over is the engine's host copy of the fed hidden states
(4.3 GB in 128 objects of 33.5 MB) into its page-locked pool: 766 / 377 / 235 / 187 ms
with 1 / 2 / 4 / 8 copy threads. The profiled update's device kernels sum to 2.10 s
(0.39 s of it copies on the transfer streams) against a 2.6 s makespan: the compute
stream waits on the host between kernels (1.06M ``cudaEventQuery`` calls an update from
the engine's polling), which CUDA graphs would remove once the head stops reading counts
on the host (``nonzero``, ``count_nonzero``). Transfers run at 51-53 GB/s and hide
behind compute.

Splits measured updates (after ``--warmup``) into the trainer's host work on the batch
(``PolicyTrainer._batch``: the rounds' slices of the rollouts), the engine's carry-over of
it (the copies onto the device included), and the engine's step; the step's tasks by kind
(measured device time beside the plan's ``cost_us`` and the host's time launching them),
the idle time between them, and its
transfers by direction (bytes, busy time, rate). Then one update for each of
``COPY_THREADS`` (the threads copying the fed hidden states), with the copies made before
the update and while it runs (``torch_feed_copies``), one with the engine's ``run_ahead``
off (each task launched after the host saw the one before end), and one more under
``torch.profiler``: the kernels that took the most device time (``--trace`` also writes
its chrome trace).

    python -m benchmarks.probes.rl_timeline --preset l3_1b --rows 128 --rounds 16 \
        --hidden-every 2 --budget 4GiB --trace $OUT/rl_trace.json

It takes ``benchmarks/rl_update.py``'s options (one ``--budget``).
"""

from __future__ import annotations

import json
import time
from collections import defaultdict
from pathlib import Path

import torch
from dataflow_rl_example import PolicyTrainer

from benchmarks.harness.measure import synchronize
from benchmarks.probes.step_gaps import Timed
from benchmarks.rl_update import arguments, probe_trainer
from dataflow.engine.backends import torch_storage

#: the kernels listed from the profiled update
TOP_KERNELS = 15
#: the split host copy's threads tried, one update each
COPY_THREADS = (1, 2, 4, 8)


def step_breakdown(trainer: PolicyTrainer) -> dict:
    """The last update's tasks by kind (count, measured and planned ms), the device's idle
    time between tasks, and its transfers by direction."""
    run = trainer.last_run
    trace = run.steps[-1]
    if trace.replayed:  # a CUDA graph's replay: its makespan, nothing timed inside it
        return {"makespan_ms": round(trace.makespan_us / 1e3, 1), "replayed": True}
    kinds = {task.id: task for task in run.program.tasks}
    # the host's time launching each task (the tasks launch in the program's order)
    host = dict(zip((t.id for t in run.program.tasks), run.launch_host_us[-1], strict=False))
    by_kind: dict[str, list[float]] = defaultdict(lambda: [0, 0.0, 0.0, 0.0])
    for record in trace.tasks:
        entry = by_kind[kinds[record.task].kind]
        entry[0] += 1
        entry[1] += (record.end_us - record.start_us) / 1e3
        entry[2] += kinds[record.task].cost_us / 1e3
        entry[3] += host.get(record.task, 0.0) / 1e3
    moved: dict[str, list[float]] = defaultdict(lambda: [0, 0.0])
    for transfer in trace.transfers:
        if transfer.start_us is not None and transfer.end_us is not None:
            moved[transfer.direction][0] += transfer.size_bytes
            moved[transfer.direction][1] += (transfer.end_us - transfer.start_us) / 1e3
    return {
        "makespan_ms": round(trace.makespan_us / 1e3, 1),
        "task_gaps_ms": round(sum(run.task_gaps_us()) / 1e3, 1),
        "launched_ahead": f"{trace.launched_ahead} of {len(trace.tasks)} tasks",
        "kinds": {
            kind: {
                "tasks": n,
                "measured_ms": round(ms, 1),
                "planned_ms": round(planned, 1),
                "launch_host_ms": round(launching, 1),
            }
            for kind, (n, ms, planned, launching) in sorted(by_kind.items())
        },
        "transfers": {
            way: {
                "GB": round(size / 1e9, 2),
                "busy_ms": round(ms, 1),
                "GB_s": round(size / 1e6 / ms, 1) if ms else None,
            }
            for way, (size, ms) in sorted(moved.items())
        },
    }


def main() -> None:
    parser = arguments(__doc__.split("\n\n")[0])
    parser.set_defaults(rows=128, rounds=16, hidden_every=2)
    parser.add_argument("--trace", type=Path, default=None, help="write the chrome trace here")
    args, budget, trainer, rollouts = probe_trainer(parser, workspaces=True)
    cuda = args.device.startswith("cuda")
    if cuda:
        torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated() if cuda else 0
    trainer.update(rollouts, lr=1e-6)  # lowers, plans and loads
    default_threads = torch_storage.HOST_COPY_THREADS
    batch = trainer._batch = Timed(trainer._batch)
    carry = trainer._engine._carry_over = Timed(trainer._engine._carry_over)
    run = trainer._engine.run = Timed(trainer._engine.run)
    for _ in range(args.warmup):
        trainer.update(rollouts, lr=1e-6)
    synchronize(args.device)
    for timed in (batch, carry, run):
        timed.take()
    for i in range(args.steps):
        began = time.perf_counter()
        trainer.update(rollouts, lr=1e-6)
        synchronize(args.device)
        wall = time.perf_counter() - began
        found = {
            "update": i,
            "wall_ms": round(wall * 1e3, 1),
            "batch_host_ms": round(batch.take() * 1e3, 1),
            "carry_over_ms": round(carry.take() * 1e3, 1),
            "engine_run_ms": round(run.take() * 1e3, 1),
            "planned_ms": round(trainer.last_plan.makespan_us / 1e3, 1),
        }
        if cuda:  # the allocator's peak: as the engine checks it (from its load) and whole
            found |= {
                "engine_peak_MB": trainer.last_run.allocator_peak_bytes / 1e6,
                "engine_base_MB": trainer._engine._allocator_base / 1e6,
                "peak_above_start_MB": (torch.cuda.max_memory_allocated() - before) / 1e6,
                "budget_MB": budget / 1e6 if budget else None,
            }
        print(json.dumps(found | step_breakdown(trainer)))

    # the fed hidden states' copies by the copy threads, made before the update (the
    # carry-over) and while it runs (the engine's default on CUDA: in the update's wall)
    backend = trainer._engine._backend
    default_deferred = backend.defer_feeds
    for deferred in (False, True):
        backend.defer_feeds = deferred
        for threads in COPY_THREADS:
            torch_storage.HOST_COPY_THREADS = threads
            carry.take()
            began = time.perf_counter()
            trainer.update(rollouts, lr=1e-6)
            synchronize(args.device)
            wall_ms = round((time.perf_counter() - began) * 1e3, 1)
            carry_ms = round(carry.take() * 1e3, 1)
            print(
                json.dumps(
                    {"copies_in_step": deferred, "copy_threads": threads, "wall_ms": wall_ms}
                    | {"carry_over_ms": carry_ms}
                )
            )
    torch_storage.HOST_COPY_THREADS = default_threads
    backend.defer_feeds = default_deferred

    # one update launching each task only after the host saw the one before end
    trainer._engine.run_ahead = False
    trainer.update(rollouts, lr=1e-6)
    synchronize(args.device)
    print(json.dumps({"run_ahead": False} | step_breakdown(trainer)))
    trainer._engine.run_ahead = True

    from torch.profiler import ProfilerActivity, profile

    with profile(
        activities=[ProfilerActivity.CPU]
        + ([ProfilerActivity.CUDA] if args.device.startswith("cuda") else [])
    ) as prof:
        trainer.update(rollouts, lr=1e-6)
        synchronize(args.device)
    print(
        prof.key_averages().table(
            sort_by="self_device_time_total"
            if args.device.startswith("cuda")
            else "self_cpu_time_total",
            row_limit=TOP_KERNELS,
            max_name_column_width=60,
        )
    )
    if args.trace is not None:
        prof.export_chrome_trace(str(args.trace))
        print(f"wrote {args.trace}")
    trainer.close()


if __name__ == "__main__":
    main()
