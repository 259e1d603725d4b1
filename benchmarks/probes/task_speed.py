"""Probe, 2026-12-01 (session 3): how fast are gpt2_124m's tasks, summed, against stock PyTorch?

Answer: 0.80x and 0.56x stock eager's step at batch 8 and 32, 1.28x and 1.13x
torch.compile's (results/gpt2_task_speed.md). Whole steps are measured by compare.py
(docs/throughput.md) and kernel by kernel by kernel_breakdown.py now.

Per-task speed of a GPT-2 training step against stock PyTorch, on CUDA.

    python -m benchmarks.probes.task_speed --preset gpt2_124m --batches 8,32 \
        --out benchmarks/results/gpt2_task_speed.json

For each batch (x seq_len tokens): lower one training step (bf16 weights, gradients and
activations, float32 AdamW states), time every distinct task with CUDA events after a
warm-up (the profiling pass: ``repeats`` launches, median; the twelve block forwards share
one signature), and add the tasks up: ``sum_task_ms`` is what the step's compute costs
when nothing waits for memory. In the same run, stock PyTorch trains the same model at
the same shape (``benchmarks/harness/stock.py``: bf16 autocast over float32 weights, SDPA, fused
AdamW), eager and under ``torch.compile``. With ``--trace DIR`` a torch.profiler table
of one launch of every distinct task is written there.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import defaultdict
from pathlib import Path

import torch
from dataflow_training.drive.tasks import TrainingTasks
from dataflow_training.plan.profile import profile_program, signature
from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.lowering import lower

from benchmarks.harness.stock import time_stock
from dataflow.plugins import families, kernels, resolvers

POLICY = DtypePolicy("bfloat16", "bfloat16", "bfloat16")


def measure_tasks(
    family, preset, batch, seq_len, chunk_tokens, repeats, trace_dir=None, variants=None
):
    train = TrainConfig(seq_len=seq_len, batch=batch, dtype=POLICY, chunk_tokens=chunk_tokens)
    step = lower(family, preset, train)
    resolver = resolvers().get("torch").build(step)
    if variants:  # pinned variants (OP -> NAME) over the registry's choice
        ops = dict(resolver.ops("cuda"))
        ops |= {op: kernels().get(f"{op}/{name}").load() for op, name in variants.items()}
        resolver = TrainingTasks(step, ops=ops)

    profiles = profile_program(step, resolver, device="cuda", repeats=repeats)
    by_kind: dict[str, dict[str, float]] = defaultdict(lambda: {"count": 0, "ms": 0.0})
    for task in step.program.tasks:
        ms = profiles[signature(step, task)].cost_us / 1e3
        by_kind[task.kind]["count"] += 1
        by_kind[task.kind]["ms"] += ms
    if trace_dir is not None:
        _trace(step, resolver, trace_dir / f"tasks_b{batch}.txt")
    return sum(v["ms"] for v in by_kind.values()), dict(by_kind)


def _trace(step, resolver, path: Path) -> None:
    """One launch of each distinct task under torch.profiler: where the time goes."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        profile_program(step, resolver, device="cuda", repeats=1)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(prof.key_averages().table(sort_by="cuda_time_total", row_limit=40))


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2_124m")
    parser.add_argument("--batches", default="8,32")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--chunk-tokens", type=int, default=8192)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--stock-steps", type=int, default=10)
    parser.add_argument("--no-compile", action="store_true", help="skip the torch.compile row")
    parser.add_argument("--trace", type=Path, default=None)
    parser.add_argument(
        "--variant",
        action="append",
        default=[],
        metavar="OP=NAME",
        help="pin a kernel variant, e.g. attention_fwd=torch (repeatable)",
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpt2_task_speed.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("task_speed.py needs a CUDA device", file=sys.stderr)
        return 2
    family = families().get("gpt2").load()
    config = family.config(args.preset)
    warm_gpu()
    rows = []
    for batch in (int(b) for b in args.batches.split(",")):
        sum_ms, by_kind = measure_tasks(
            family,
            args.preset,
            batch,
            args.seq_len,
            args.chunk_tokens,
            args.repeats,
            args.trace,
            dict(v.split("=", 1) for v in args.variant),
        )
        eager = time_stock(config, batch, args.seq_len, steps=args.stock_steps)
        compiled = (
            None
            if args.no_compile
            else time_stock(config, batch, args.seq_len, compile=True, steps=args.stock_steps)
        )
        row = {
            "batch": batch,
            "seq_len": args.seq_len,
            "sum_task_ms": round(sum_ms, 3),
            "stock_eager_ms": round(eager["step_ms"], 3),
            "stock_compile_ms": round(compiled["step_ms"], 3) if compiled else None,
            "ratio_to_stock_eager": round(sum_ms / eager["step_ms"], 4),
            "ratio_to_stock_compile": round(sum_ms / compiled["step_ms"], 4) if compiled else None,
            "by_kind_ms": {k: round(v["ms"], 3) for k, v in by_kind.items()},
            "tasks_by_kind": {k: v["count"] for k, v in by_kind.items()},
            "stock_eager_peak_bytes": eager["peak_bytes"],
            "stock_compile_peak_bytes": compiled["peak_bytes"] if compiled else None,
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    meta = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "preset": args.preset,
        "policy": "bf16 weights, grads, activations; float32 AdamW states",
        "chunk_tokens": args.chunk_tokens,
        "pinned_variants": args.variant,
        "repeats": args.repeats,
        "stock": "benchmarks.harness.stock: fp32 master weights, bf16 autocast, SDPA, AdamW(fused)",
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "rows": rows}, indent=2) + "\n")
    args.out.with_suffix(".md").write_text(table(meta, rows))
    print(table(meta, rows))
    return 0


def warm_gpu(seconds: float = 3.0) -> None:
    """Matrix products for a few seconds, so the first measurement does not meet idle
    clocks (seen on the H200: 345 MHz idle, 1980 MHz under load)."""
    import time

    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    end = time.perf_counter() + seconds
    while time.perf_counter() < end:
        for _ in range(10):
            a @ a
        torch.cuda.synchronize()


def table(meta, rows) -> str:
    lines = [
        f"# GPT-2 task speed ({meta['preset']}, {meta['device']}, torch {meta['torch']})",
        "",
        "| batch x seq | sum of tasks (ms) | stock eager (ms) | stock compile (ms) | "
        "ratio to eager | ratio to compile |",
        "| --- | --- | --- | --- | --- | --- |",
    ]
    for r in rows:
        compile_ms = r["stock_compile_ms"] if r["stock_compile_ms"] is not None else "-"
        compile_ratio = r["ratio_to_stock_compile"] if r["ratio_to_stock_compile"] else "-"
        lines.append(
            f"| {r['batch']} x {r['seq_len']} | {r['sum_task_ms']} | {r['stock_eager_ms']} | "
            f"{compile_ms} | {r['ratio_to_stock_eager']} | {compile_ratio} |"
        )
    lines += ["", "Time by task kind (ms, all tasks of the kind):", ""]
    for r in rows:
        parts = ", ".join(
            f"{k} {v} ({r['tasks_by_kind'][k]})" for k, v in sorted(r["by_kind_ms"].items())
        )
        lines.append(f"- {r['batch']} x {r['seq_len']}: {parts}")
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
