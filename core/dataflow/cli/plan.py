"""``dataflow plan PROGRAM.json --budget 4GiB``: write the directives, print the summary.

Every option is checked before planning (a budget > 0, a planner that is installed, output
files whose folder exists or can be made). Exits 1 when the program is malformed, when no
plan fits the budget (the line gives the smallest budget that works and the task that
forces it), or when the planner fails (the line names it). ``-o PLANNED.json`` writes the
annotated program; ``--trace OUT.json`` its predicted timeline as Chrome trace-event JSON;
``--place`` also packs it into one arena. ``--measured --resolver NAME`` prices the
program by measurement first (``dataflow.engine.measure``: every distinct task timed
through the named resolver on ``--device``, the links timed as the engine copies), so the
plan and its predicted step are this machine's; ``--value NAME=VALUE`` gives the per-run
values its tasks read. A program that declares persistent objects
(a lowered training step: weights, optimizer state) is planned as a steady-state cycle, as
``dataflow train`` plans it; ``--once`` plans one iteration alone, ``--cyclic`` forces the
cycle.
"""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from dataflow.cli.errors import Failure, one_line, plugin_failure
from dataflow.cli.options import (
    BUDGET,
    PROGRAM_BUDGET,
    Device,
    Limit,
    OutputFile,
    lookup,
    run_values,
    value_options,
    with_budgets,
    write_to,
)
from dataflow.cli.validate import PROGRAM_FILE, load_program
from dataflow.planning import DEFAULT_PLANNER, Plan, PlanningError, place, plan
from dataflow.schema import Program
from dataflow.units import format_size


@click.command("plan")
@click.argument("program_path", metavar="PROGRAM.json", type=PROGRAM_FILE)
@click.option(
    "--budget",
    "budget_bytes",
    type=BUDGET,
    required=True,
    metavar="SIZE",
    help="fast-memory budget, e.g. 4GiB",
)
@click.option(
    "--slow-budget",
    "slow_budget_bytes",
    type=PROGRAM_BUDGET,
    metavar="SIZE",
    help="slow-memory budget (default: the program's; none: unbounded)",
)
@click.option(
    "--planner",
    default=DEFAULT_PLANNER,
    show_default=True,
    help="a planner name from `dataflow plugins list`",
)
@click.option(
    "-o",
    "--output",
    "output_path",
    type=OutputFile(),
    metavar="PLANNED.json",
    help="write the planned program",
)
@click.option(
    "--trace",
    "trace_path",
    type=OutputFile(),
    metavar="OUT.json",
    help="write the predicted timeline as Chrome trace JSON",
)
@click.option(
    "--place",
    "do_place",
    is_flag=True,
    help="also pack the plan into one fast arena and report its size",
)
@click.option(
    "--cyclic/--once",
    default=None,
    help="plan the steady state of a loop (default: when the program declares persistent "
    "objects) or one iteration alone",
)
@click.option(
    "--measured",
    is_flag=True,
    help="price every task (and the links) by measurement through --resolver before planning",
)
@click.option(
    "--resolver",
    "resolver_name",
    default=None,
    help="with --measured: the installed resolver that runs the tasks",
)
@click.option(
    "--device",
    default="cpu",
    show_default=True,
    type=Device(),
    help="with --measured: where the tasks are timed",
)
@value_options
def plan_command(
    program_path: str,
    budget_bytes: int,
    slow_budget_bytes: int | Limit | None,
    planner: str,
    output_path: str | None,
    trace_path: str | None,
    do_place: bool,
    cyclic: bool | None,
    measured: bool,
    resolver_name: str | None,
    device: str,
    value_pairs: tuple[tuple[str, object], ...],
    values_file: str | None,
) -> None:
    """Plan PROGRAM.json for a fast-memory budget and summarize the plan."""
    from dataflow.plugins import planners

    lookup(planners(), planner, "--planner")
    values = run_values(value_pairs, values_file)
    if measured and resolver_name is None:
        raise click.UsageError(
            "--measured needs --resolver NAME (the resolver that runs the tasks)"
        )
    if not measured and resolver_name is not None:
        raise click.UsageError("--resolver prices the tasks only with --measured")
    if not measured and values:
        raise click.UsageError("--value and --values are read only with --measured")
    program, _, slow_budget_bytes = with_budgets(
        load_program(program_path), budget_bytes, slow_budget_bytes
    )
    if measured:
        program = measured_program(program, program_path, resolver_name, device, values)
    if slow_budget_bytes is None and program.budget is not None:
        slow_budget_bytes = program.budget.slow_bytes
    if cyclic is None:
        cyclic = bool(program.persistent)
    planned = run_planner(
        program, program_path, budget_bytes, planner, slow_budget_bytes, cyclic=cyclic
    )
    arena = None
    if do_place:
        try:
            placement = place(planned)
        except PlanningError as exc:
            raise Failure(f"{program_path}: {one_line(str(exc))}") from exc
        planned, arena = placement.plan, placement.arena_bytes
    Console().print(
        plan_table(
            planned,
            title=f"{program_path}: {program.name}",
            arena=arena,
            budget_bytes=budget_bytes,
        )
    )
    if measured:
        step = planned.cycle.iteration_us if planned.cycle is not None else planned.sim.makespan_us
        click.echo(
            f"predicted step {_us(step)} on {device}, priced by measurement through "
            f"{resolver_name!r} (dataflow trace PLANNED.json --resolver {resolver_name} "
            "measures the step)"
        )
    if output_path is not None:
        write_to(output_path).write_text(planned.program.to_json() + "\n")
        click.echo(f"wrote {output_path}")
    if trace_path is not None:
        planned.sim.to_chrome_trace(write_to(trace_path), name=f"{program.name} (planned)")
        click.echo(f"wrote {trace_path} (open it in https://ui.perfetto.dev or chrome://tracing)")


def measured_program(
    program: Program, program_path: str, resolver_name: str, device: str, values: dict
) -> Program:
    """``program`` priced by measurement through the installed resolver ``resolver_name``
    (``priced_by_measurement``), its errors as one-line ``Failure``s."""
    from dataflow.extras import MissingExtraError, require_torch
    from dataflow.plugins import resolvers

    try:
        require_torch("dataflow plan --measured")
    except MissingExtraError as exc:
        raise Failure(str(exc)) from None
    from dataflow.engine import ResolverError
    from dataflow.engine.contract import MissingValueError
    from dataflow.engine.measure import priced_by_measurement, signature

    spec = lookup(resolvers(), resolver_name, "--resolver")
    try:
        resolver = spec.build(program)
    except Exception as exc:  # the resolver plugin's own failure: name it
        raise plugin_failure(
            f"resolver {resolver_name!r} cannot be built for {program_path}", exc
        ) from exc
    try:
        priced = priced_by_measurement(
            program, resolver, resolver_name=resolver_name, device=device, values=values
        )
    except ResolverError as exc:
        raise Failure(f"{program_path}: {exc}") from exc
    except MissingValueError as exc:
        raise Failure(f"{program_path}: {exc} (dataflow plan --value {exc.name}=...)") from exc
    except Exception as exc:  # an executable's own failure: name the resolver
        raise plugin_failure(
            f"{program_path}: a task failed while measured through {resolver_name!r}", exc
        ) from exc
    distinct = len({signature(program, t) for t in program.tasks if not t.collective})
    compute = sum(t.cost_us for t in priced.tasks if not t.collective)
    click.echo(
        f"measured {distinct} distinct task(s) of {len(program.tasks)} on {device} through "
        f"{resolver_name!r}: compute {_us(compute)} a step; links h2d "
        f"{priced.links.h2d.bw_bytes_per_us / 1e3:.1f} GB/s, d2h "
        f"{priced.links.d2h.bw_bytes_per_us / 1e3:.1f} GB/s"
    )
    return priced


def run_planner(
    program: Program,
    program_path: str,
    budget_bytes: int,
    planner: str,
    slow_budget_bytes: int | None,
    *,
    cyclic: bool = False,
) -> Plan:
    """``plan(...)``, its errors as one-line ``Failure``s: the core's own (an infeasible
    budget, with the one that works) as they are, anything else named as the planner's."""
    from dataflow.plugins import planners

    spec = planners().get(planner)  # the CLI resolves the name; plan() looks nothing up
    try:
        return plan(
            program,
            budget_bytes,
            planner=spec,
            slow_budget_bytes=slow_budget_bytes,
            cyclic=cyclic,
        )
    except PlanningError as exc:
        raise Failure(f"{program_path}: {one_line(str(exc))}") from exc
    except Exception as exc:  # a plugin planner's own failure: name the planner
        raise plugin_failure(f"{program_path}: planner {planner!r} failed", exc) from exc


def plan_table(
    planned: Plan, *, title: str = "", arena: int | None = None, budget_bytes: int | None = None
) -> Table:
    """The plan summary: makespan against the lower bound, peaks, bytes moved, idle time.

    ``arena`` (from ``place``) adds a row; ``budget_bytes`` is the budget asked for, when
    the plan was re-planned at a smaller capacity for its packing to fit.
    """
    sim, bound = planned.sim, planned.lower_bound
    budget = budget_bytes if budget_bytes is not None else planned.budget_bytes
    table = Table(
        title=f"{title} — {planned.planner}, budget {format_size(budget)}",
        show_header=True,
        header_style="bold",
    )
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("detail")
    over = 100 * (planned.makespan_ratio - 1)
    table.add_row(
        "makespan",
        _us(sim.makespan_us),
        f"{over:+.1f} % over the lower bound of {_us(bound.best_us)}",
    )
    table.add_row(
        "lower bound",
        _us(bound.best_us),
        f"compute {_us(bound.compute_us)}, link {_us(bound.link_us)}, "
        f"volume {_us(bound.volume_us)}, handoff {_us(bound.handoff_us)}, "
        f"write-back {_us(bound.writeback_us)}",
    )
    if planned.cycle is not None:
        table.add_row(
            "steady state",
            _us(planned.cycle.iteration_us),
            f"one iteration of the cycle ({len(planned.program.persistent)} persistent "
            "objects homed between iterations; checked over two)",
        )
    table.add_row(
        "compute idle",
        f"{100 * sim.compute_idle_fraction:.1f} %",
        f"{_us(sim.compute_idle_us)} of {_us(sim.makespan_us)}",
    )
    table.add_row(
        "fast peak",
        format_size(sim.fast_peak_bytes),
        f"{100 * sim.fast_peak_bytes / budget:.1f} % of the budget",
    )
    table.add_row(
        "slow peak",
        format_size(sim.slow_peak_bytes),
        "no budget"
        if sim.slow_budget_bytes is None
        else f"of {format_size(sim.slow_budget_bytes)}",
    )
    table.add_row(
        "moved",
        format_size(planned.moved_bytes),
        f"h2d {format_size(sim.h2d.bytes)} ({sim.h2d.transfers} transfers, "
        f"{100 * sim.h2d.busy_fraction:.0f} % busy), d2h {format_size(sim.d2h.bytes)} "
        f"({sim.d2h.transfers} transfers, {100 * sim.d2h.busy_fraction:.0f} % busy)",
    )
    tasks = planned.program.tasks
    table.add_row(
        "directives",
        f"{sum(len(t.directives()) for t in tasks):,}",
        f"{sum(len(t.releases) for t in tasks)} releases, "
        f"{sum(len(t.offloads) for t in tasks)} offloads, "
        f"{sum(len(t.prefetches) for t in tasks)} prefetches over {len(tasks)} tasks",
    )
    if arena is not None:
        replanned = (
            f"; re-planned at {format_size(planned.budget_bytes)} so the packing fits"
            if planned.budget_bytes != budget
            else ""
        )
        table.add_row("arena", format_size(arena), f"one offset per resident interval{replanned}")
    table.add_row("planning", f"{planned.planning_s:.3f} s", "")
    return table


def _us(duration_us: float) -> str:
    """A duration in the largest unit that keeps it >= 1: ``850 us``, ``12.5 ms``, ``3.2 s``."""
    for unit, scale in (("s", 1e6), ("ms", 1e3)):
        if abs(duration_us) >= scale:
            return f"{duration_us / scale:,.4g} {unit}"
    return f"{duration_us:.4g} us"
