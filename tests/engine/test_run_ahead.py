"""Launching a task behind the running one (``Dispatcher``'s ``run_ahead``) on the CPU
backend, whose compute worker runs its queue in order as a CUDA stream does (and on CUDA,
marked ``gpu``: sleep kernels on the compute stream).

Random chains, planned into tight budgets and placed into one arena, run with slow tasks
(so the dispatcher decides while the worker is busy and transfers move beside it): every
object's final value is the plain in-order evaluation's, byte for byte, with and without
launching ahead; the budget holds; and tasks do get launched ahead."""

from __future__ import annotations

import random
import time

import attrs
import pytest

torch = pytest.importorskip("torch")

from dataflow.engine import DictResolver, Engine, EngineRunError  # noqa: E402
from dataflow.planning import place, plan  # noqa: E402
from dataflow.schema import Link, Links, Location, Obj, Program, Role, Task  # noqa: E402
from dataflow.testing.programs import keep_all_bytes, largest_footprint_bytes  # noqa: E402
from dataflow.testing.shapes import random_chain  # noqa: E402

KiB = 2**10
#: a task's sleep: long beside a dispatcher pass, so decisions happen mid-task
TASK_SLEEP_S = (0.0, 0.002)
#: ``torch.cuda._sleep``'s cycles a second, roughly (an H100's SM clock is 1.6-2 GHz): the
#: sleeps need only be long beside a launch, not exact
CUDA_SLEEP_CYCLES_PER_S = 1.8e9
#: what the CUDA allocator may take beyond the plan's budget here (``check_chain``)
CUDA_SLACK_BYTES = 2**20
#: a copy's sleep, before and after it moves the bytes: transfers then overlap tasks,
#: shorter than most of them or longer than any
COPY_SLEEP_S = (0.0005, 0.003)


def chain(rng: random.Random, count: int) -> Program:
    """``random_chain``'s chain (objects used again after random gaps, some mutated, some
    made by tasks, some starting in slow memory) at a thousandth of its sizes and on
    ``chain_links``, so the plan moves objects of a few KiB."""
    program = random_chain(rng, tasks=count)
    objects = [
        attrs.evolve(obj, size_bytes=max(1, obj.size_bytes // 1024)) for obj in program.objects
    ]
    tasks = [
        attrs.evolve(
            task, workspace_bytes=task.workspace_bytes // 1024, cost_us=rng.uniform(50, 400)
        )
        for task in program.tasks
    ]
    return attrs.evolve(program, objects=objects, tasks=tasks, links=chain_links())


def chain_links() -> Links:
    """100 MB/s: a 16 KiB object takes about 170 us, the order of a task here."""
    return Links(h2d=Link(100.0, 5.0), d2h=Link(100.0, 5.0))


def apply(task: Task, index: int, inputs, mutates, outputs) -> None:
    """The task's math on uint8 bytes, wrapping at 256: exact, so a stale or clobbered
    input shows in every byte it writes. All of it device work in place or on 0-d tensors
    (nothing read on the host, which would wait for the stream; no temporaries the budget
    would have to hold)."""
    device = (*inputs, *mutates, *outputs)[0].device
    acc = torch.full((), index, dtype=torch.int64, device=device)
    for x in (*inputs, *mutates):
        acc = acc + x.sum(dtype=torch.int64)
    acc = (acc % 251).to(torch.uint8)
    for m in mutates:
        m.mul_(3).add_(acc)
    for n, out in enumerate(outputs):
        out.copy_((acc + n + 1).expand_as(out))


class Slow:
    """An executable that sleeps (a seeded length: on CUDA a sleep kernel on its stream),
    then applies the task's math."""

    def __init__(self, task: Task, index: int, sleep_s: float) -> None:
        self.task, self.index, self.sleep_s = task, index, sleep_s

    def launch(self, ctx) -> None:
        if ctx.device == "cuda":
            torch.cuda._sleep(int(self.sleep_s * CUDA_SLEEP_CYCLES_PER_S))
        else:
            time.sleep(self.sleep_s)
        apply(self.task, self.index, ctx.inputs, ctx.mutates, ctx.outputs)


def initial(program: Program, seed: int) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return {
        obj.id: torch.randint(0, 256, (obj.size_bytes,), dtype=torch.uint8, generator=g)
        for obj in program.objects
        if program.exists_at_start(obj.id)
    }


def in_order(program: Program, start: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """The reference: every task applied in chain order to plain tensors."""
    values = {k: v.clone() for k, v in start.items()}
    sizes = {obj.id: obj.size_bytes for obj in program.objects}
    for index, task in enumerate(program.tasks):
        for out in task.outputs:
            values[out] = torch.zeros(sizes[out], dtype=torch.uint8)
        apply(
            task,
            index,
            [values[o] for o in task.inputs],
            [values[o] for o in task.mutates],
            [values[o] for o in task.outputs],
        )
    return values


@pytest.fixture(params=COPY_SLEEP_S, ids=lambda s: f"copy{s * 1e3:g}ms")
def slow_copies(request, monkeypatch):
    """The CPU runner's copies take milliseconds, as a device's link does beside its
    tasks: a task that ran early into bytes still being copied out would show."""
    from dataflow.engine.backends import torch_cpu

    copy = torch_cpu.host_copy

    def slow(dst, src):
        time.sleep(request.param)
        copy(dst, src)
        time.sleep(request.param)

    monkeypatch.setattr(torch_cpu, "host_copy", slow)


def run(source, program, start, sleeps, *, run_ahead: bool, device: str = "cpu", budget=None):
    resolver = DictResolver("slow", {"k": lambda task: Slow(task, *sleeps[task.id])})
    with Engine("torch", budget, device=device, run_ahead=run_ahead) as engine:
        engine.load(source, resolver, initial={k: v.clone() for k, v in start.items()})
        result = engine.run()
        found = {}
        for obj in program.objects:
            try:
                found[obj.id] = engine.fetch(obj.id)
            except KeyError:  # released after its last use
                pass
    return result, found


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("placed", [True, False], ids=["placed", "plan"])
def test_launching_ahead_computes_the_in_order_values_within_the_budget(
    seed, placed, slow_copies
) -> None:
    check_chain(seed, placed, "cpu")


@pytest.mark.gpu
@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("placed", [True, False], ids=["placed", "plan"])
def test_launching_ahead_on_cuda_computes_the_in_order_values(seed, placed) -> None:
    check_chain(seed, placed, "cuda")


def check_chain(seed: int, placed: bool, device: str) -> None:
    """A random chain planned at a third of the way from its largest task to keeping all,
    run with and without launching ahead: the in-order evaluation's bytes, the budget held
    by the ledger (and on CUDA by the allocator, which the engine checks), tasks launched
    ahead."""
    rng = random.Random(seed)
    program = chain(rng, 24)
    low, high = largest_footprint_bytes(program), keep_all_bytes(program)
    budget = low + (high - low) // 3
    planned = plan(program, budget)
    source = place(planned) if placed else planned
    sleeps = {
        task.id: (index, rng.uniform(*TASK_SLEEP_S)) for index, task in enumerate(program.tasks)
    }
    # on CUDA the allocator's peak is held to the engine's budget: its rounding of each
    # object (plan: one allocation each) and the math's 0-d values sit on top of the plan
    allowed = budget + CUDA_SLACK_BYTES if device == "cuda" else budget
    start = initial(program, seed)
    want = in_order(program, start)
    ahead = 0
    for run_ahead in (False, True):
        result, found = run(
            source, program, start, sleeps, run_ahead=run_ahead, device=device, budget=allowed
        )
        assert found, "nothing to compare"
        for obj, value in found.items():
            assert torch.equal(value, want[obj]), (obj, run_ahead)
        assert result.fast_peak_bytes <= budget
        if run_ahead:
            ahead = result.steps[-1].launched_ahead
        else:
            assert result.steps[-1].launched_ahead == 0
    assert 0 < ahead < len(program.tasks)


@pytest.mark.parametrize("directive", ["releases", "offloads"])
def test_a_task_whose_input_the_running_task_sends_away_fails_as_the_model_says(
    directive,
) -> None:
    # t0 lets x go at its end and nothing brings it back: t1 cannot run (not-resident),
    # launched ahead or not; launched behind t0 it would have read x before it went
    objects = [
        Obj("x", 4 * KiB, Role.DATA, Location.FAST),
        Obj("z", 4 * KiB, Role.ACTIVATION),
    ]
    tasks = [
        Task("t0", "k", "k", inputs=["x"], cost_us=100, **{directive: ["x"]}),
        Task("t1", "k", "k", inputs=["x"], outputs=["z"], cost_us=100),
    ]
    program = Program(name="sent-away", objects=objects, tasks=tasks, links=chain_links())
    sleeps = {"t0": (0, 0.01), "t1": (1, 0.0)}
    for run_ahead in (False, True):
        with pytest.raises(EngineRunError, match="'t1' needs 'x'"):
            run(program, program, initial(program, 0), sleeps, run_ahead=run_ahead)


def test_without_in_order_lanes_nothing_runs_ahead() -> None:
    program = chain(random.Random(0), 12)
    with Engine("virtual", run_ahead=True) as engine:
        engine.load(plan(program, keep_all_bytes(program)))
        assert engine.run().steps[-1].launched_ahead == 0
