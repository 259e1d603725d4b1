"""Read-only persistent objects (``Program.read_only_ids``, ``backed_ids``): a persistent
object that no task mutates and that starts in fast memory keeps its start value in a slow
copy from the start once the program drops it, so dropping it is free and nothing writes
it back; the simulator, the virtual engine and the torch engine agree, and the planner
releases such an object where it would have written it back."""

from __future__ import annotations

import attrs
import pytest
import torch

from dataflow.engine import DictResolver, Engine
from dataflow.planning import check_cycle, plan
from dataflow.planning.api import plan_cyclic
from dataflow.planning.cyclic import fast_homes
from dataflow.schema import Obj, Program, Task, TensorMeta
from dataflow.sim import simulate
from dataflow.sim.failure import FailureKind

F32x4 = TensorMeta("float32", (4,))
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _streamed(drop: str = "releases", **fields) -> Program:
    """``w`` (persistent, starting fast) is read by ``t0``, dropped after it, fetched back
    by ``t1`` and read again by ``t2``, which adds it to ``y``."""
    base = Program(
        name="streamed",
        objects=(
            Obj("w", 16, "param", "fast", F32x4),
            Obj("x", 16, "data", "fast", F32x4),
            Obj("y", 16, "activation", tensor=F32x4),
        ),
        tasks=(
            Task("t0", "k", "copy", inputs=("w",), outputs=("y",), cost_us=10.0, **{drop: ("w",)}),
            Task("t1", "k", "double", mutates=("y",), cost_us=10.0, prefetches=("w",)),
            Task("t2", "k", "add", inputs=("w", "x"), mutates=("y",), cost_us=10.0),
        ),
        final_locations={"w": "fast", "y": "fast"},
        persistent=("w",),
    )
    return attrs.evolve(base, **fields)


def test_a_read_only_persistent_object_is_backed_once_dropped() -> None:
    program = _streamed()
    assert program.read_only_ids == {"w"} and program.backed_ids == {"w"}
    assert "w" in program.ever_slow_ids()
    # never dropped: read-only still, but it needs no slow copy
    kept = _streamed(tasks=tuple(t.without_directives() for t in program.tasks))
    assert kept.read_only_ids == {"w"} and kept.backed_ids == frozenset()
    # changed by a task, or not persistent: neither
    written = _streamed(
        tasks=(*program.tasks[:2], attrs.evolve(program.tasks[2], mutates=("y", "w")))
    )
    assert written.read_only_ids == frozenset() == written.backed_ids
    assert _streamed(persistent=()).backed_ids == frozenset()


def test_dropping_a_backed_object_is_free_and_it_comes_back_from_its_slow_copy() -> None:
    released = simulate(_streamed("releases"))
    assert released.valid, released.error
    assert released.d2h.bytes == 0 and released.h2d.bytes == 16
    assert released.slow_peak_bytes == 16  # its slow copy, from the start
    assert "w" in released.slow_current_at_end
    # an offload of it is a drop too: no write-back
    offloaded = simulate(_streamed("offloads"))
    assert offloaded.valid and offloaded.d2h.bytes == 0
    assert offloaded.makespan_us == released.makespan_us


def test_an_object_that_is_not_read_only_starts_dirty_as_before() -> None:
    # a fed (non-persistent) object that starts fast has no slow copy: released, it is
    # lost (nothing can fetch it back)
    lost = simulate(_streamed("releases", persistent=()))
    assert not lost.valid and lost.error.kind is FailureKind.PREFETCH_NO_SLOW_COPY
    # offloaded, it is written back first
    written = simulate(_streamed("offloads", persistent=()))
    assert written.valid and written.d2h.bytes == 16


class Op:
    def __init__(self, key: str) -> None:
        self.key = key

    def launch(self, ctx) -> None:
        if self.key == "copy":
            ctx.outputs[0].copy_(ctx.inputs[0])
        elif self.key == "double":
            ctx.mutates[0].mul_(2.0)
        else:
            ctx.mutates[0].add_(ctx.inputs[0] + ctx.inputs[1])


def _resolver() -> DictResolver:
    return DictResolver(
        "ops", {key: lambda task: Op(task.compute_key) for key in ("copy", "double", "add")}
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("drop", ["releases", "offloads"])
def test_the_engine_brings_a_dropped_backed_object_back_with_its_start_value(device, drop) -> None:
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA device")
    program = _streamed(drop)
    w, x = torch.tensor([1.0, 2.0, 3.0, 4.0]), torch.tensor([0.5, 0.5, 0.5, 0.5])
    with Engine("torch", device=device) as engine:
        engine.load(program, _resolver(), initial={"w": w, "x": x})
        result = engine.run(steps=2, feed=lambda _step: {"x": x})
        assert torch.equal(engine.fetch("y"), 3 * w + x)  # y = 2 w, then + w + x
        assert torch.equal(engine.fetch("w"), w)
    moved = [(t.obj, t.direction) for step in result.steps for t in step.transfers]
    assert moved == [("w", "h2d")] * 2  # fetched back each step, never written back
    virtual = Engine("virtual")
    virtual.load(program)
    assert virtual.run().steps[0].makespan_us == simulate(program).makespan_us


def _weights_program(writes: bool) -> Program:
    """A forward over four blocks whose weights (persistent, 1000 bytes each) do not all
    fit: with ``writes`` each block's task also changes its weight (an update)."""
    objects = [Obj(f"W{i}", 1000, "param", "slow") for i in range(4)]
    objects += [Obj(f"h{i}", 100, "activation") for i in range(5)]
    objects[4] = attrs.evolve(objects[4], location="fast")
    tasks = []
    for rep in range(2):
        for i in range(4):
            name = f"f{rep}_{i}"
            h_in, h_out = f"h{i}", f"h{i + 1}"
            if rep == 0:
                task = Task(name, "k", "k", inputs=(f"W{i}", h_in), outputs=(h_out,), cost_us=40.0)
            else:
                changed = (f"W{i}",) if writes else ()
                reads = (h_in,) if writes else (f"W{i}", h_in)
                task = Task(name, "k", "k", inputs=reads, mutates=(*changed, h_out), cost_us=40.0)
            tasks.append(task)
    return Program(
        "weights",
        objects=tuple(objects),
        tasks=tuple(tasks),
        final_locations={f"W{i}": "slow" for i in range(4)},
        persistent=tuple(f"W{i}" for i in range(4)),
    )


def test_the_planner_streams_read_only_homes_without_writing_them_back() -> None:
    read_only = _weights_program(writes=False)
    assert read_only.read_only_ids == {f"W{i}" for i in range(4)}
    budget = 3_400  # room for three weights and the activations, not four
    every = [frozenset({"W0", "W1", "W2"})]  # three homed fast: one leaves for W3
    program = plan_cyclic(read_only, budget, homes=every)
    assert fast_homes(program) == every[0]
    dropped = {o for t in (program.prologue, *program.tasks) for o in t.releases}
    assert dropped & every[0], "the test wants a fast home dropped within the step"
    assert not any(t.offloads for t in (program.prologue, *program.tasks))  # only releases
    one, two = simulate(program), check_cycle(program, budget)
    assert one.valid and two.valid, (one.error, two.problem)
    assert one.d2h.bytes == 0 and two.sim.d2h.bytes == 0
    assert one.h2d.bytes > 0  # they do come back
    # the same step, were the weights written: each fast home it drops is written back
    written = plan_cyclic(_weights_program(writes=True), budget, homes=every)
    assert simulate(written).d2h.bytes > 0
    # the search (every home set) is never slower with the weights read-only
    assert (
        plan(read_only, budget, cyclic=True).cycle.iteration_us
        <= plan(_weights_program(writes=True), budget, cyclic=True).cycle.iteration_us
    )
