"""The ``synthetic`` resolver: runs any program by its declared task costs, no real math.

Each task fills every output with a byte of its own (its index in the chain) and then
holds the compute resource for its ``cost_us``: on the CPU by waiting on the host clock,
on CUDA with ``torch.cuda._sleep`` for the cycles that take that long (the rate measured
once, when the resolver is built). A collective task holds its stream (the collective
link's) for the time the link prices its all-reduce at (``Program.duration_us``), standing
in for the collective. Memory, transfers, streams and the dispatcher are the
engine's own, so a synthetic chain such as ``examples/programs/training_step.json`` runs
for real and ``dataflow trace`` can put its measured timeline beside the prediction.
"""

from __future__ import annotations

import time

import torch

from dataflow.engine.contract import LaunchContext
from dataflow.schema import Program, Task

#: Below this many microseconds of waiting left, spin on the clock instead of sleeping.
SPIN_US = 300.0


class SyntheticTask:
    """One task: write its outputs, then take ``cost_us`` of compute time. On CUDA it only
    enqueues a fill and a sleep: capturable into a CUDA graph."""

    capturable = True

    def __init__(self, fill: int, cost_us: float, cycles_per_us: float | None) -> None:
        self.fill, self.cost_us, self.cycles_per_us = fill, cost_us, cycles_per_us

    def launch(self, ctx: LaunchContext) -> None:
        if ctx.stream is not None:  # CUDA: enqueue on the task's stream
            with torch.cuda.stream(ctx.stream):
                for out in ctx.outputs:
                    out.fill_(self.fill)
                cycles = int(self.cost_us * (self.cycles_per_us or 0.0))
                if cycles > 0:
                    torch.cuda._sleep(cycles)
            return
        deadline = time.perf_counter() + self.cost_us * 1e-6
        for out in ctx.outputs:
            out.fill_(self.fill)
        _wait_until(deadline)


def _wait_until(deadline: float) -> None:
    left_us = (deadline - time.perf_counter()) * 1e6
    if left_us > 2 * SPIN_US:
        time.sleep((left_us - SPIN_US) * 1e-6)
    while time.perf_counter() < deadline:
        pass


def cuda_cycles_per_us() -> float:
    """``torch.cuda._sleep`` cycles per microsecond on the current CUDA device."""
    cycles = 2_000_000
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda._sleep(cycles // 10)  # warm up
    start.record()
    torch.cuda._sleep(cycles)
    end.record()
    end.synchronize()
    return cycles / (start.elapsed_time(end) * 1e3)


def build(program: Program) -> SyntheticResolver:
    """The resolver for ``program``: every compute key is accepted."""
    return SyntheticResolver(program)


class SyntheticResolver:
    def __init__(self, program: Program) -> None:
        self.program = program
        self.index = {task.id: i for i, task in enumerate(program.tasks)}
        self.cycles_per_us = cuda_cycles_per_us() if torch.cuda.is_available() else None

    def __call__(self, task: Task) -> SyntheticTask:
        fill = 1 + self.index.get(task.id, 0) % 255
        cost_us = self.program.duration_us(task)
        return SyntheticTask(fill, cost_us, self.cycles_per_us)
