"""Set a profiled step's trace beside its simulated step and say where they part.

Reads the two files ``compare.py --trace-dir`` writes for a dataflow row
(``<stem>.trace.json.gz``: torch.profiler's trace of one replayed step;
``<stem>.sim.json.gz``: the placed plan's simulated tasks and transfers) and reports:

* per link direction: transfers, bytes and busy time, simulated and traced;
* drift: how far the traced start of the n-th transfer of a direction is behind its
  simulated start, at tenths of the step (a drift growing evenly means compute is slower
  than priced everywhere; one that jumps, a late transfer or a stall);
* per accumulation round (from one embedding gather to the next) and per forward task
  (from one block's first layer norm to the next block's): traced span against the
  simulated one, and the forward task's kernel busy time;
* gaps between consecutive device events on the compute streams, split by whether a
  memset sits next to them.

    python -m benchmarks.trace_vs_sim benchmarks/results/traces/gpt2_124m_1GiB_4x128 \
        --out benchmarks/results/trace_vs_sim_gpt2_1GiB.json

The task boundaries lean on GPT-2's kernels (an embedding gather starts each round, a
Triton layer norm each block's forward); pass ``--round-kernel`` and ``--block-kernel``
for another model.
"""

from __future__ import annotations

import argparse
import bisect
import gzip
import json
import statistics
import sys
from pathlib import Path


def load(stem: str) -> tuple[dict, list[dict]]:
    with gzip.open(f"{stem}.sim.json.gz", "rt") as f:
        sim = json.load(f)
    with gzip.open(f"{stem}.trace.json.gz", "rt") as f:
        events = json.load(f).get("traceEvents", [])
    device = [
        e
        for e in events
        if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memset", "gpu_memcpy")
    ]
    return sim, sorted(device, key=lambda e: e["ts"])


def links(sim: dict, events: list[dict]) -> dict:
    out = {}
    for way, tag in (("h2d", "HtoD"), ("d2h", "DtoH")):
        simulated = [t for t in sim["transfers"] if t[1] == way]
        traced = [e for e in events if e["cat"] == "gpu_memcpy" and tag in e["name"]]
        out[way] = {
            "sim_transfers": len(simulated),
            "trace_copies": len(traced),
            "sim_bytes": sum(t[2] for t in simulated),
            "trace_bytes": sum(int(e["args"].get("bytes", 0)) for e in traced),
            "sim_busy_ms": round(sum(t[5] - t[4] for t in simulated) / 1e3, 3),
            "trace_busy_ms": round(sum(e["dur"] for e in traced) / 1e3, 3),
        }
    return out


def drift(sim: dict, events: list[dict], start: float) -> dict:
    """Traced minus simulated start (ms) of transfers matched in order by size."""
    out = {}
    for way, tag in (("h2d", "HtoD"), ("d2h", "DtoH")):
        simulated = sorted((t for t in sim["transfers"] if t[1] == way), key=lambda t: t[4])
        traced = [e for e in events if e["cat"] == "gpu_memcpy" and tag in e["name"]]
        pairs, j = [], 0
        for t in simulated:
            while j < len(traced) and int(traced[j]["args"].get("bytes", -1)) != t[2]:
                j += 1
            if j == len(traced):
                break
            pairs.append((t[4], traced[j]["ts"] - start))
            j += 1
        tenths = [pairs[min(len(pairs) - 1, k * len(pairs) // 10)] for k in range(11)]
        out[way] = {
            "matched": len(pairs),
            "at_sim_ms": [round(s / 1e3, 1) for s, _ in tenths],
            "drift_ms": [round((t - s) / 1e3, 3) for s, t in tenths],
        }
    return out


def compute_stream(events: list[dict]) -> list[dict]:
    return [e for e in events if e["cat"] in ("kernel", "gpu_memset")]


def rounds_and_blocks(sim: dict, compute: list[dict], round_kernel: str, block_kernel: str):
    starts = {t[0]: t[1] for t in sim["tasks"]}
    ends = {t[0]: t[2] for t in sim["tasks"]}
    marks = [i for i, e in enumerate(compute) if round_kernel in e["name"]]
    trace_round, sim_round, trace_block, sim_block, block_busy = [], [], [], [], []
    for r in range(1, len(marks) - 1):
        a, b = marks[r], marks[r + 1]
        embed, following = f"embed_0_{r}_emb", f"embed_0_{r + 1}_emb"
        if embed not in starts or following not in starts:
            continue
        trace_round.append(compute[b]["ts"] - compute[a]["ts"])
        sim_round.append(starts[following] - starts[embed])
        blocks = [i for i in range(a, b) if compute[i]["name"] == block_kernel]
        for k in range(min(len(blocks) - 1, 11)):
            task, after = f"fwd_0_{r}_{k}", f"fwd_0_{r}_{k + 1}"
            if task not in starts or after not in starts:
                continue
            trace_block.append(compute[blocks[k + 1]]["ts"] - compute[blocks[k]]["ts"])
            sim_block.append(ends[task] - starts[task])
            block_busy.append(sum(e["dur"] for e in compute[blocks[k] : blocks[k + 1]]))

    def med(values: list[float]) -> float | None:
        return round(statistics.median(values), 1) if values else None

    return {
        "rounds_matched": len(trace_round),
        "round_trace_us": med(trace_round),
        "round_sim_us": med(sim_round),
        "fwd_tasks_matched": len(trace_block),
        "fwd_trace_span_us": med(trace_block),
        "fwd_trace_busy_us": med(block_busy),
        "fwd_sim_us": med(sim_block),
    }


def gaps(compute: list[dict]) -> dict:
    memset_ms = other_ms = 0.0
    for before, after in zip(compute, compute[1:], strict=False):
        gap = after["ts"] - before["ts"] - before["dur"]
        if gap <= 0:
            continue
        if "gpu_memset" in (before["cat"], after["cat"]):
            memset_ms += gap / 1e3
        else:
            other_ms += gap / 1e3
    return {
        "kernels": sum(e["cat"] == "kernel" for e in compute),
        "memsets": sum(e["cat"] == "gpu_memset" for e in compute),
        "kernel_busy_ms": round(sum(e["dur"] for e in compute if e["cat"] == "kernel") / 1e3, 1),
        "memset_busy_ms": round(
            sum(e["dur"] for e in compute if e["cat"] == "gpu_memset") / 1e3, 1
        ),
        "gaps_next_to_memsets_ms": round(memset_ms, 3),
        "other_gaps_ms": round(other_ms, 3),
    }


def _overlap_us(spans: list[tuple[float, float]], starts: list[float], begin, end) -> float:
    """How long the sorted ``spans`` cover of ``[begin, end)``."""
    i, covered = max(0, bisect.bisect_left(starts, begin) - 1), 0.0
    while i < len(spans) and spans[i][0] < end:
        covered += max(0.0, min(end, spans[i][1]) - max(begin, spans[i][0]))
        i += 1
    return covered


def copy_rates(events: list[dict], least_bytes: int = 1 << 20) -> dict:
    """Per direction, the median GB/s of copies of at least ``least_bytes``, by what ran
    beside each: ``duplex`` (the other direction copying through a tenth of it or more),
    else ``compute_busy`` (kernels through half of it or more) or ``compute_idle``.
    Copies beside kernels ran slower than a lone copy in the gpt2_124m 1 GiB step (what
    ``measure_links(beside=...)`` prices)."""

    def spans(keep) -> tuple[list[tuple[float, float]], list[float]]:
        found = sorted((e["ts"], e["ts"] + e["dur"]) for e in events if keep(e))
        return found, [a for a, _ in found]

    kernels = spans(lambda e: e["cat"] == "kernel")
    copies = {
        tag: spans(lambda e, tag=tag: e["cat"] == "gpu_memcpy" and tag in e["name"])
        for tag in ("HtoD", "DtoH")
    }
    out = {}
    for way, tag, other in (("h2d", "HtoD", "DtoH"), ("d2h", "DtoH", "HtoD")):
        split: dict[str, list[float]] = {"duplex": [], "compute_busy": [], "compute_idle": []}
        for e in events:
            size = int(e.get("args", {}).get("bytes", 0))
            if e["cat"] != "gpu_memcpy" or tag not in e["name"] or size < least_bytes:
                continue
            begin, end = e["ts"], e["ts"] + e["dur"]
            if _overlap_us(*copies[other], begin, end) >= 0.1 * e["dur"]:
                kind = "duplex"
            elif _overlap_us(*kernels, begin, end) >= 0.5 * e["dur"]:
                kind = "compute_busy"
            else:
                kind = "compute_idle"
            split[kind].append(size / e["dur"] / 1e3)
        out[way] = {
            kind: {"copies": len(rates), "median_gb_s": round(statistics.median(rates), 1)}
            for kind, rates in split.items()
            if rates
        }
    return out


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("stem", help="path without .sim.json.gz / .trace.json.gz")
    p.add_argument("--round-kernel", default="vectorized_gather_kernel")
    p.add_argument("--block-kernel", default="triton_per_fused_native_layer_norm_0")
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    sim, events = load(args.stem)
    if not events:
        sys.exit(f"trace_vs_sim.py: no device events in {args.stem}.trace.json.gz")
    start = events[0]["ts"]
    span = max(e["ts"] + e["dur"] for e in events) - start
    compute = compute_stream(events)
    sim_busy = sum(t[2] - t[1] for t in sim["tasks"])
    report = {
        "stem": Path(args.stem).name,
        "sim_makespan_ms": round(sim["makespan_us"] / 1e3, 1),
        "trace_span_ms": round(span / 1e3, 1),
        "sim_task_busy_ms": round(sim_busy / 1e3, 1),
        "links": links(sim, events),
        "drift": drift(sim, events, start),
        "tasks": rounds_and_blocks(sim, compute, args.round_kernel, args.block_kernel),
        "compute_gaps": gaps(compute),
        "copy_rates": copy_rates(events),
    }
    text = json.dumps(report, indent=1)
    print(text)
    if args.out:
        args.out.write_text(text + "\n")
    return report


if __name__ == "__main__":
    main()
