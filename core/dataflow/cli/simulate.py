"""``dataflow simulate PROGRAM.json``: price an annotated program, print a summary table.

Exits 1 when the program is malformed, structurally invalid, or cannot run (deadlock,
use of a dropped object, ...), after printing why in one line (a bare program is told to
be planned first). ``--trace OUT.json`` writes the timeline as Chrome trace-event JSON
(also for a failed run, up to the failure).
"""

from __future__ import annotations

import click
from rich.console import Console
from rich.table import Table

from dataflow.cli.errors import Failure
from dataflow.cli.options import PROGRAM_BUDGET, Limit, OutputFile, with_budgets, write_to
from dataflow.cli.validate import PROGRAM_FILE, load_program
from dataflow.schema import Program
from dataflow.sim import InvalidProgramError, SimResult, simulate
from dataflow.units import format_size


@click.command("simulate")
@click.argument("program_path", metavar="PROGRAM.json", type=PROGRAM_FILE)
@click.option(
    "--budget",
    "budget_bytes",
    type=PROGRAM_BUDGET,
    metavar="SIZE",
    help="fast-memory budget, e.g. 4GiB (default: the program's; none: unbounded)",
)
@click.option(
    "--slow-budget",
    "slow_budget_bytes",
    type=PROGRAM_BUDGET,
    metavar="SIZE",
    help="slow-memory budget (default: the program's; none: unbounded)",
)
@click.option(
    "--trace",
    "trace_path",
    type=OutputFile(),
    metavar="OUT.json",
    help="write the timeline as Chrome trace-event JSON (open it in ui.perfetto.dev)",
)
def simulate_command(
    program_path: str,
    budget_bytes: int | Limit | None,
    slow_budget_bytes: int | Limit | None,
    trace_path: str | None,
) -> None:
    """Simulate PROGRAM.json under the execution model and summarize the run."""
    program = load_program(program_path)
    run, fast, slow = with_budgets(program, budget_bytes, slow_budget_bytes)
    try:
        result = simulate(run, budget_bytes=fast, slow_budget_bytes=slow)
    except InvalidProgramError as exc:
        raise Failure(f"{program_path}: {exc}") from exc
    Console().print(summary_table(result, title=f"{program_path}: {program.name}"))
    if trace_path is not None:
        result.to_chrome_trace(write_to(trace_path))
        click.echo(f"wrote {trace_path} (open it in https://ui.perfetto.dev or chrome://tracing)")
    if not result.valid:
        raise Failure(f"{program_path}: the program cannot run: {result.error}{bare_hint(program)}")


def bare_hint(program: Program) -> str:
    """What would work for a program that cannot run: a bare one needs a plan first."""
    if any(task.directives() for task in program.tasks):
        return ""
    return (
        "; it has no directives yet: plan it first, e.g. "
        "`dataflow plan PROGRAM.json --budget SIZE -o planned.json`"
    )


def summary_table(result: SimResult, *, title: str = "") -> Table:
    """Makespan, memory peaks, link load and compute idle time of ``result``."""
    table = Table(title=title or result.program_name, show_header=True, header_style="bold")
    table.add_column("measure")
    table.add_column("value", justify="right")
    table.add_column("detail")
    status = "[green]valid[/]" if result.valid else f"[red]fails: {result.error.kind}[/]"
    table.add_row("result", status, "" if result.valid else f"at {_us(result.makespan_us)}")
    table.add_row("makespan", _us(result.makespan_us), _count(len(result.tasks), "task"))
    table.add_row(
        "compute idle",
        f"{100 * result.compute_idle_fraction:.1f} %",
        f"{_us(result.compute_idle_us)} idle, {_us(result.compute_busy_us)} busy",
    )
    table.add_row(
        "fast peak",
        format_size(result.fast_peak_bytes),
        _of_budget(result.fast_peak_bytes, result.fast_budget_bytes),
    )
    table.add_row(
        "slow peak",
        format_size(result.slow_peak_bytes),
        _of_budget(result.slow_peak_bytes, result.slow_budget_bytes),
    )
    for stats in (result.h2d, result.d2h):
        table.add_row(
            f"{stats.direction} link",
            f"{100 * stats.busy_fraction:.1f} % busy",
            f"{format_size(stats.bytes)} in {_count(stats.transfers, 'transfer')}, "
            f"{_us(stats.busy_us)}",
        )
    return table


def _count(count: int, noun: str) -> str:
    return f"{count:,} {noun}" + ("" if count == 1 else "s")


def _us(duration_us: float) -> str:
    """A duration in the largest unit that keeps it >= 1: ``850 us``, ``12.5 ms``, ``3.2 s``."""
    for unit, scale in (("s", 1e6), ("ms", 1e3)):
        if abs(duration_us) >= scale:
            return f"{duration_us / scale:,.4g} {unit}"
    return f"{duration_us:.4g} us"


def _of_budget(peak_bytes: int, budget_bytes: int | None) -> str:
    if budget_bytes is None:
        return "no budget"
    share = 100 * peak_bytes / budget_bytes if budget_bytes else 0.0
    return f"{share:.1f} % of {format_size(budget_bytes)}"
