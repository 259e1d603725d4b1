"""The profiling pass: measure each distinct task once on the device, then price the
program with what was measured.

A task's **signature** is its compute key, its parameters other than where it sits in the
chain (layer, round, step) and the sizes of what it reads, changes and creates: the
twelve forward tasks of a 12-block model share one. For each signature the executable
runs on freshly filled buffers (random floats, token 0, packed objects filled through
their layouts): once to warm up, then ``repeats`` times timed with the device's events
(CUDA) or the host clock (CPU). On CUDA the allocator's peak above what was allocated
before the launch is the task's **workspace**: the temporaries its kernels take from the
framework allocator, which the plan must leave room for.

With ``graph`` (CUDA, the step will be replayed from a CUDA graph) a capturable task is
captured once into a graph of its own and the replays are timed: the device's time alone,
as in a replayed step, where no host launch gap shows. Otherwise each timed launch
includes whatever the host adds while it enqueues the task's kernels, as in a dispatched
step.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from typing import Any

import attrs
import torch

from dataflow.engine import LaunchContext
from dataflow.engine.backends.torch_storage import typed_view
from dataflow.schema import Program, Task
from dataflow_training.step import StepLayout

#: Workspace is rounded up to the allocator's block size (kMinBlockSize, 512 bytes).
ROUND_BYTES = 512
_POSITION = ("layer", "round", "step")


@attrs.frozen
class TaskProfile:
    cost_us: float
    workspace_bytes: int


def signature(program: Program, task: Task) -> tuple:
    sizes = program.objects_by_id
    params = tuple(sorted((k, repr(v)) for k, v in task.params.items() if k not in _POSITION))
    return (
        task.compute_key,
        params,
        tuple(sizes[o].size_bytes for o in task.inputs),
        tuple(sizes[o].size_bytes for o in task.mutates),
        tuple(sizes[o].size_bytes for o in task.outputs),
    )


def _filled(
    program: Program,
    layout: StepLayout,
    obj_id: str,
    device: torch.device,
    generator: torch.Generator,
    int_high: Callable[[str], int],
) -> torch.Tensor:
    obj = program.obj(obj_id)
    buffer = torch.zeros(obj.size_bytes, dtype=torch.uint8, device=device)
    packed = layout.packed.get(obj_id)
    views = packed.layout.views(buffer) if packed is not None else {}
    if obj.tensor is not None:
        views = {"": typed_view(buffer, obj)}
    for view in views.values():
        if view.is_floating_point():
            noise = 0.02 * torch.randn(view.shape, generator=generator)
            view.copy_(noise.to(view.dtype))
        elif int_high(obj_id) > 1:
            view.copy_(torch.randint(0, int_high(obj_id), view.shape, generator=generator))
    return buffer


def profile_program(
    program: Program,
    resolver: Callable[[Task], Any],
    *,
    device: str = "cuda",
    repeats: int = 3,
    seed: int = 0,
    int_high: Callable[[str], int] = lambda obj_id: 1,
    graph: bool = False,
) -> dict[tuple, TaskProfile]:
    """Measure every distinct task signature of ``program`` once (see the module docstring).
    Integer tensors are filled uniformly from ``[0, int_high(obj_id))`` (zeros by default;
    tokens should be spread over the vocabulary, or the embedding's scatter-add contends
    on one row)."""
    dev = torch.device(device)
    generator = torch.Generator().manual_seed(seed)
    profiles: dict[tuple, TaskProfile] = {}
    layout = StepLayout.of(program)
    for task in program.tasks:
        key = signature(program, task)
        if key in profiles:
            continue
        ctx = _context(program, layout, task, dev, generator, int_high)
        executable = resolver(task)
        replay = graph and dev.type == "cuda" and getattr(executable, "capturable", False)
        profiles[key] = _measure(executable, ctx, dev, repeats, replay)
    return profiles


def _context(
    program: Program,
    layout: StepLayout,
    task: Task,
    dev: torch.device,
    generator: torch.Generator,
    int_high: Callable[[str], int],
) -> LaunchContext:
    """A launch context over fresh, filled buffers for every object the task names."""
    objs = program.objects_by_id
    buffers = {o: _filled(program, layout, o, dev, generator, int_high) for o in task.uses}

    def views(names: tuple[str, ...]) -> tuple[torch.Tensor, ...]:
        return tuple(typed_view(buffers[o], objs[o]) for o in names)

    return LaunchContext(
        task=task,
        device=dev.type,
        stream=None,
        inputs=views(task.inputs),
        mutates=views(task.mutates),
        outputs=views(task.outputs),
        values={"step": 0},
    )


def _measure(
    executable: Any, ctx: LaunchContext, dev: torch.device, repeats: int, replay: bool = False
) -> TaskProfile:
    executable.launch(ctx)  # warm-up: lazy initialisation, library handles, caches
    if dev.type != "cuda":
        times = []
        for _ in range(repeats):
            start = time.perf_counter()
            executable.launch(ctx)
            times.append((time.perf_counter() - start) * 1e6)
        return TaskProfile(statistics.median(times), 0)
    torch.cuda.synchronize(dev)
    base = torch.cuda.memory_allocated(dev)
    torch.cuda.reset_peak_memory_stats(dev)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        executable.launch(ctx)
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    workspace = max(0, torch.cuda.max_memory_allocated(dev) - base)
    workspace = -(-workspace // ROUND_BYTES) * ROUND_BYTES
    if replay:
        times = _replayed_us(executable, ctx, dev, repeats)
    return TaskProfile(statistics.median(times), workspace)


def _replayed_us(
    executable: Any, ctx: LaunchContext, dev: torch.device, repeats: int
) -> list[float]:
    """The task captured into a CUDA graph of its own, each replay timed by events."""
    stream = torch.cuda.Stream(device=dev)
    stream.wait_stream(torch.cuda.current_stream(dev))
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        executable.launch(attrs.evolve(ctx, stream=stream))
    graph.replay()  # warm: the first replay uploads the graph
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    del graph
    return times


def apply_profile(program: Program, profiles: dict[tuple, TaskProfile]) -> Program:
    """``program`` with every task's cost and workspace from its measured signature."""
    tasks = []
    for task in program.tasks:
        measured = profiles[signature(program, task)]
        tasks.append(
            attrs.evolve(task, cost_us=measured.cost_us, workspace_bytes=measured.workspace_bytes)
        )
    return attrs.evolve(program, tasks=tuple(tasks))
