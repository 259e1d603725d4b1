"""Engine overhead on CUDA: host dispatch per task, transfer bandwidth, and fidelity.

    python -m benchmarks.engine_overhead --out benchmarks/results/engine_overhead.json

Three measurements, all in one run on one GPU:

1. **Dispatch**: a chain of tiny tasks (each a fixed-length sleep kernel, no transfers).
   The gap on the GPU between one task's end and the next one's start is time the host
   made the device wait: the dispatcher noticing the completion, deciding, launching.
   Reported as p50/p99 over all gaps, and the host time spent inside each launch; once as
   the engine runs by default (``dispatch``: a task launched behind the running one, the
   engine's ``run_ahead``) and once launching each task after the host saw the one before
   end (``dispatch_after_end``); and again with tasks of 400 us whose launch costs the
   host 200 us, as a compiled block's does (``slow_launch``, ``slow_launch_after_end``).
2. **Bandwidth**: raw pinned-host <-> device copies on side streams (the ceiling), then
   the engine moving the same objects by prefetch only, offload only, and both at once.
3. **Fidelity**: a weight-streaming chain (weights prefetched layer by layer, outputs
   written back) planned by PressureFit with links measured in step 2 and task costs
   from the calibrated sleep kernel, simulated, then run: measured / simulated makespan.

Task executables here are sleep kernels of exactly ``cost_us``, so the prediction is not
confounded by cost estimates: what differs is the engine.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

from dataflow.engine import DictResolver, Engine
from dataflow.planning import place, plan
from dataflow.schema import Link, Links, Obj, Program, Task

MiB = 2**20
#: trials of each raw copy; the fastest is the ceiling (one trial of both directions at
#: once once came out 10% under the engine's own figure: the streams did not overlap fully)
TRIALS = 5
#: measured steps of each engine copy program; the median is reported
COPY_STEPS = 5


def percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def calibrate_sleep_cycles_per_us() -> float:
    """Clock cycles per microsecond of torch.cuda._sleep, measured with events."""
    torch.cuda._sleep(1_000_000)  # warm-up
    rates = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        torch.cuda._sleep(20_000_000)
        end.record()
        end.synchronize()
        rates.append(20_000_000 / (start.elapsed_time(end) * 1e3))
    return statistics.median(rates)


class Sleep:
    """A sleep kernel of ``cycles``, launched after ``host_us`` of host work (a busy wait:
    what a compiled block's guards and launches cost the host, 0.1-1 ms)."""

    def __init__(self, cycles: int, host_us: float = 0.0) -> None:
        self.cycles, self.host_us = cycles, host_us

    def launch(self, ctx) -> None:
        if self.host_us:
            until = time.perf_counter() + self.host_us / 1e6
            while time.perf_counter() < until:
                pass
        if self.cycles:
            torch.cuda._sleep(self.cycles)


def sleep_resolver(cycles_per_us: float, host_us: float = 0.0) -> DictResolver:
    return DictResolver(
        "sleep", {"sleep": lambda task: Sleep(int(task.cost_us * cycles_per_us), host_us)}
    )


def zeros_for(program: Program) -> dict[str, torch.Tensor]:
    return {
        obj.id: torch.zeros(obj.size_bytes, dtype=torch.uint8)
        for obj in program.objects
        if program.exists_at_start(obj.id)
    }


# -- 1. dispatch -----------------------------------------------------------------------
def measure_dispatch(
    cycles_per_us: float,
    tasks: int,
    task_us: float,
    steps: int,
    *,
    run_ahead: bool = True,
    host_us: float = 0.0,
) -> dict:
    program = Program(
        name="dispatch",
        objects=(Obj("x", 4096, "data", "fast"),),
        tasks=tuple(
            Task(f"t{i}", "sleep", "sleep", mutates=("x",), cost_us=task_us) for i in range(tasks)
        ),
    )
    with Engine("torch", device="cuda", run_ahead=run_ahead) as engine:
        engine.load(program, sleep_resolver(cycles_per_us, host_us), initial=zeros_for(program))
        result = engine.run(steps=steps)
    launch_us = [us for step in result.launch_host_us[1:] for us in step]
    gaps = [gap for step in range(1, steps) for gap in result.task_gaps_us(step)]
    return {
        "tasks": tasks,
        "task_us": task_us,
        "host_us": host_us,
        "launched_ahead": result.steps[-1].launched_ahead,
        "steps_measured": steps - 1,
        "gap_us_p50": percentile(gaps, 0.5),
        "gap_us_p99": percentile(gaps, 0.99),
        "launch_host_us_p50": percentile(launch_us, 0.5),
        "launch_host_us_p99": percentile(launch_us, 0.99),
        "step_us_median": result.makespan_us,
        "per_task_us": result.makespan_us / tasks,
    }


# -- 2. bandwidth ----------------------------------------------------------------------
def raw_copy_gbps(size_bytes: int, repeats: int) -> dict:
    host_in = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    device_in = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    device_out = torch.empty(size_bytes, dtype=torch.uint8, device="cuda")
    h2d, d2h = torch.cuda.Stream(), torch.cuda.Stream()

    def timed(pairs) -> float:
        events = []
        for stream, dst, src in pairs:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            with torch.cuda.stream(stream):
                start.record(stream)
                for _ in range(repeats):
                    dst.copy_(src, non_blocking=True)
                end.record(stream)
            events.append((start, end))
        torch.cuda.synchronize()
        return max(start.elapsed_time(end) for start, end in events) / 1e3

    timed([(h2d, device_in, host_in)])  # warm-up
    moved = size_bytes * repeats

    def best(pairs) -> float:  # the ceiling: the fastest of a few trials
        return min(timed(pairs) for _ in range(TRIALS))

    alone_h2d = moved / best([(h2d, device_in, host_in)])
    alone_d2h = moved / best([(d2h, host_out, device_out)])
    both = 2 * moved / best([(h2d, device_in, host_in), (d2h, host_out, device_out)])
    return {"h2d_GBps": alone_h2d / 1e9, "d2h_GBps": alone_d2h / 1e9, "both_GBps": both / 1e9}


def link_gbps(trace, direction: str) -> float:
    spans = [t for t in trace.transfers if t.direction == direction]
    busy_s = (max(t.end_us for t in spans) - min(t.start_us for t in spans)) / 1e6
    return sum(t.size_bytes for t in spans) / busy_s / 1e9


def engine_copy_gbps(cycles_per_us: float, count: int, size_bytes: int) -> dict:
    def program(mode: str) -> Program:
        ins = [Obj(f"in{i}", size_bytes, "param", "slow") for i in range(count)]
        outs = [Obj(f"out{i}", size_bytes, "activation", "fast") for i in range(count)]
        objects = [Obj("x", 4096, "data", "fast")]
        prefetch = tuple(o.id for o in ins) if mode in ("h2d", "both") else ()
        offload = tuple(o.id for o in outs) if mode in ("d2h", "both") else ()
        objects += (ins if prefetch else []) + (outs if offload else [])
        first = Task(
            "start",
            "sleep",
            "sleep",
            mutates=("x",),
            cost_us=1.0,
            prefetches=prefetch,
            offloads=offload,
        )
        last = Task("end", "sleep", "sleep", inputs=prefetch, mutates=("x",), cost_us=1.0)
        return Program(name=f"copy-{mode}", objects=tuple(objects), tasks=(first, last))

    measured = {}
    for mode in ("h2d", "d2h", "both"):
        prog = program(mode)
        with Engine("torch", device="cuda") as engine:
            engine.load(prog, sleep_resolver(cycles_per_us), initial=zeros_for(prog))
            traces = engine.run(steps=1 + COPY_STEPS).steps[1:]  # the first step warms up
        rates = []
        for trace in traces:
            if mode == "both":
                start = min(t.start_us for t in trace.transfers)
                end = max(t.end_us for t in trace.transfers)
                total = sum(t.size_bytes for t in trace.transfers)
                rates.append(total / ((end - start) / 1e6) / 1e9)
            else:
                rates.append(link_gbps(trace, mode))
        measured[f"{mode}_GBps"] = statistics.median(rates)
        measured[f"{mode}_GBps_steps"] = rates
    return measured


def measure_latency_us() -> dict[str, float]:
    """Per-transfer fixed cost: a 4 KiB copy each way, median of 50, with events."""
    host = torch.empty(4096, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(4096, dtype=torch.uint8, device="cuda")
    out = {}
    for name, dst, src in (("h2d", dev, host), ("d2h", host, dev)):
        times = []
        for _ in range(50):
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            start.record()
            dst.copy_(src, non_blocking=True)
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) * 1e3)
        out[name] = statistics.median(times)
    return out


# -- 3. fidelity -----------------------------------------------------------------------
def measure_fidelity(
    trace_path: Path | None,
    cycles_per_us: float,
    links: Links,
    layers: int,
    weight_bytes: int,
    budget_weights: int,
    steps: int,
) -> dict:
    transfer_us = links.h2d.transfer_us(weight_bytes)
    act = 16 * MiB
    objects = [Obj("x", act, "data", "fast")]
    tasks = []
    for i in range(layers):
        objects.append(Obj(f"W_{i}", weight_bytes, "param", "fast" if i == 0 else "slow"))
        objects.append(Obj(f"y_{i}", act, "activation"))
        tasks.append(
            Task(
                f"layer_{i}",
                "sleep",
                "sleep",
                inputs=("x" if i == 0 else f"y_{i - 1}", f"W_{i}"),
                outputs=(f"y_{i}",),
                cost_us=round(1.2 * transfer_us, 1),
            )
        )
    program = Program(
        name="weight-streaming",
        objects=tuple(objects),
        tasks=tuple(tasks),
        final_locations={f"y_{i}": "slow" for i in range(layers - 1)},
        links=links,
    )
    budget = budget_weights * weight_bytes + 4 * act
    planned = plan(program, budget)
    placement = place(planned)
    with Engine("torch", budget_bytes=budget, device="cuda") as engine:
        engine.load(placement, sleep_resolver(cycles_per_us), initial=zeros_for(planned.program))
        result = engine.run(steps=steps, feed=lambda step: zeros_for(planned.program))
    if trace_path is not None:
        result.to_chrome_trace(trace_path)  # predicted beside the last measured step
    ratios = [trace.makespan_us / planned.sim.makespan_us for trace in result.steps[1:]]
    return {
        "layers": layers,
        "weight_MiB": weight_bytes / MiB,
        "budget_MiB": budget / MiB,
        "task_us": tasks[0].cost_us,
        "simulated_us": planned.sim.makespan_us,
        "lower_bound_us": planned.lower_bound_us,
        "measured_us_median": statistics.median(t.makespan_us for t in result.steps[1:]),
        "measured_over_simulated_median": statistics.median(ratios),
        "measured_over_simulated_max": max(ratios),
        "allocator_peak_MiB": result.allocator_peak_bytes / MiB,
        "bytes_moved_MiB": (planned.sim.h2d.bytes + planned.sim.d2h.bytes) / MiB,
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, default=Path("benchmarks/results/engine_overhead.json"))
    parser.add_argument("--quick", action="store_true", help="smaller sizes, for a smoke run")
    parser.add_argument(
        "--trace",
        type=Path,
        default=None,
        help="write the fidelity run's predicted and measured trace here",
    )
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("engine_overhead needs a CUDA device", file=sys.stderr)
        return 2
    torch.cuda.init()
    cycles = calibrate_sleep_cycles_per_us()
    quick = args.quick
    copy_bytes = (64 if quick else 256) * MiB
    raw = raw_copy_gbps(copy_bytes, repeats=4 if quick else 8)
    latency = measure_latency_us()
    engine_bw = engine_copy_gbps(cycles, count=4 if quick else 8, size_bytes=copy_bytes)
    links = Links(
        h2d=Link(raw["h2d_GBps"] * 1e3, latency["h2d"]),
        d2h=Link(raw["d2h_GBps"] * 1e3, latency["d2h"]),
    )
    results = {
        "device": torch.cuda.get_device_name(),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "sleep_cycles_per_us": cycles,
        "dispatch": measure_dispatch(cycles, tasks=200 if quick else 2000, task_us=20.0, steps=3),
        "dispatch_after_end": measure_dispatch(
            cycles, tasks=200 if quick else 2000, task_us=20.0, steps=3, run_ahead=False
        ),
        # tasks whose launch costs the host 200 us (a compiled block's), each 400 us long
        "slow_launch": measure_dispatch(cycles, tasks=200, task_us=400.0, steps=3, host_us=200.0),
        "slow_launch_after_end": measure_dispatch(
            cycles, tasks=200, task_us=400.0, steps=3, run_ahead=False, host_us=200.0
        ),
        "raw_copy": raw,
        "latency_us": latency,
        "engine_copy": engine_bw,
        "engine_over_raw": {k: engine_bw[k] / raw[k] for k in raw},
    }
    print(json.dumps(results, indent=1), flush=True)
    results["fidelity"] = measure_fidelity(
        args.trace,
        cycles,
        links,
        layers=8 if quick else 24,
        weight_bytes=(64 if quick else 256) * MiB,
        budget_weights=4,
        steps=4,
    )
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(results, indent=1))
    f = results["fidelity"]
    for key in ("dispatch", "dispatch_after_end", "slow_launch", "slow_launch_after_end"):
        d = results[key]
        print(
            f"{key}: gap p50 {d['gap_us_p50']:.1f} us, p99 {d['gap_us_p99']:.1f} us; "
            f"launch p50 {d['launch_host_us_p50']:.1f} us; launched ahead {d['launched_ahead']}"
        )
    for key, ratio in results["engine_over_raw"].items():
        print(f"{key}: engine {engine_bw[key]:.1f} GB/s vs raw {raw[key]:.1f} GB/s ({ratio:.1%})")
    print(
        f"fidelity: measured/simulated median {f['measured_over_simulated_median']:.3f}, "
        f"max {f['measured_over_simulated_max']:.3f}"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
