"""Probe, 2026-12-03 (sessions 13-14): where does a step's wall time beyond the makespan go?

Answer: into ``Engine._carry_over``'s host copies, split over torch's intra-op threads
that slept through the step (37-87 ms in 6 of 16 steps; under 2.4 ms with one thread).
The engine copies per-step values on its own thread since (results/step_gaps_gpt2_8GiB*.json;
docs/throughput.md, sessions 12-14).

Where a dataflow step's wall time goes beyond the engine's makespan (CUDA).

    python -m benchmarks.probes.step_gaps --budget-gib 8 --batch 32 --rounds 16 --out /tmp/gaps.json

compare.py's dataflow rows measure ``TrainingRun.step``'s wall time; the engine reports
its own makespan. In some runs of session 12 the two differed by 60-90 ms at 8 and 4 GiB
and by 3 ms in others, with the same plan. This runs one row's step (gpt2_124m, as
compare.py's trial does) and splits each measured step into the engine's ``run`` call,
the feed it calls, the loss reads after it and Python's garbage-collector pauses inside
the step (``gc.callbacks``), and the engine's own parts of a replayed step
(``ENGINE_PARTS``); then the same steps with the collector off.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from dataflow_training.step.config import head_chunk_tokens

from benchmarks.harness.compare_dataflow import random_batches, row_run, train_config
from dataflow.plugins import families

GIB = 1 << 30
#: Engine methods a replayed step calls (``Engine.run``), timed one by one
ENGINE_PARTS = ("_carry_over", "_device_values", "_replay", "_allocator_peak")
#: the backend's calls in ``Engine._carry_over``: forgetting residencies, writing start values
BACKEND_PARTS = ("reset_fast", "put_initial")


class Timed:
    """Seconds spent in a wrapped callable since the last ``take``."""

    def __init__(self, fn):
        self.fn, self.spent = fn, 0.0

    def __call__(self, *args, **kwargs):
        began = time.perf_counter()
        try:
            return self.fn(*args, **kwargs)
        finally:
            self.spent += time.perf_counter() - began

    def take(self) -> float:
        spent, self.spent = self.spent, 0.0
        return spent


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2_124m")
    parser.add_argument("--budget-gib", type=float, default=8)
    parser.add_argument("--batch", type=int, default=32)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--steps", type=int, default=8)
    parser.add_argument("--out", type=Path, default=None)
    parser.add_argument(
        "--threads", type=int, default=None, help="torch.set_num_threads before the run"
    )
    args = parser.parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    if not torch.cuda.is_available():
        print("step_gaps.py needs a CUDA device", file=sys.stderr)
        return 2
    family = families().get("gpt2").load()
    config = family.config(args.preset)
    budget = int(args.budget_gib * GIB)
    train = train_config(
        "bf16", args.batch, args.rounds, args.seq_len, head_chunk_tokens(budget, config.vocab_size)
    )
    run = row_run(family, args.preset, train, budget, device="cuda", resolver="torch-compiled")
    data = [
        random_batches(run.vocab_size, args.batch, args.rounds, args.seq_len, s) for s in (0, 1)
    ]
    for i in range(3):
        run.step(data[i % 2])
    engine = run._engine
    engine_run = engine.run = Timed(engine.run)
    # the parts of Engine.run a replayed step goes through, each timed on the host
    parts = {name: Timed(getattr(engine, name)) for name in ENGINE_PARTS}
    for name, timed in parts.items():
        setattr(engine, name, timed)
    for name in BACKEND_PARTS:  # inside _carry_over: which of its writes takes the time
        parts[name] = Timed(getattr(engine._backend, name))
        setattr(engine._backend, name, parts[name])
    # each write of _carry_over on its own: the slowest of a step, its object and where
    # that object starts (a host copy into the slow pool, or a copy to the device)
    writes: list[tuple[float, str, str]] = []
    put_initial = parts["put_initial"].fn  # the backend's own method (Timed wraps it)

    def timed_put(obj: str, tensor, **kwargs) -> None:
        began = time.perf_counter()
        put_initial(obj, tensor, **kwargs)
        location = engine._backend.objs[obj].location.value
        writes.append((time.perf_counter() - began, obj, location))

    parts["put_initial"].fn = timed_put
    reads = engine.read_scalars = Timed(engine.read_scalars)
    feed = run._data = Timed(run._data)
    pauses: list[tuple[int, float]] = []
    began = [0.0]

    def on_gc(phase: str, info: dict) -> None:
        if phase == "start":
            began[0] = time.perf_counter()
        else:
            pauses.append((info["generation"], time.perf_counter() - began[0]))

    result = {"preset": args.preset, "budget_bytes": budget, "batch": args.batch}
    result["rounds"], result["threads"] = args.rounds, torch.get_num_threads()
    for label in ("gc on", "gc off"):
        if label == "gc off":
            gc.collect()
            gc.disable()
        gc.callbacks.append(on_gc)
        rows = []
        for i in range(args.steps):
            pauses.clear()
            writes.clear()
            engine_run.take(), reads.take(), feed.take()
            for timed in parts.values():
                timed.take()
            stats = run.step(data[i % 2])
            rows.append(
                {
                    "step_s": stats.step_s,
                    "makespan_s": run.last_result.steps[-1].makespan_us / 1e6,
                    "engine_run_s": engine_run.take(),
                    "feed_s": feed.take(),
                    "reads_s": reads.take(),
                    "gc_pauses": list(pauses),
                    "writes": len(writes),
                    "slowest_write": max(writes, default=None),
                    **{f"{name.strip('_')}_s": timed.take() for name, timed in parts.items()},
                }
            )
        gc.callbacks.remove(on_gc)
        gc.enable()
        gap = [r["step_s"] - r["makespan_s"] for r in rows]
        result[label] = {"steps": rows, "median_gap_s": statistics.median(gap)}
        print(label, json.dumps({"median_gap_s": result[label]["median_gap_s"]}), flush=True)
        for r in rows:
            print(
                f"  step {r['step_s']:.4f} makespan {r['makespan_s']:.4f} run "
                f"{r['engine_run_s']:.4f} feed {r['feed_s']:.4f} reads {r['reads_s']:.4f} "
                f"gc {sum(p for _, p in r['gc_pauses']):.4f} ({len(r['gc_pauses'])}) "
                + " ".join(
                    f"{n.strip('_')} {r[n.strip('_') + '_s']:.4f}"
                    for n in (*ENGINE_PARTS, *BACKEND_PARTS)
                )
                + f" slowest of {r['writes']} writes {r['slowest_write']}",
                flush=True,
            )
    run.close()
    if args.out is not None:
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
