"""The main job on its embedded default: no download, CPU only.

Two parts:

1. A training-shaped chain (8 layers, 2 gradient-accumulation rounds, weights and
   optimizer state starting in slow memory): for budgets from "everything fits" down to
   the smallest one that both plans and places (found by trying: the planner's minimum
   first, then upwards), PressureFit plans it, the packer places it in one arena, and the
   engine's virtual backend runs it and matches the prediction.
2. GPT-2 tiny, really trained on the CPU: three steps of two accumulation rounds, planned
   into a quarter above its smallest budget that plans and places, run on the engine, and
   compared loss by loss, gradient by gradient and weight by weight with the
   plain-autograd reference trained by torch.optim.AdamW. It needs the plugin packages
   (dataflow-training, dataflow-family-gpt2, dataflow-resolver-torch,
   dataflow-kernels-torch); with the core alone it is skipped, and says so.
"""

from __future__ import annotations

import sys

from rich.console import Console
from rich.table import Table

from dataflow import (
    Engine,
    PlanningError,
    Program,
    format_size,
    minimal_budget,
    place,
    plan,
    validate,
)
from dataflow.testing import training_chain


def main() -> int:
    console = Console()
    program = training_chain(layers=8, rounds=2)
    problems = validate(program)
    if problems:
        for problem in problems:
            console.print(f"[red]{problem}")
        return 1
    total = sum(obj.size_bytes for obj in program.objects)
    planner_minimum = minimal_budget(program)
    smallest = smallest_placed_budget(program)
    console.print(
        f"[bold]{program.name}[/]: {len(program.tasks)} tasks, {len(program.objects)} objects, "
        f"{format_size(total)} in all; smallest budget that plans and places "
        f"{format_size(smallest)}"
        + (
            " (the planner's minimum)"
            if smallest == planner_minimum
            else f" (the planner's minimum, {format_size(planner_minimum)}, plans but does not "
            "pack into one arena)"
        )
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
    return 0 if ok and train_gpt2_tiny(console) else 1


def smallest_placed_budget(program: Program, resolution: float = 1 / 256) -> int:
    """The smallest budget at which ``program`` both plans and places in one arena, found
    by trying: the planner's minimum; else budgets growing by 1/16 until one places, then
    halving the gap down to ``resolution`` of the budget."""

    def places(budget: int) -> bool:
        try:
            place(plan(program, budget))
        except PlanningError:
            return False
        return True

    low = minimal_budget(program)
    if places(low):
        return low
    high = low + max(1, low // 16)
    while not places(high):
        low, high = high, high + max(1, high // 16)
    while high - low > max(1, int(high * resolution)):
        middle = (low + high) // 2
        low, high = (low, middle) if places(middle) else (middle, high)
    return high


def train_gpt2_tiny(console: Console) -> bool:
    from dataflow import UnknownNameError, families

    try:
        from dataflow_training import TOLERANCES, TrainConfig, lower, step_checks

        family = families().get("gpt2").load()
    except (ImportError, UnknownNameError) as exc:
        console.print(
            f"\n[yellow]gpt2_tiny training skipped[/]: it needs the plugin packages "
            f"({exc}); `nox -s demo` installs them all"
        )
        return True
    shape = {"seq_len": 32, "batch": 2, "rounds": 2}
    program = lower(family, "gpt2_tiny", TrainConfig(**shape), keep_grads=True).program
    budget = int(1.25 * smallest_placed_budget(program))
    total = sum(obj.size_bytes for obj in program.objects)
    console.print(
        f"\n[bold]gpt2_tiny[/]: {len(program.tasks)} tasks, {format_size(total)} of objects; "
        f"training 3 steps in {format_size(budget)} on the CPU engine"
    )
    checks = step_checks(
        family,
        "gpt2_tiny",
        device="cpu",
        policy="fp32",
        steps=3,
        budget_bytes=budget,
        seed=0,
        tolerance=TOLERANCES["fp32"]["step"],
        **shape,
    )
    table = Table("loss", "engine vs reference (relative)", "")
    for check in checks:
        if check.name.startswith("loss"):
            table.add_row(check.name, f"{check.rel:.1e}", "ok" if check.ok else "[red]FAIL")
    console.print(table)
    failed = [check for check in checks if not check.ok]
    console.print(
        f"{len(checks) - len(failed)} of {len(checks)} checks (each step from the "
        "engine's state: losses, every gradient, every weight after it) within tolerance"
    )
    return not failed


if __name__ == "__main__":
    sys.exit(main())
