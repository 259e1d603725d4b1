"""How ``TrainingRun`` plans a step for a CUDA device (``plan_for_cuda``).

On CUDA the budget is the allocator's, so the plan is made from measurements rather than
declared costs: each task priced (and its framework temporaries measured) by the profiling
pass, the links to pinned host memory measured beside the costliest task, and the plan
made at the budget less the CUDA libraries' reserve and the largest task workspace, which
``place`` then leaves free beside the arena. Off CUDA ``TrainingRun`` plans from the
family's declared costs in a few lines of its own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

import attrs

if TYPE_CHECKING:
    from dataflow_training.run import TrainingRun


def plan_for_cuda(run: TrainingRun, resolver: str, options: dict[str, Any]) -> None:
    """On CUDA the budget is the allocator's: every task is priced and its framework
    temporaries measured by the profiling pass (through its disk cache; timed as graph
    replays when steps will be replayed), the links to pinned host memory are measured
    (both directions at once), the plan leaves the CUDA libraries' own reserve and the
    largest task workspace free beside its arena (it is made at the budget less both,
    its tasks holding no workspace), and the engine checks the allocator's peak
    against the whole budget."""
    from dataflow.engine.backends.torch_cuda import measure_links, runtime_reserve_bytes
    from dataflow.planning import InfeasibleBudget, PlanningError, place, plan
    from dataflow.plugins import resolvers
    from dataflow_training.profile import (
        ProfileCache,
        apply_profile,
        busiest_task,
        profile_program,
        task_launcher,
        without_workspace,
    )
    from dataflow_training.recompute import RECOMPUTE, measured_recompute_planner

    def int_high(obj_id: str) -> int:
        return run.vocab_size if obj_id.startswith(("x_", "t_")) else 1

    measure = resolvers().get(resolver).build(run.program)
    cache = ProfileCache.for_device(run.device, resolver, graph=run.graph, family=run.family)
    profiles = profile_program(
        run.program,
        measure,
        device=run.device,
        int_high=int_high,
        cache=cache,
        graph=run.graph,
    )
    # the links as the step's copies see them: beside its costliest task's kernels
    busiest = busiest_task(run.program, profiles)
    load = task_launcher(run.program, measure, busiest, device=run.device, int_high=int_high)
    measured_links = measure_links(run.device, beside=load)
    del load  # its buffers
    links = attrs.evolve(measured_links, collective=run.program.links.collective)
    profiles, beside = without_workspace(profiles)
    run.program = attrs.evolve(apply_profile(run.program, profiles), links=links)
    if options["planner"] is RECOMPUTE:  # candidates priced by measurements too
        largest = [beside]

        def measured(program: Any) -> dict:
            build = resolvers().get(resolver).build(program)
            found, most = without_workspace(
                profile_program(
                    program,
                    build,
                    device=run.device,
                    int_high=int_high,
                    cache=cache,
                    graph=run.graph,
                )
            )
            largest[0] = max(largest[0], most)
            return found

        spec = measured_recompute_planner(run.program, measured, known=profiles)
        beside = largest[0]  # every candidate's tasks were measured by now
        options = dict(options, planner=spec)
    reserve = runtime_reserve_bytes(run.device)
    outside = reserve + beside
    if run.budget_bytes <= outside:
        raise PlanningError(
            f"a budget of {run.budget_bytes} bytes leaves nothing for the arena: the "
            f"CUDA libraries' reserve ({reserve} bytes) and the largest task workspace "
            f"({beside} bytes) take it all"
        )

    def plan_and_place(options: dict[str, Any]) -> None:
        try:
            run.planned = plan(run.program, run.budget_bytes - outside, **options)
        except InfeasibleBudget as exc:  # in the budget the caller gave
            raise InfeasibleBudget(
                exc.program_name,
                run.budget_bytes,
                exc.minimal_budget_bytes + outside,
                exc.task_id,
                exc.footprint_bytes,
                f"{exc.reason} (budgets here include the CUDA libraries' reserve of "
                f"{reserve} bytes and {beside} bytes of task workspace beside the arena)",
            ) from None
        run.placement = place(run.planned, workspace_beside_bytes=beside)

    plan_and_place(options)
    run.fit_pool(plan_and_place, options)
