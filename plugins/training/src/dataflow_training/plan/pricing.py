"""How ``compile_step`` prices a step from measurements, on any device (``price_step``).

A step is priced as it will run: each distinct task timed by the profiling pass (through
its disk cache, keyed by the device: on a CPU its processor and torch's thread count),
the links between fast and slow memory measured beside the costliest task (on CUDA the
copy engines to pinned host memory, once a process for each such task; on a CPU a worker
thread's host memcpy, which shares the cores with the compute worker, kept with the
profiles), and, with a recompute search, every candidate's
tasks timed the same way. On CUDA the budget is the allocator's, so the plan is made at
the budget less the CUDA libraries' reserve and the largest task workspace, which
``place`` then leaves free beside the arena; a CPU has neither (both are 0), nor graphs.

A step lowered with declared costs (a hardware entry's ``roofline``) is a prediction for
that entry, not for the device it runs on: ``dataflow predict --hw`` prices that way.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import attrs

from dataflow_training.plan.recompute import Rewriter, measured_rewriter
from dataflow_training.step.lowering import Lowered


class PricedStep(NamedTuple):
    """The step priced by measurements, the recompute rewriter whose candidates are
    priced the same way (None without a search), the CUDA libraries' reserve and the
    largest task workspace, both left free beside the arena (0 on a CPU), and what the
    prediction is for (``priced_for``: e.g. ``cpu (measured)``)."""

    step: Lowered
    rewriter: Rewriter | None
    reserve_bytes: int
    workspace_beside_bytes: int
    priced_for: str


#: Links measured in this process, by device, resolver and the task they were measured
#: beside: the step search prices many steps and ``compile_step`` the chosen one again,
#: each the same links (and so the same program: ``plan_memo`` finds the search's plan)
_links_measured: dict[tuple, Any] = {}


def measured_for(device: str) -> str:
    """What a step priced by ``price_step`` on ``device`` is predicted for."""
    return f"{device} (measured)"


def declared_for(device: str) -> str:
    """What a step on ``device`` priced by a cost model its caller gave is predicted for:
    the hardware that model describes, not this device."""
    return f"{device} (declared costs, not measured)"


def price_as_compiled(
    step: Lowered, resolver: str, *, device: str, graph: bool, search: bool, declared: bool
) -> PricedStep:
    """``step`` priced as ``compile_step`` prices it: by measurement (``price_step``) on
    CUDA, and elsewhere unless ``declared`` (the step was lowered with a cost model its
    caller gave, e.g. a hardware entry's roofline: those costs kept, and said)."""
    if device.startswith("cuda") or not declared:
        return price_step(step, resolver, device=device, graph=graph, search=search)
    return PricedStep(step, Rewriter(step) if search else None, 0, 0, declared_for(device))


def price_step(
    step: Lowered, resolver: str, *, device: str, graph: bool = False, search: bool = False
) -> PricedStep:
    """Every task of ``step`` priced by the profiling pass on ``device`` (its framework
    temporaries measured too on CUDA; through the disk cache; timed as graph replays with
    ``graph``, CUDA only), the links between fast and slow memory measured (both
    directions at once too) beside the costliest task, and, with ``search``, every
    recompute candidate's tasks measured too. On CUDA the plan leaves the libraries'
    reserve and the largest task workspace free beside its arena (it is made at the
    budget less both, its tasks holding no workspace), and the engine checks the
    allocator's peak against the whole budget; on a CPU both are 0."""
    # torch loads only here: a step priced by declared costs plans without it
    from dataflow import measure_links, resolvers, runtime_reserve_bytes
    from dataflow_training.plan.profile import (
        ProfileCache,
        apply_profile,
        busiest_task,
        profile_program,
        signature,
        task_launcher,
        without_workspace,
    )

    on_cuda = device.startswith("cuda")
    graph = graph and on_cuda
    spec = resolvers().get(resolver)
    measure = spec.build(step)
    cache = ProfileCache.for_device(device, resolver, graph=graph, family=step.family)
    profiles = profile_program(step, measure, device=device, cache=cache, graph=graph)
    # the links as the step's copies see them: beside its costliest task's kernels
    busiest = busiest_task(step, profiles)
    # a CPU's links are the host's memcpy, kept with the profiles (a GPU's are measured
    # each run: their pinned copies depend on the host, which the cache key does not name)
    kept = cache if cache is not None and not on_cuda else None
    beside_key = (device, resolver, signature(step, busiest))
    measured_links = _links_measured.get(beside_key)
    if measured_links is None and kept is not None:
        measured_links = kept.get_links(signature(step, busiest))
    if measured_links is None:
        load = task_launcher(step, measure, busiest, device=device)
        measured_links = measure_links(device, beside=load)
        del load  # its buffers
        if kept is not None:
            kept.put_links(signature(step, busiest), measured_links)
    _links_measured[beside_key] = measured_links
    links = attrs.evolve(measured_links, collective=step.program.links.collective)
    profiles, beside = without_workspace(profiles)
    step = step.with_program(attrs.evolve(apply_profile(step, profiles), links=links))
    rewriter = None
    if search:  # candidates priced by measurements too
        largest = [beside]

        def measured(candidate: Lowered) -> dict:
            found, most = without_workspace(
                profile_program(
                    candidate, spec.build(candidate), device=device, cache=cache, graph=graph
                )
            )
            largest[0] = max(largest[0], most)
            return found

        rewriter = measured_rewriter(step, measured, known=profiles)
        beside = largest[0]  # every candidate's tasks were measured by now
    reserve = runtime_reserve_bytes(device) if on_cuda else 0
    return PricedStep(step, rewriter, reserve, beside, measured_for(device))
