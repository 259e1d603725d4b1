"""Probe, 2026-12-01 (session 6): what does sharing the host link between directions cost a step?

Answer: the duplex limit adds 2.2 % to llama3_8b's 16 GiB step and 0.4 % to l3_1b's at
4 GiB (results/duplex_check.jsonl; docs/throughput.md, "The duplex link model").

Predicted s/step of a measured dataflow row with and without the duplex link model.

Rebuilds a llama3-family training step (seq 4096, bf16 weights, gradients and AdamW
state, the recompute planner, a cyclic plan) with the task costs and workspace the H200
measured (``--profiles``, a profile cache or an archive of one, matched by signature;
see ``place_llama3_8b.py``), and plans it three ways on the CPU, with the ``h200``
hardware entry's links:

- ``solo``: each direction always at its own rate (no duplex limit: the model before);
- ``solo plan, duplex priced``: that plan's steady-state step re-simulated with the
  duplex limit (what the same directives cost when both directions share the link);
- ``duplex``: planned and priced with the limit (what ``plan`` returns now);
- ``both_at_once``: each direction always at its shared rate, no limit (the links
  ``measure_links`` measured for a CUDA ``TrainingRun`` before it measured the duplex
  total: both directions copying together), for comparison with the device runs'
  predictions;
- ``measured_links`` (with ``--measured-links H2D,D2H`` in GB/s): each direction always at
  the given rate, no limit, as a CUDA ``TrainingRun`` priced its plan with the links
  ``measure_links`` gave it before it measured the duplex total (the gpt2_124m 4 GiB
  export, ``results/export_gpt2_124m_4GiB/program.json``, holds 52.38 and 51.16).

Run: ``python -m benchmarks.probes.duplex_check --preset llama3_8b --budget 16GiB --batch 2
--rounds 16 --chunk 2048`` (the archive holds the 2048-token head only) or
``python -m benchmarks.probes.duplex_check --preset l3_1b --budget 4GiB --batch 4 --rounds 8
--profiles benchmarks/results/profiles_l3_1b.tgz [--order layer]``.
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import attrs
from dataflow_training.plan.hardware import hardware
from dataflow_training.plan.profile import apply_profile
from dataflow_training.plan.recompute import measured_rewriter, step_planner
from dataflow_training.step.config import head_chunk_tokens
from dataflow_training.step.family import load_family
from dataflow_training.step.lowering import lower

from benchmarks.harness.compare_dataflow import train_config
from benchmarks.place_llama3_8b import PROFILES, RESERVE_BYTES, Lookup, measured_profiles
from dataflow.planning import plan
from dataflow.planning.cycle import check_cycle
from dataflow.schema import Links
from dataflow.units import parse_size


def fixed_rates(links: Links, h2d_bytes_per_us: float, d2h_bytes_per_us: float) -> Links:
    """``links`` with each direction at the given rate whatever the other does."""
    return attrs.evolve(
        links,
        h2d=attrs.evolve(links.h2d, bw_bytes_per_us=h2d_bytes_per_us),
        d2h=attrs.evolve(links.d2h, bw_bytes_per_us=d2h_bytes_per_us),
        duplex_bytes_per_us=None,
    )


def both_busy_us(sim) -> float:
    """How long both directions were copying at once (each direction is one FIFO, so its
    transfers never overlap each other)."""
    spans = {
        d: sorted((t.start_us, t.end_us) for t in sim.transfers if t.direction == d)
        for d in ("h2d", "d2h")
    }
    total, i, j = 0.0, 0, 0
    h2d, d2h = spans["h2d"], spans["d2h"]
    while i < len(h2d) and j < len(d2h):
        total += max(0.0, min(h2d[i][1], d2h[j][1]) - max(h2d[i][0], d2h[j][0]))
        if h2d[i][1] < d2h[j][1]:
            i += 1
        else:
            j += 1
    return total


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--preset", default="llama3_8b")
    parser.add_argument("--budget", default="16GiB")
    parser.add_argument("--batch", type=int, default=2)
    parser.add_argument("--rounds", type=int, default=16)
    parser.add_argument("--chunk", type=int, help="head chunk tokens (default: the budget's)")
    parser.add_argument("--order", default="round", choices=("round", "layer"))
    parser.add_argument("--profiles", type=Path, default=PROFILES)
    parser.add_argument("--measured-links", help="H2D,D2H in GB/s: add that variant")
    parser.add_argument("--json", type=Path, help="append the row to this JSON-lines file")
    args = parser.parse_args()
    budget = parse_size(args.budget)
    measured = Lookup(measured_profiles(args.profiles))

    family = load_family("llama3")
    chunk = args.chunk or head_chunk_tokens(budget, 128256)
    train = train_config("bf16", args.batch, args.rounds, 4096, chunk, args.order)
    step = lower(family, args.preset, train)
    duplex_links = hardware("h200").links()
    solo_links = attrs.evolve(duplex_links, duplex_bytes_per_us=None)
    row = {"preset": args.preset, "budget": args.budget, "batch": args.batch}
    row |= {"rounds": args.rounds, "chunk": chunk, "order": args.order}
    variants = [
        ("solo", solo_links),
        ("duplex", duplex_links),
        ("both_at_once", fixed_rates(solo_links, *duplex_links.shared_bw)),
    ]
    if args.measured_links:
        h2d_gbps, d2h_gbps = (float(rate) for rate in args.measured_links.split(","))
        variants.append(("measured_links", fixed_rates(solo_links, h2d_gbps * 1e3, d2h_gbps * 1e3)))
    for name, links in variants:
        priced = attrs.evolve(apply_profile(step, measured(step)), links=links)
        rewriter = measured_rewriter(step.with_program(priced), measured, known=measured(step))
        spec = step_planner(rewriter)
        started = time.perf_counter()
        planned = plan(
            priced, budget - RESERVE_BYTES - measured.largest_bytes, planner=spec, cyclic=True
        )
        row[f"{name}_step_s"] = planned.cycle.iteration_us / 1e6
        row[f"{name}_planning_s"] = time.perf_counter() - started
        row[f"{name}_moved_bytes"] = planned.moved_bytes
        row[f"{name}_compute_s"] = planned.sim.compute_busy_us / 1e6
        row[f"{name}_both_busy_pct"] = 100 * both_busy_us(planned.sim) / planned.makespan_us
        if name == "solo":
            shared = attrs.evolve(planned.program, links=duplex_links)
            again = check_cycle(shared, planned.budget_bytes, planned.slow_budget_bytes)
            row["solo_plan_duplex_priced_step_s"] = again.iteration_us / 1e6
        print(json.dumps(row), flush=True)
    if args.json is not None:
        with args.json.open("a") as out:
            out.write(json.dumps(row) + "\n")


if __name__ == "__main__":
    main()
