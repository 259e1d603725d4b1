"""Where a training step's GPU time goes, stock torch.compile beside dataflow, kernel by kernel.

    python -m benchmarks.kernel_breakdown --preset gpt2_124m --stock-batches 16,64 \
        --dataflow 16GiB:16x4 --out benchmarks/results/kernel_breakdown

For each setup, a few warmed steps run under torch.profiler (CUDA activity only). Every
kernel's time is summed by name and by kind (matrix products, attention, fused Triton
work, the optimizer, copies, the rest), per 16,384 tokens, so that setups with different
steps compare directly. The stock rows are ``benchmarks/harness/stock.py`` (pure bf16 or
autocast, ``torch.compile``); the dataflow rows are ``TrainingRun`` at a budget and
``batch x rounds`` (``--dataflow BUDGET:BATCHxROUNDS[:OPTION+OPTION]``, the compiled
resolver); options: ``cudnn`` (the cuDNN attention pair in place of the registry's
choice), ``eager-writes`` (the compiled math alone, its values copied into the arena after
each call, as before ``Strategy.run_into``). Written:
``breakdown.json`` (every kernel name's total), ``breakdown.md`` (the kinds side by side
and each setup's 25 largest kernels) and, with ``--traces``, each setup's Chrome trace.
"""

from __future__ import annotations

import argparse
import contextlib
import gzip
import itertools
import json
import re
import statistics
import tempfile
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch

from benchmarks.harness.compare_dataflow import close_quietly, random_batches, row_run, train_config
from benchmarks.harness.stock import build_stock
from dataflow.engine.backends.torch_graph import trace_activity
from dataflow.units import parse_size

#: per-16K-token figures (a round of 16 x 1024)
PER_TOKENS = 16384
#: kernel kind by name, first match wins (names as torch.profiler reports CUDA kernels)
KINDS = (
    ("attention", re.compile(r"flash|fmha|attention|cudnn", re.I)),
    ("optimizer", re.compile(r"adam|multi_tensor|foreach", re.I)),
    ("cross-entropy", re.compile(r"cross_entropy|_ce_|log_softmax|nll_loss", re.I)),
    ("matmul", re.compile(r"gemm|nvjet|cutlass|xmma|sm90|sm80|cublas|matmul", re.I)),
    ("fused triton", re.compile(r"^triton_")),
    ("layer norm", re.compile(r"layer_norm|layernorm", re.I)),
    ("elementwise", re.compile(r"elementwise|vectorized|unrolled|copy|fill|reduce", re.I)),
)


def kind_of(name: str) -> str:
    for kind, pattern in KINDS:
        if pattern.search(name):
            return kind
    return "other"


def traced(step: Callable[[], Any], steps: int, keep: Path | None) -> tuple[list, float]:
    """The CUDA trace events of ``steps`` calls of ``step`` and their median wall time."""
    from torch.profiler import ProfilerActivity, profile

    walls = []
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            torch.cuda.synchronize()
            began = time.perf_counter()
            step()
            torch.cuda.synchronize()
            walls.append(time.perf_counter() - began)
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        text = path.read_text()
    if keep is not None:
        with gzip.open(keep, "wt") as out:
            out.write(text)
    return json.loads(text).get("traceEvents", []), statistics.median(walls)


def summarise(label: str, events: list, wall_s: float, steps: int, tokens: int) -> dict:
    """Kernel time per name and per kind, in ms per ``PER_TOKENS`` tokens."""
    scale = PER_TOKENS / (tokens * steps) / 1e3  # us over all steps -> ms per 16K tokens
    names: dict[str, list[float]] = defaultdict(lambda: [0.0, 0])
    for event in events:
        if event.get("ph") == "X" and event.get("cat") == "kernel":
            names[event["name"]][0] += float(event["dur"])
            names[event["name"]][1] += 1
    by_kind: dict[str, float] = defaultdict(float)
    for name, (us, _) in names.items():
        by_kind[kind_of(name)] += us * scale
    activity = trace_activity(events)
    return {
        "setup": label,
        "tokens_per_step": tokens,
        "step_s": wall_s,
        "wall_ms_per_16k": wall_s * PER_TOKENS / tokens * 1e3,
        "kernel_busy_ms_per_16k": activity["kernel_busy_us"] * scale,
        "kernels_per_16k": sum(n for _, n in names.values()) * PER_TOKENS / (tokens * steps),
        "kinds_ms_per_16k": dict(sorted(by_kind.items(), key=lambda kv: -kv[1])),
        "kernels_ms_per_16k": {
            name: {"ms": us * scale, "launches_per_16k": n * PER_TOKENS / (tokens * steps)}
            for name, (us, n) in sorted(names.items(), key=lambda kv: -kv[1][0])
        },
    }


def stock_setup(config: Any, batch: int, seq_len: int, dtype: str) -> tuple[Callable, int]:
    step = build_stock(config, batch, seq_len, compile=True, dtype=dtype)
    counter = itertools.count()
    return (lambda: step(next(counter))), batch * seq_len


OPTIONS = ("cudnn", "eager-writes")


@contextlib.contextmanager
def options(chosen: set[str]) -> Iterator[None]:
    """The setup's options, patched in for its run and undone after."""
    import dataflow_resolver_torch.compiled as compiled
    import dataflow_training.drive.tasks as tasks

    from dataflow.plugins import kernels

    saved = (tasks.load_ops, compiled.CompiledStrategy.run_into)
    if "cudnn" in chosen:

        def load_ops(device: str, names: Any, **kw: Any) -> dict:
            ops = saved[0](device, names, **kw)
            for op in ("attention_fwd", "attention_bwd"):
                if op in ops:
                    ops[op] = kernels().get(f"{op}/cudnn").load()
            return ops

        tasks.load_ops = load_ops
    if "eager-writes" in chosen:
        compiled.CompiledStrategy.run_into = tasks.Strategy.run_into
    try:
        yield
    finally:
        tasks.load_ops, compiled.CompiledStrategy.run_into = saved


def dataflow_setup(
    family: Any, args: argparse.Namespace, budget: int, batch: int, rounds: int
) -> tuple[Callable, int, Any]:
    from dataflow_training.step.config import head_chunk_tokens

    chunk = head_chunk_tokens(budget, family.config(args.preset).vocab_size)
    train = train_config(args.dtype, batch, rounds, args.seq_len, chunk)
    run = row_run(family, args.preset, train, budget, device="cuda", resolver=args.resolver)
    data = random_batches(run.vocab_size, batch, rounds, args.seq_len, 0)
    return (lambda: run.step(data)), batch * rounds * args.seq_len, run


def table(rows: list[dict]) -> str:
    kinds = sorted({k for r in rows for k in r["kinds_ms_per_16k"]})
    head = ["kind (ms per 16K tokens)"] + [r["setup"] for r in rows]
    lines = ["| " + " | ".join(head) + " |", "|" + " --- |" * len(head)]
    for kind in kinds:
        cells = [f"{r['kinds_ms_per_16k'].get(kind, 0.0):.2f}" for r in rows]
        lines.append(f"| {kind} | " + " | ".join(cells) + " |")
    for key, label in (
        ("kernel_busy_ms_per_16k", "kernels busy (union)"),
        ("wall_ms_per_16k", "wall step"),
        ("kernels_per_16k", "kernel launches"),
    ):
        cells = [f"{r[key]:.2f}" if key != "kernels_per_16k" else f"{r[key]:.0f}" for r in rows]
        lines.append(f"| **{label}** | " + " | ".join(cells) + " |")
    out = ["\n".join(lines)]
    for r in rows:
        out.append(f"\n### {r['setup']}: the 25 largest kernels (ms per 16K tokens, launches)\n")
        for name, v in list(r["kernels_ms_per_16k"].items())[:25]:
            out.append(f"- {v['ms']:.3f} ms, {v['launches_per_16k']:.1f}x: `{name[:120]}`")
    return "\n".join(out) + "\n"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--family", default="gpt2")
    p.add_argument("--preset", default="gpt2_124m")
    p.add_argument("--seq-len", type=int, default=1024)
    p.add_argument("--stock-batches", default="16,64")
    p.add_argument("--stock-dtype", default="bf16", choices=["bf16", "autocast"])
    p.add_argument("--dtype", default="bf16", help="dataflow dtype policy (compare_dataflow)")
    p.add_argument(
        "--dataflow", default="16GiB:16x4", help="comma list of BUDGET:BATCHxROUNDS setups"
    )
    p.add_argument("--resolver", default="torch-compiled")
    p.add_argument("--warmup", type=int, default=3)
    p.add_argument("--steps", type=int, default=3)
    p.add_argument("--traces", action="store_true", help="keep each setup's Chrome trace")
    p.add_argument("--out", type=Path, required=True, help="folder for breakdown.json/.md")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        p.error("needs a CUDA device (the kernels are what it measures)")
    from dataflow.plugins import families

    family = families().get(args.family).load()
    config = family.config(args.preset)
    args.out.mkdir(parents=True, exist_ok=True)
    setups: list[tuple[str, Callable[[], tuple], set[str]]] = []
    for batch in (int(b) for b in args.stock_batches.split(",") if b):
        setups.append(
            (
                f"stock compile {args.stock_dtype} {batch}x{args.seq_len}",
                lambda batch=batch: (
                    *stock_setup(config, batch, args.seq_len, args.stock_dtype),
                    None,
                ),
                set(),
            )
        )
    for spec in (s for s in args.dataflow.split(",") if s):
        budget, shape, *rest = spec.split(":")
        chosen = set(rest[0].split("+")) if rest else set()
        if chosen - set(OPTIONS):
            p.error(f"--dataflow {spec}: unknown option(s) {sorted(chosen - set(OPTIONS))}")
        batch, rounds = (int(x) for x in shape.lower().split("x"))
        size = parse_size(budget)
        setups.append(
            (
                f"dataflow {budget} {batch}x{args.seq_len} x{rounds}"
                + (f" ({', '.join(sorted(chosen))})" if chosen else ""),
                lambda b=size, batch=batch, rounds=rounds: dataflow_setup(
                    family, args, b, batch, rounds
                ),
                chosen,
            )
        )
    rows = []
    for label, make, chosen in setups:
        began = time.perf_counter()
        with options(chosen):
            step, tokens, run = make()
            try:
                for _ in range(args.warmup):
                    step()
                keep = args.out / f"trace_{re.sub(r'[^A-Za-z0-9]+', '_', label)}.json.gz"
                events, wall = traced(step, args.steps, keep if args.traces else None)
            finally:
                if run is not None:
                    close_quietly(run)
                del step
                torch._dynamo.reset()
                torch.cuda.empty_cache()
        row = summarise(label, events, wall, args.steps, tokens)
        row["setup_s"] = time.perf_counter() - began
        rows.append(row)
        print(
            f"{label}: {row['wall_ms_per_16k']:.2f} ms wall, "
            f"{row['kernel_busy_ms_per_16k']:.2f} ms kernels per 16K tokens "
            f"({row['setup_s']:.0f} s)",
            flush=True,
        )
        (args.out / "breakdown.json").write_text(json.dumps({"rows": rows}, indent=1))
        (args.out / "breakdown.md").write_text(table(rows))
    print(table(rows))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
