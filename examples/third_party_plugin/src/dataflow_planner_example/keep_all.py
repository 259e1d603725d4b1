"""The keep-all planner: every object stays in fast memory for the whole step.

It writes no directive. When the program, run with nothing released or offloaded, fits the
budget, the plan is the bare chain itself (its budget set to the one planned for);
otherwise it raises ``KeepAllError`` saying by how much it misses and at which task.
It never moves data, so every object a task uses must start in fast memory, and every
final location must be where the object already ends.
"""

from __future__ import annotations

import attrs

from dataflow import Budget, Location, Program, format_size, validate


class KeepAllError(ValueError):
    """The program cannot run without moving data, or does not fit the budget."""


@attrs.frozen
class Peak:
    """Fast bytes in use at the worst moment, and the task running then (None: at start)."""

    size_bytes: int
    task: str | None


def no_offload_peak(program: Program) -> Peak:
    """Peak fast bytes when nothing is ever released or offloaded.

    At start the objects that start fast are resident; while task *i* runs, so are every
    output of the tasks before it, its own outputs and its workspace.
    """
    resident_bytes = sum(
        obj.size_bytes
        for obj in program.objects
        if program.exists_at_start(obj.id) and obj.location is Location.FAST
    )
    peak = Peak(resident_bytes, None)
    for task in program.tasks:
        created_bytes = sum(program.obj(obj_id).size_bytes for obj_id in task.outputs)
        running_bytes = resident_bytes + created_bytes + task.workspace_bytes
        if running_bytes > peak.size_bytes:
            peak = Peak(running_bytes, task.id)
        resident_bytes += created_bytes
    return peak


def plan_keep_all(program: Program, budget_bytes: int, **options: object) -> Program:
    """Plan ``program`` (its directives are dropped) for ``budget_bytes`` of fast memory."""
    if options:
        raise TypeError(f"keep-all takes no options, got: {', '.join(sorted(options))}")
    bare = program.bare()
    problems = validate(bare)
    if problems:
        lines = "\n".join(f"  - {problem}" for problem in problems)
        raise KeepAllError(f"program {program.name!r} is not valid:\n{lines}")
    _check_nothing_moves(bare)
    peak = no_offload_peak(bare)
    if peak.size_bytes > budget_bytes:
        where = f"while task {peak.task!r} runs" if peak.task else "at start"
        raise KeepAllError(
            f"program {program.name!r} needs {_size(peak.size_bytes)} of fast memory {where}"
            f" with every object kept resident, over the budget of {_size(budget_bytes)};"
            " use a planner that offloads, such as pressurefit"
        )
    slow_bytes = program.budget.slow_bytes if program.budget else None
    return attrs.evolve(bare, budget=Budget(fast_bytes=budget_bytes, slow_bytes=slow_bytes))


def _size(size_bytes: int) -> str:
    """``1.5 GiB (1610612736 bytes)``; small sizes only as ``872 B``."""
    text = format_size(size_bytes)
    return text if size_bytes < 1024 else f"{text} ({size_bytes} bytes)"


def _check_nothing_moves(program: Program) -> None:
    for task in program.tasks:
        for obj_id in task.inputs + task.mutates:
            obj = program.obj(obj_id)
            if program.exists_at_start(obj_id) and obj.location is Location.SLOW:
                raise KeepAllError(
                    f"task {task.id!r} uses object {obj_id!r}, which starts in slow memory; "
                    "keep-all never moves data, so every object a task uses must start fast"
                )
    for obj_id, wanted in program.final_locations.items():
        obj = program.obj(obj_id)
        ends = obj.location if program.exists_at_start(obj_id) else Location.FAST
        if wanted is not ends:
            raise KeepAllError(
                f"object {obj_id!r} must end in {wanted} memory but stays in {ends} memory; "
                "keep-all never moves data"
            )
