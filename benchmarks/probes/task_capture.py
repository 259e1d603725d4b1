"""Probe, 2026-12-07 (session 41): which tasks cost more than planned, or refuse a graph?

Which of a step's tasks cost more than the planner's estimate said, which a CUDA graph
refuses, and where their time goes. Asked because two 8 GiB rows of issue 46 ran
dispatched, not replayed from a CUDA graph, and one of them far slower than planned (docs/throughput.md, session 41): the MoE cut's
tasks with its experts in shards measured 2-3x the share of the whole block's time the
place tool had priced them at (its route backward, with no experts at all, 16 ms a
call at batch 2 against the whole block's 20 ms at batch 4), and the dense cut's
capture failed with "operation failed due to a previous error during capture", naming no
task. Not yet answered: it waits for the device.

    python -m benchmarks.probes.task_capture --preset qwen3_5_moe_cut --batch 2 \
        --expert-shards 4 --vocab-pieces 2 --chunk 1024 --out $OUT/tasks_moe_b2.json
    python -m benchmarks.probes.task_capture --preset qwen3_5_cut --batch 2 \
        --vocab-pieces 4 --chunk 1024 --head-vocab-tiles --out $OUT/tasks_dense_b2.json

Every distinct task signature of the lowered step (the training plugin's profiling pass:
fresh filled buffers, an AuxTemp as its block's forward decides it) is launched: timed
dispatched by CUDA events and by the host clock (a host time near the device time is a
task bound by its launches), then captured alone into a CUDA graph and replayed, or the
capture's error kept; and one dispatched launch under torch.profiler gives its largest
kernels. Written: one JSON record a signature (task, kind, times, capture error, top
kernels; with ``--memory`` the named tasks' allocation peaks and the blocks alive there,
``harness.memory_trace``), and a table sorted by the time a round spends in each
signature (microseconds; the step's rounds repeat it). ``--cpu`` runs the same on the
CPU, host times alone, as a smoke test of the arguments.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import torch
from dataflow_training.cli.train_defaults import default_family
from dataflow_training.plan import profile as profiling
from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.family import load_family
from dataflow_training.step.lowering import lower

from benchmarks.harness.measure import cuda_median_ms
from benchmarks.harness.memory_trace import call_peak
from dataflow.plugins import resolvers

POLICY = DtypePolicy("bfloat16", "bfloat16", "bfloat16")
#: kernels listed per signature
TOP_KERNELS = 8


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--preset", required=True)
    p.add_argument("--family", default=None, help="default: the preset's")
    p.add_argument("--batch", type=int, default=2)
    p.add_argument("--seq-len", type=int, default=4096)
    p.add_argument("--chunk", type=int, default=1024, help="head tokens a chunk")
    p.add_argument("--vocab-pieces", type=int, default=1)
    p.add_argument("--expert-shards", type=int, default=0, help="0: the preset's")
    p.add_argument("--head-vocab-tiles", action="store_true")
    p.add_argument("--resolver", default="torch-compiled")
    p.add_argument("--repeats", type=int, default=5)
    p.add_argument("--out", type=Path, required=True)
    p.add_argument(
        "--cpu", action="store_true", help="a smoke run on the CPU: host times alone, no capture"
    )
    p.add_argument(
        "--memory",
        default="",
        metavar="KEYS",
        help="comma-separated compute-key parts (e.g. linear_block.backward,head): those "
        "tasks' allocation peaks, with what is alive there (CUDA)",
    )
    return p


def event_us(launch, repeats: int) -> float:
    """The median CUDA-event time of one launch (us)."""
    return 1e3 * cuda_median_ms(launch, warmup=1, repeats=repeats)


def host_us(launch, repeats: int, cuda: bool = True) -> list[float]:
    """The host's time to issue one launch (no synchronisation inside it)."""
    times = []
    for _ in range(repeats):
        if cuda:
            torch.cuda.synchronize()
        began = time.perf_counter()
        launch()
        times.append((time.perf_counter() - began) * 1e6)
        if cuda:
            torch.cuda.synchronize()
    return times


def captured_us(executable, ctx, repeats: int) -> tuple[float | None, str | None]:
    """The median replay (us) of the task captured alone, as the profiling pass captures
    it (``profile._replayed_us``), or (None, the capture's error)."""
    dev = torch.device("cuda")
    try:
        times, _ = profiling._replayed_us(executable, ctx, dev, repeats, profiling._Timing())
        return statistics.median(times), None
    except Exception as error:  # noqa: BLE001 - what the capture refuses is the answer
        profiling._after_failed_capture(dev)
        return None, f"{type(error).__name__}: {error}"[:600]


def top_kernels(launch) -> list[tuple[str, float]]:
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        launch()
        torch.cuda.synchronize()
    totals: dict[str, float] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            totals[event.name] = totals.get(event.name, 0.0) + event.device_time_total
    ranked = sorted(totals.items(), key=lambda item: -item[1])[:TOP_KERNELS]
    return [(name[:120], round(us, 1)) for name, us in ranked]


def main(argv: list[str] | None = None) -> int:
    args = parser().parse_args(argv)
    if not (args.cpu or torch.cuda.is_available()):
        print("task_capture: needs a CUDA device (--cpu: a smoke run)", file=sys.stderr)
        return 2
    cuda = not args.cpu
    family = load_family(args.family or default_family(args.preset))
    wanted = [part for part in args.memory.split(",") if part]
    train = TrainConfig(
        seq_len=args.seq_len,
        batch=args.batch,
        dtype=POLICY,
        chunk_tokens=args.chunk,
        vocab_pieces=args.vocab_pieces,
        head_vocab_tiles=args.head_vocab_tiles,
    )
    overrides = {"expert_shards": args.expert_shards} if args.expert_shards else {}
    step = lower(family, args.preset, train, overrides=overrides)
    resolver = resolvers().get(args.resolver).build(step)
    dev, generator = torch.device("cuda" if cuda else "cpu"), torch.Generator().manual_seed(0)
    int_high = profiling.vocabulary_high(step)
    made: dict = {}

    def decided(obj_id: str) -> torch.Tensor:
        return profiling._decided(step, obj_id, resolver, dev, generator, int_high, made)

    counts: dict[tuple, int] = {}
    first: dict[tuple, object] = {}
    for task in step.program.tasks:
        key = profiling.signature(step, task)
        counts[key] = counts.get(key, 0) + 1
        first.setdefault(key, task)
    records = []
    for key, task in first.items():
        executable, ctx = profiling._prepared(
            step.program, step.layout, task, resolver, dev, generator, int_high, decided
        )

        def launch(executable=executable, ctx=ctx) -> None:
            executable.launch(ctx)

        launch()  # warm-up: compilation, library handles
        host = statistics.median(host_us(launch, args.repeats, cuda))
        device = event_us(launch, args.repeats) if cuda else host
        replayed, error = captured_us(executable, ctx, args.repeats) if cuda else (None, "cpu")
        record = {
            "task": task.id,
            "compute_key": task.compute_key,
            "count": counts[key],
            "dispatched_us": round(device, 1),
            "host_issue_us": round(host, 1),
            "replayed_us": None if replayed is None else round(replayed, 1),
            "capture_error": error,
            "top_kernels": top_kernels(launch) if cuda else [],
        }
        if cuda and any(part in task.compute_key for part in wanted):
            peak = call_peak(launch, keep=lambda name: "dataflow" in name or "fla" in name)
            record["peak"] = peak.lines(top=16)
            print("\n".join(peak.lines(top=16)), flush=True)
        records.append(record)
        print(json.dumps({k: v for k, v in record.items() if k != "top_kernels"}), flush=True)
        del executable, ctx
        if cuda:
            torch.cuda.empty_cache()
    meta = {
        "device": torch.cuda.get_device_name() if cuda else "cpu",
        "torch": torch.__version__,
        "argv": sys.argv[1:] if argv is None else argv,
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"meta": meta, "signatures": records}, indent=1))
    step_time = sorted(
        records, key=lambda r: -(r["replayed_us"] or r["dispatched_us"]) * r["count"]
    )
    print(f"{'task':32} {'count':>5} {'dispatched':>11} {'host':>9} {'replayed':>9}  s a round")
    for r in step_time:
        each = r["replayed_us"] or r["dispatched_us"]
        replay = "refused" if r["replayed_us"] is None else f"{r['replayed_us']:9.0f}"
        print(
            f"{r['task'][:32]:32} {r['count']:5d} {r['dispatched_us']:11.0f} "
            f"{r['host_issue_us']:9.0f} {replay:>9}  {each * r['count'] / 1e6:.3f}"
        )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
