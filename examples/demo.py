"""The main job on its embedded default: no download, CPU only.

Builds a training-shaped chain (8 layers, 2 gradient-accumulation rounds, weights and
optimizer state starting in slow memory), then for budgets from "everything fits" down to
the smallest feasible one: plans it with PressureFit, packs it into one arena, runs the
plan on the engine's virtual backend and checks that the run matches the prediction.
Later issues turn this into real training of a built-in model.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from dataflow.engine import Engine
from dataflow.planning import PlanningError, minimal_budget, plan
from dataflow.planning.placement import place
from dataflow.schema import validate
from dataflow.testing.chains import training_chain
from dataflow.units import format_size


def main() -> int:
    console = Console()
    program = training_chain(layers=8, rounds=2)
    problems = validate(program)
    if problems:
        for problem in problems:
            console.print(f"[red]{problem}")
        return 1
    total = sum(obj.size_bytes for obj in program.objects)
    smallest = minimal_budget(program)
    console.print(
        f"[bold]{program.name}[/]: {len(program.tasks)} tasks, {len(program.objects)} objects, "
        f"{format_size(total)} in all; smallest feasible budget {format_size(smallest)}"
    )
    table = Table("budget", "makespan", "lower bound", "ratio", "moved", "arena", "engine")
    ok = True
    for fraction in (1.0, 0.5, 0.3, 0.2, 0.0):
        budget = max(smallest, int(total * fraction))
        planned = plan(program, budget)
        try:
            arena = format_size(place(planned).arena_bytes)
        except PlanningError as exc:  # fragmentation: reported, the plan itself is valid
            arena = "[yellow]does not pack"
            console.print(f"[yellow]{exc}")
        engine = Engine("virtual", budget_bytes=budget)
        engine.load(planned)
        measured = engine.run().makespan_us
        same = measured == planned.sim.makespan_us
        ok &= same and planned.sim.valid
        moved = planned.sim.h2d.bytes + planned.sim.d2h.bytes
        table.add_row(
            format_size(budget),
            f"{planned.sim.makespan_us / 1e3:.2f} ms",
            f"{planned.lower_bound_us / 1e3:.2f} ms",
            f"{planned.sim.makespan_us / planned.lower_bound_us:.3f}",
            format_size(moved),
            arena,
            "matches" if same else f"[red]{measured / 1e3:.2f} ms",
        )
    console.print(table)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
