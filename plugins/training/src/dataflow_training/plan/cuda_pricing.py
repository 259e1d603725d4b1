"""How ``compile_step`` prices a step for a CUDA device (``price_on_cuda``).

On CUDA the budget is the allocator's, so the plan is made from measurements rather than
declared costs: each task priced (and its framework temporaries measured) by the profiling
pass, the links to pinned host memory measured beside the costliest task, and the plan
made at the budget less the CUDA libraries' reserve and the largest task workspace, which
``place`` then leaves free beside the arena. Off CUDA ``compile_step`` plans from the
family's declared costs.
"""

from __future__ import annotations

from typing import NamedTuple

import attrs

from dataflow_training.plan.recompute import Rewriter, measured_rewriter
from dataflow_training.step.lowering import Lowered


class CudaPricing(NamedTuple):
    """The step priced by measurements, the recompute rewriter whose candidates are
    priced the same way (None without a search), the CUDA libraries' reserve and the
    largest task workspace, both left free beside the arena."""

    step: Lowered
    rewriter: Rewriter | None
    reserve_bytes: int
    workspace_beside_bytes: int


def price_on_cuda(
    step: Lowered, resolver: str, *, device: str, graph: bool, search: bool
) -> CudaPricing:
    """Every task of ``step`` priced and its framework temporaries measured by the
    profiling pass (through its disk cache; timed as graph replays when steps will be
    replayed), the links to pinned host memory measured (both directions at once) beside
    the costliest task, and, with ``search``, every recompute candidate's tasks measured
    too. The plan leaves the CUDA libraries' reserve and the largest task workspace free
    beside its arena (it is made at the budget less both, its tasks holding no
    workspace), and the engine checks the allocator's peak against the whole budget."""
    # torch loads on CUDA alone: a CPU plan prices without it
    from dataflow import measure_links, resolvers, runtime_reserve_bytes
    from dataflow_training.plan.profile import (
        ProfileCache,
        apply_profile,
        busiest_task,
        profile_program,
        task_launcher,
        without_workspace,
    )

    spec = resolvers().get(resolver)
    measure = spec.build(step)
    cache = ProfileCache.for_device(device, resolver, graph=graph, family=step.family)
    profiles = profile_program(step, measure, device=device, cache=cache, graph=graph)
    # the links as the step's copies see them: beside its costliest task's kernels
    busiest = busiest_task(step, profiles)
    load = task_launcher(step, measure, busiest, device=device)
    measured_links = measure_links(device, beside=load)
    del load  # its buffers
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
    return CudaPricing(step, rewriter, runtime_reserve_bytes(device), beside)
