"""Probe, 2026-12-03 (sessions 12-13): which timing method prices tasks as a whole step runs them?

Answer: settled for 0.2 s first (``SETTLE_S``): 1.00 s of tasks for gpt2_124m's 16 GiB
step against 0.94 s timed cold (results/profile_method.json; docs/benchmarking.md,
"Profiling").

How the profiling pass's timing method moves a program's summed task cost (CUDA).

    python -m benchmarks.probes.profile_method --methods none,settle:0.2,settle:0.2+flush \
        --out benchmarks/results/profile_method.json

One gpt2_124m training step is lowered as compare.py's 16 GiB row runs it (bf16, batch
64 x 8 rounds, the head chunk of that budget) and every distinct task is timed by the
profiling pass once per method, with the resolver compare.py uses and CUDA-graph replay;
``sum_task_s`` is each method's cost of the whole step's tasks, which is what the
simulator adds up where nothing waits on a copy. Compare it with the kernel time of the
same step measured on the engine (compare.json's ``kernel_s`` for that row).

A method is ``none`` (a warm-up launch, then the timed ones), ``settle:S`` (the task runs
back to back for S seconds before it is timed, so the clocks are a loaded device's) and
``+flush`` (the L2 cache is overwritten before each timed launch).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import defaultdict
from pathlib import Path

import torch
from dataflow_training.plan.profile import profile_program, signature
from dataflow_training.step.config import head_chunk_tokens
from dataflow_training.step.lowering import lower

from benchmarks.harness.compare_dataflow import train_config
from dataflow.plugins import families, resolvers

GIB = 1 << 30


def parse_method(text: str) -> tuple[float, bool]:
    """``(settle_s, flush_l2)`` of one ``--methods`` entry."""
    parts = text.split("+")
    settle, flush = 0.0, False
    for part in parts:
        if part == "flush":
            flush = True
        elif part.startswith("settle:"):
            settle = float(part.removeprefix("settle:"))
        elif part != "none":
            raise SystemExit(f"--methods: unknown method '{part}' (none, settle:S, +flush)")
    return settle, flush


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2_124m")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--budget-gib", type=float, default=16)
    parser.add_argument("--resolver", default="torch-compiled")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--methods", default="none,settle:0.2,settle:0.2+flush,settle:1")
    parser.add_argument("--out", type=Path, default=None)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("profile_method.py needs a CUDA device", file=sys.stderr)
        return 2
    methods = [(m, *parse_method(m)) for m in args.methods.split(",")]
    family = families().get("gpt2").load()
    config = family.config(args.preset)
    chunk = head_chunk_tokens(int(args.budget_gib * GIB), config.vocab_size)
    train = train_config("bf16", args.batch, args.rounds, args.seq_len, chunk)
    step = lower(family, args.preset, train)
    resolver = resolvers().get(args.resolver).build(step)

    rows = []
    # the first pass compiles every task; measure it again so no method pays for that
    for name, settle_s, flush in [methods[0], *methods]:
        began = time.perf_counter()
        profiles = profile_program(
            step,
            resolver,
            device="cuda",
            repeats=args.repeats,
            graph=True,
            settle_s=settle_s,
            flush_l2=flush,
        )
        by_kind: dict[str, float] = defaultdict(float)
        for task in step.program.tasks:
            if not task.collective:
                by_kind[task.kind] += profiles[signature(step, task)].cost_us / 1e6
        rows.append(
            {
                "method": name,
                "settle_s": settle_s,
                "flush_l2": flush,
                "sum_task_s": sum(by_kind.values()),
                "by_kind_s": dict(by_kind),
                "signatures": len(profiles),
                "wall_s": time.perf_counter() - began,
            }
        )
        print(json.dumps({k: v for k, v in rows[-1].items() if k != "by_kind_s"}), flush=True)
    result = {
        "preset": args.preset,
        "batch": args.batch,
        "rounds": args.rounds,
        "seq_len": args.seq_len,
        "chunk_tokens": chunk,
        "resolver": args.resolver,
        "device": torch.cuda.get_device_name(),
        "rows": rows[1:],
        "first_pass": rows[0],
    }
    if args.out is not None:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
