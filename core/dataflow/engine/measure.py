"""Price any program by measurement: each distinct task timed once through its resolver.

``measure_tasks(program, resolver)`` runs every task whose compute key the resolver knows
on fresh buffers of its own (floats drawn from a seeded normal, integers zeros, a
``workspace`` of its declared size, the per-run ``values`` it reads) and times it: once
to warm up, then until two launches in a row agree (on a CPU, where the first launches
fault in fresh pages), then ``repeats`` times; the median is its cost. Tasks of one
**signature** (compute key, parameters other than their place in a chain, and the dtype
and shape of every object they read, change and create) are timed once. On a CPU each
launch runs on a worker thread, handed over and waited for as the engine's dispatcher
hands a task to its compute worker; on CUDA each launch is timed by events around it.

``priced_by_measurement(program, resolver)`` returns the program with those costs (and,
with ``links``, the links measured as the engine copies: ``measure_host_links`` on a
CPU, ``measure_links`` on CUDA), ready to plan: the predicted step is then this machine's.
The training plugin's profiling pass (``dataflow_training.plan.profile``) does more for a
lowered training step (packed layouts, recorded routing decisions, a disk cache); this is
the pass for any program whose tasks have a resolver, such as a custom one.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable, Mapping
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import attrs

from dataflow.engine.contract import LaunchContext, Resolver, RunValues, resolve_all
from dataflow.schema import Program, Task

#: A task's parameters that say where it sits in a chain, not what it costs.
POSITION_PARAMS = ("layer", "round", "step")
#: After its warm-up a task runs until two launches in a row are within this factor of
#: each other (give or take ``SETTLED_SLACK_US``), at most ``SETTLE_LAUNCHES`` times.
SETTLED = 1.25
SETTLED_SLACK_US = 50.0
SETTLE_LAUNCHES = 6


def signature(program: Program, task: Task) -> tuple:
    """What a task's cost depends on: its compute key, its parameters (less its position)
    and the dtype and shape (or size) of every object it names, and its workspace."""
    objs = program.objects_by_id

    def shapes(names: tuple[str, ...]) -> tuple:
        return tuple(
            (objs[o].tensor.dtype, tuple(objs[o].tensor.shape))
            if objs[o].tensor is not None
            else objs[o].size_bytes
            for o in names
        )

    params = tuple(sorted((k, repr(v)) for k, v in task.params.items() if k not in POSITION_PARAMS))
    return (
        task.compute_key,
        params,
        shapes(task.inputs),
        shapes(task.mutates),
        shapes(task.outputs),
        task.workspace_bytes,
    )


def measure_tasks(
    program: Program,
    resolver: Resolver,
    *,
    resolver_name: str = "resolver",
    device: str = "cpu",
    repeats: int = 5,
    seed: int = 0,
    values: Mapping[str, Any] | None = None,
) -> dict[str, float]:
    """Each task's measured cost in microseconds, by task id (module docstring); collective
    tasks are left out (their link prices them). Every task is resolved first, so an
    unknown compute key raises ``ResolverError`` before anything runs; a task that reads a
    per-run value not in ``values`` raises ``MissingValueError``."""
    import torch

    from dataflow.engine.backends.torch_storage import typed_view

    dev = torch.device(device)
    tasks = tuple(task for task in program.tasks if not task.collective)
    executables = dict(zip(tasks, resolve_all(tasks, resolver, resolver_name), strict=True))
    generator = torch.Generator().manual_seed(seed)
    run_values = dict(values or {}, step=0)
    objs = program.objects_by_id
    by_signature: dict[tuple, float] = {}
    costs: dict[str, float] = {}
    worker = (
        ThreadPoolExecutor(1, thread_name_prefix="dataflow-measure") if dev.type != "cuda" else None
    )
    try:
        for task in tasks:
            key = signature(program, task)
            if key not in by_signature:
                buffers = {o: _filled(objs[o], dev, generator) for o in task.uses}

                def views(names: tuple[str, ...], buffers=buffers) -> tuple[Any, ...]:
                    return tuple(typed_view(buffers[o], objs[o]) for o in names)

                ctx = LaunchContext(
                    task=task,
                    device=dev.type,
                    stream=None if dev.type != "cuda" else torch.cuda.current_stream(dev),
                    inputs=views(task.inputs),
                    mutates=views(task.mutates),
                    outputs=views(task.outputs),
                    values=RunValues(run_values, task.id),
                    workspace=(
                        torch.empty(task.workspace_bytes, dtype=torch.uint8, device=dev)
                        if task.workspace_bytes
                        else None
                    ),
                )
                executable = executables[task]
                launch = lambda executable=executable, ctx=ctx: executable.launch(ctx)  # noqa: E731
                by_signature[key] = (
                    _device_timed_us(launch, dev, repeats)
                    if worker is None
                    else _host_timed_us(
                        lambda launch=launch: worker.submit(launch).result(), repeats
                    )
                )
            costs[task.id] = by_signature[key]
    finally:
        if worker is not None:
            worker.shutdown()
    return costs


def priced_by_measurement(
    program: Program,
    resolver: Resolver,
    *,
    resolver_name: str = "resolver",
    device: str = "cpu",
    repeats: int = 5,
    seed: int = 0,
    values: Mapping[str, Any] | None = None,
    links: bool = True,
) -> Program:
    """``program`` with every non-collective task's ``cost_us`` measured (``measure_tasks``)
    and, with ``links``, its h2d and d2h links measured as the engine's copies on
    ``device`` run (the collective link, if any, is kept)."""
    costs = measure_tasks(
        program,
        resolver,
        resolver_name=resolver_name,
        device=device,
        repeats=repeats,
        seed=seed,
        values=values,
    )
    tasks = tuple(
        attrs.evolve(task, cost_us=costs[task.id]) if task.id in costs else task
        for task in program.tasks
    )
    priced = attrs.evolve(program, tasks=tasks)
    if links:
        measured = measure_device_links(device)
        links_now = attrs.evolve(measured, collective=program.links.collective)
        priced = attrs.evolve(priced, links=links_now)
    return priced


def measure_device_links(device: str) -> Any:
    """The links between fast and slow memory on ``device``, as the engine copies."""
    import torch

    if torch.device(device).type == "cuda":
        from dataflow.engine.backends.torch_cuda import measure_links

        return measure_links(device)
    from dataflow.engine.backends.torch_cpu import measure_host_links

    return measure_host_links()


def _filled(obj: Any, dev: Any, generator: Any) -> Any:
    """A fresh buffer of ``obj``'s bytes: floats from a seeded normal, anything else zeros."""
    import torch

    from dataflow.engine.backends.torch_storage import torch_dtype

    buffer = torch.zeros(obj.size_bytes, dtype=torch.uint8, device=dev)
    if obj.tensor is not None and torch_dtype(obj.tensor.dtype).is_floating_point:
        from dataflow.engine.backends.torch_storage import typed_view

        view = typed_view(buffer, obj)
        view.copy_(torch.randn(view.shape, generator=generator).to(view.dtype))
    return buffer


def _launch_us(launch: Callable[[], object]) -> float:
    start = time.perf_counter()
    launch()
    return (time.perf_counter() - start) * 1e6


def _host_timed_us(launch: Callable[[], object], repeats: int) -> float:
    """The median of ``repeats`` host-timed launches, after a warm-up and until settled."""
    last = _launch_us(launch)
    for _ in range(SETTLE_LAUNCHES):
        now = _launch_us(launch)
        settled = max(now, last) <= SETTLED * min(now, last) + SETTLED_SLACK_US
        last = now
        if settled:
            break
    return statistics.median(_launch_us(launch) for _ in range(repeats))


def _device_timed_us(launch: Callable[[], object], dev: Any, repeats: int) -> float:
    """The median of ``repeats`` launches timed by CUDA events, after a warm-up."""
    import torch

    launch()
    torch.cuda.synchronize(dev)
    times = []
    for _ in range(repeats):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        launch()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
    return statistics.median(times)
