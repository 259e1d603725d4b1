"""The torch engine runs collective tasks on their own lane (a worker thread on the CPU,
a CUDA stream on a GPU): the all-reduce of a layer's gradient overlaps the backward of
the layer below, and what reads the gradient waits for it. The program is the hand-worked
backward of ``tests/sim/test_collective.py`` in milliseconds, run by the ``synthetic``
resolver (each task holds its lane for its priced time)."""

from __future__ import annotations

import sys
from pathlib import Path

import attrs
import pytest
import torch

from dataflow.engine import Engine
from dataflow.plugins import resolvers
from dataflow.schema import Link
from dataflow.sim import simulate

sys.path.insert(0, str(Path(__file__).parents[1] / "sim"))
from test_collective import backward  # noqa: E402

#: 100 bytes at 0.002 bytes/us plus 10 ms: each all-reduce takes 60 ms; bwd1 40 ms,
#: bwd0 20 ms, opt 12 ms
LINK = Link(bw_bytes_per_us=0.002, latency_us=10_000.0)


def program():
    base = backward()
    scaled = tuple(attrs.evolve(t, cost_us=t.cost_us * 4000) for t in base.tasks)
    return attrs.evolve(base, tasks=scaled, links=attrs.evolve(base.links, collective=LINK))


def run_on(device: str):
    planned = program()
    values = {
        obj.id: torch.zeros(obj.size_bytes, dtype=torch.uint8)
        for obj in planned.objects
        if planned.exists_at_start(obj.id)
    }
    with Engine("torch", device=device) as engine:
        engine.load(planned, resolvers().get("synthetic").build(planned), initial=values)
        trace = engine.run().steps[-1]
    return {t.task: (t.start_us, t.end_us) for t in trace.tasks}, simulate(planned)


def check(spans, predicted, low: float = 0.99) -> None:
    # the order of the execution model: ar1 after bwd1, bwd0 beside ar1, ar0 after ar1
    # (one link), opt after ar0 (it reads dW0)
    assert spans["ar1"][0] >= spans["bwd1"][1]
    assert spans["bwd0"][0] < spans["ar1"][1], "bwd0 did not overlap the all-reduce above it"
    assert spans["ar0"][0] >= spans["ar1"][1]
    assert spans["opt"][0] >= spans["ar0"][1]
    assert spans["ar1"][1] - spans["ar1"][0] >= 0.9 * 60_000
    # predicted: bwd1 40 ms, ar1 and ar0 60 ms each on the link, opt 12 ms: 172 ms. The
    # measured step is at least that, and at most its critical chain as it ran (each
    # task's own span: on a busy CI host a task spins late or long) plus the launch and
    # polling gaps between them (stated bound: 10 % and 10 ms a hand-off). A bound on
    # 172 ms itself failed under a load of 12 on 2 cores (326 ms)
    assert predicted.makespan_us == 172_000.0
    measured = max(end for _, end in spans.values()) - min(s for s, _ in spans.values())
    chain = sum(spans[t][1] - spans[t][0] for t in ("bwd1", "ar1", "ar0", "opt"))
    assert predicted.makespan_us * low <= measured <= chain * 1.1 + 3 * 10_000


def test_the_cpu_runner_overlaps_collectives_with_compute() -> None:
    check(*run_on("cpu"))


@pytest.mark.gpu
def test_the_cuda_runner_runs_collectives_on_their_own_stream() -> None:
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    # the synthetic kernels spin for a cycle count calibrated at one clock: on the H200
    # the step measured 164.9 ms of the predicted 172 (0.959) as the clock boosted, so
    # the lower bound is 10 % here (the order checks are what this test is about)
    check(*run_on("cuda"), low=0.9)
