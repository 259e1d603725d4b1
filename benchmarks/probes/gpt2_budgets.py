"""Probe, 2026-11-29 to 2026-12-01: does gpt2_124m train inside 16, 4 and 2 GiB, and how fast?

Answer: inside every budget, at 1.48x, 1.54x and 2.68x stock eager's step
(results/gpt2_budgets.md, before steady-state plans and graph replay). Superseded by
compare.py's dataflow rows (docs/throughput.md), which measure the same against
torch.compile.

GPT-2 training steps on CUDA inside fast-memory budgets, beside stock PyTorch.

    python -m benchmarks.probes.gpt2_budgets --preset gpt2_124m --budgets 16GiB,4GiB,2GiB \
        --out benchmarks/results/gpt2_budgets.json

Lower one training step (bf16 weights, gradients and activations, fp32 AdamW states) and
price it with the profiling pass (each distinct task timed once on this GPU, its
temporaries measured as workspace). For each budget: plan it with PressureFit at the
budget less the CUDA libraries' own reserve, place it with the largest workspace left
free beside the arena, run it on the engine for a few steps and record the step time, the
allocator's own peak (which the engine checks against the budget), the ledger peak and
the bytes moved. In the same run, stock PyTorch (``benchmarks/harness/stock.py``: bf16 autocast
over float32 weights, SDPA, ``torch.optim.AdamW(fused=True)``) trains the same shape: its
step time and peak memory are the baseline. Medians over the measured steps; the first
step warms up.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path

import attrs
import torch
from dataflow_training.drive.values import start_values
from dataflow_training.plan.profile import apply_profile, profile_program
from dataflow_training.step.config import DtypePolicy, OptimizerPolicy, TrainConfig
from dataflow_training.step.lowering import lower

from benchmarks.harness.stock import time_stock
from dataflow.engine import Engine
from dataflow.engine.backends.torch_cuda import measure_links, runtime_reserve_bytes
from dataflow.planning import place, plan
from dataflow.plugins import families, resolvers
from dataflow.units import format_size, parse_size

GiB = 2**30


def feed(lowered, state, vocab, batch, seq_len, step, data_only=False):
    def data(step_, round_):
        g = torch.Generator().manual_seed(1000 * step_ + round_)
        return (
            torch.randint(0, vocab, (batch, seq_len), generator=g),
            torch.randint(0, vocab, (batch, seq_len), generator=g),
        )

    return start_values(lowered, state, data, step=step, data_only=data_only)


def priced_program(family, preset, train, resolver: str, *, graph: bool):
    """The lowered step with every task's cost and workspace measured on this device (as
    replayed from a CUDA graph with ``graph``, else as dispatched)."""
    step = lower(family, preset, train)
    profiles = profile_program(
        step, resolvers().get(resolver).build(step), device="cuda", graph=graph
    )
    priced = attrs.evolve(apply_profile(step, profiles), links=measure_links("cuda"))
    return step.with_program(priced)


def run_engine(
    lowered, train, budget, steps, state, vocab, resolver: str, *, graph: bool, cyclic: bool
) -> dict:
    reserve = runtime_reserve_bytes("cuda")
    program = lowered.program
    began = time.perf_counter()
    planned = plan(program, budget - reserve, cyclic=cyclic)
    # The family's kernels take their temporaries from the allocator: leave the largest
    # task workspace (measured by the profiling pass) free beside the arena.
    placement = place(planned, workspace_in_arena=False)
    planning_s = time.perf_counter() - began
    with Engine("torch", budget_bytes=budget, device="cuda", graph=graph) as engine:
        engine.load(
            placement,
            resolvers().get(resolver).build(lowered.with_program(planned.program)),
            initial=feed(lowered, state, vocab, train.batch, train.seq_len, 0),
        )
        result = engine.run(
            steps=steps,
            feed=lambda step: feed(
                lowered, state, vocab, train.batch, train.seq_len, step, data_only=True
            ),
        )
        losses = [engine.fetch(f"loss_0_{r}").item() for r in range(train.rounds)]
        note = engine.graph_note
        activity = engine.replay_activity() if engine.graph_note is None and graph else None
    step_us = [trace.makespan_us for trace in result.steps[2 if graph else 1 :]]
    return {
        "budget_bytes": budget,
        "graph": graph,
        "cyclic": cyclic,
        "graph_note": note,
        "replayed_steps": sum(trace.replayed for trace in result.steps),
        "activity": activity,
        "compute_idle_pct": None
        if not activity
        else 100 * (1 - activity["compute_busy_us"] / activity["span_us"]),
        "links": {d: attrs.asdict(getattr(program.links, d)) for d in ("h2d", "d2h")},
        "runtime_reserve_bytes": reserve,
        "planned_at_bytes": planned.budget_bytes,
        "arena_bytes": placement.arena_bytes,
        "workspace_beside_arena_bytes": placement.workspace_outside_bytes,
        "planning_s": planning_s,
        "predicted_step_ms": planned.sim.makespan_us / 1e3,
        "lower_bound_ms": planned.lower_bound_us / 1e3,
        "step_ms_median": statistics.median(step_us) / 1e3,
        "allocator_peak_bytes": result.allocator_peak_bytes,
        "ledger_peak_bytes": result.fast_peak_bytes,
        "moved_bytes_per_step": planned.sim.h2d.bytes + planned.sim.d2h.bytes,
        "last_losses": losses,
    }


def run_stock(config, train, steps) -> dict:
    """Stock PyTorch at the same shape (benchmarks/harness/stock.py: bf16 autocast, SDPA, fused
    AdamW); one round per step."""
    stock = time_stock(config, train.batch, train.seq_len, steps=steps)
    return {"step_ms_median": stock["step_ms"], "peak_bytes": stock["peak_bytes"]}


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="gpt2_124m")
    parser.add_argument("--budgets", default="16GiB,4GiB,2GiB")
    parser.add_argument("--seq-len", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--steps", type=int, default=3)
    parser.add_argument("--resolver", default="torch", help="torch or torch-compiled")
    parser.add_argument("--graph", choices=("on", "off", "both"), default="both")
    parser.add_argument(
        "--once", action="store_true", help="plan one step alone, not the steady-state cycle"
    )
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/gpt2_budgets.json"))
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("gpt2_budgets needs a CUDA device", file=sys.stderr)
        return 2
    family = families().get("gpt2").load()
    config = family.config(args.preset)
    torch.manual_seed(0)
    state = {
        k: v.to(torch.bfloat16) for k, v in family.reference_model(config).state_dict().items()
    }
    train = TrainConfig(
        seq_len=args.seq_len,
        batch=args.batch,
        rounds=args.rounds,
        dtype=DtypePolicy.named("bf16"),
        optimizer=OptimizerPolicy(),
        chunk_tokens=2048,
    )
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "preset": args.preset,
        "seq_len": args.seq_len,
        "batch": args.batch,
        "rounds": args.rounds,
        "steps": args.steps,
        "resolver": args.resolver,
        "stock": run_stock(config, train, max(args.steps, 5)),
        "engine": [],
    }
    print(json.dumps(results["stock"]), flush=True)
    graphs = {"on": (True,), "off": (False,), "both": (False, True)}[args.graph]
    programs = {
        g: priced_program(family, args.preset, train, args.resolver, graph=g) for g in graphs
    }
    results["measured_task_ms"] = {
        str(g): sum(task.cost_us for task in p.tasks) / 1e3 for g, p in programs.items()
    }
    results["largest_workspace_bytes"] = max(
        task.workspace_bytes for p in programs.values() for task in p.tasks
    )
    for text in args.budgets.split(","):
        for graph in graphs:
            program = programs[graph]
            try:
                row = run_engine(
                    program,
                    train,
                    parse_size(text),
                    args.steps,
                    state,
                    config.vocab_size,
                    args.resolver,
                    graph=graph,
                    cyclic=not args.once,
                )
            except Exception as exc:  # a budget that fails is a result too: say why
                row = {
                    "budget_bytes": parse_size(text),
                    "graph": graph,
                    "error": f"{type(exc).__name__}: {exc}",
                }
            results["engine"].append(row)
            print(json.dumps(row), flush=True)
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    stock = results["stock"]
    print(
        f"stock PyTorch: {stock['step_ms_median']:.1f} ms/step, peak {format_size(stock['peak_bytes'])}"
    )
    for row in results["engine"]:
        if "error" in row:
            print(f"{format_size(row['budget_bytes'])}: {row['error']}")
            continue
        print(
            f"{format_size(row['budget_bytes'])} graph={row['graph']}: "
            f"{row['step_ms_median']:.1f} ms/step "
            f"(x{row['step_ms_median'] / stock['step_ms_median']:.2f} stock; predicted "
            f"{row['predicted_step_ms']:.1f}), allocator peak "
            f"{format_size(row['allocator_peak_bytes'])}, moved "
            f"{format_size(row['moved_bytes_per_step'])}/step"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
