"""Structural validation: every problem of a Program at once, each naming task and object."""

from __future__ import annotations

import math
from collections import Counter

import attrs

from dataflow.schema.objects import Location
from dataflow.schema.program import Program
from dataflow.schema.tasks import PROLOGUE, Task


@attrs.frozen
class Problem:
    """One fault. ``code`` is stable (tests and tools match on it); ``message`` is for people."""

    code: str
    message: str
    task: str | None = None
    obj: str | None = None

    def __str__(self) -> str:
        return self.message


def validate(program: Program) -> list[Problem]:
    """Return every structural problem of ``program`` (an empty list when there is none).

        Checks: no tasks at all; duplicate ids; sizes < 1; tensor metadata that disagrees with the size; negative
        workspace or cost; links and budget that are not positive; objects a task names but
        the program lacks; an object named twice in one task; use before definition; an output
        that already exists; a directive on an object the task cannot see (unknown, or not yet
        created) or two conflicting directives, in a task or in the prologue; a task whose own
        footprint exceeds the budget; final locations on unknown objects or that cannot fit
        their memory; persistent objects that are unknown, named twice or created by a task;
    a collective task without a collective link, with nothing to reduce or with a cost.
    """
    problems: list[Problem] = []
    problems += _check_objects(program)
    problems += _check_links_and_budget(program)
    # Budget-dependent checks only make sense against a budget that is itself sane.
    sane_budget = not any(problem.code == "budget" for problem in problems)
    problems += _check_tasks(program, sane_budget)
    problems += _check_final_locations(program, sane_budget)
    problems += _check_persistent(program)
    return problems


def _duplicates(ids: list[str]) -> list[str]:
    if len(set(ids)) == len(ids):  # the common case, without counting
        return []
    return sorted(key for key, count in Counter(ids).items() if count > 1)


def _check_objects(program: Program) -> list[Problem]:
    problems = [
        Problem("duplicate-object", f"object id {obj!r} is declared more than once", obj=obj)
        for obj in _duplicates([obj.id for obj in program.objects])
    ]
    for obj in program.objects:
        if obj.size_bytes < 1:
            problems.append(
                Problem("size", f"object {obj.id!r}: size_bytes {obj.size_bytes} < 1", obj=obj.id)
            )
        if obj.tensor is not None and obj.tensor.nbytes != obj.size_bytes:
            problems.append(
                Problem(
                    "tensor-size",
                    f"object {obj.id!r}: tensor {obj.tensor.dtype}{list(obj.tensor.shape)} holds "
                    f"{obj.tensor.nbytes} bytes but size_bytes is {obj.size_bytes}",
                    obj=obj.id,
                )
            )
    return problems


def _check_links_and_budget(program: Program) -> list[Problem]:
    problems = []
    directions = ("h2d", "d2h", "collective") if program.links.collective else ("h2d", "d2h")
    for direction in directions:
        link = getattr(program.links, direction)
        if not link.bw_bytes_per_us > 0 or math.isinf(link.bw_bytes_per_us):
            problems.append(
                Problem(
                    "link",
                    f"links.{direction}.bw_bytes_per_us must be a positive number, "
                    f"got {link.bw_bytes_per_us}",
                )
            )
        if not link.latency_us >= 0 or math.isinf(link.latency_us):
            problems.append(
                Problem("link", f"links.{direction}.latency_us must be >= 0, got {link.latency_us}")
            )
    budget = program.budget
    if budget is not None:
        if budget.fast_bytes < 1:
            problems.append(Problem("budget", f"budget.fast_bytes {budget.fast_bytes} < 1"))
        if budget.slow_bytes is not None and budget.slow_bytes < 0:
            problems.append(Problem("budget", f"budget.slow_bytes {budget.slow_bytes} < 0"))
    return problems


def _check_tasks(program: Program, sane_budget: bool) -> list[Problem]:
    if not program.tasks:
        return [Problem("no-tasks", "the program has no tasks; a program needs at least one")]
    problems = [
        Problem("duplicate-task", f"task id {task!r} appears more than once", task=task)
        for task in _duplicates([task.id for task in program.tasks])
    ]
    known = program.objects_by_id
    created: dict[str, str] = {}  # object -> the task that created it
    problems += _check_task_directives(program, program.prologue, known, created)
    for task in program.tasks:
        if task.id == PROLOGUE:
            problems.append(
                Problem(
                    "reserved-task-id",
                    f"task id {task.id!r} is reserved for the program's prologue",
                    task=task.id,
                )
            )
        problems += _check_task_numbers(task)
        if task.collective:
            problems += _check_collective(program, task)
        problems += _check_task_objects(program, task, known, created)
        problems += _check_task_directives(program, task, known, created)
        if sane_budget:
            problems += _check_task_footprint(program, task, known)
        for obj in task.outputs:
            created.setdefault(obj, task.id)
    return problems


def _check_task_numbers(task: Task) -> list[Problem]:
    problems = []
    if task.workspace_bytes < 0:
        problems.append(
            Problem(
                "workspace",
                f"task {task.id!r}: workspace_bytes {task.workspace_bytes} < 0",
                task=task.id,
            )
        )
    if not task.cost_us >= 0 or math.isinf(task.cost_us):
        problems.append(
            Problem(
                "cost",
                f"task {task.id!r}: cost_us must be a finite number >= 0, got {task.cost_us}",
                task=task.id,
            )
        )
    return problems


def _check_collective(program: Program, task: Task) -> list[Problem]:
    """A collective task reduces what it mutates, on the collective link, and nothing else
    prices it."""
    problems = []
    if program.links.collective is None:
        problems.append(
            Problem(
                "collective-link",
                f"task {task.id!r} runs on the collective link but the program has no "
                "links.collective",
                task=task.id,
            )
        )
    if not task.mutates:
        problems.append(
            Problem(
                "collective-mutates",
                f"task {task.id!r}: a collective task reduces the objects it mutates; it names none",
                task=task.id,
            )
        )
    if task.cost_us != 0:
        problems.append(
            Problem(
                "collective-cost",
                f"task {task.id!r}: a collective task takes no compute (links.collective times "
                f"it); cost_us must be 0, got {task.cost_us}",
                task=task.id,
            )
        )
    return problems


def _check_task_objects(program, task, known, created) -> list[Problem]:
    problems = []
    for obj in _duplicates(list(task.uses)):
        problems.append(
            Problem(
                "repeated-use",
                f"task {task.id!r} names object {obj!r} more than "
                "once across inputs, mutates and outputs",
                task=task.id,
                obj=obj,
            )
        )
    for field in ("inputs", "mutates", "outputs"):
        for obj in getattr(task, field):
            if obj not in known:
                problems.append(
                    Problem(
                        "unknown-object",
                        f"task {task.id!r}: {field} names unknown object {obj!r}",
                        task=task.id,
                        obj=obj,
                    )
                )
            elif field == "outputs":
                if program.exists_at_start(obj) is False and obj in created:
                    problems.append(
                        Problem(
                            "output-exists",
                            f"task {task.id!r} outputs {obj!r}, "
                            f"which task {created[obj]!r} already created",
                            task=task.id,
                            obj=obj,
                        )
                    )
            elif not program.exists_at_start(obj) and obj not in created:
                problems.append(
                    Problem(
                        "use-before-definition",
                        f"task {task.id!r} {field} "
                        f"{obj!r} before task {_creator(program, obj)!r} "
                        "creates it",
                        task=task.id,
                        obj=obj,
                    )
                )
    return problems


def _creator(program: Program, obj: str) -> str:
    return program.tasks[program.producers[obj]].id


def _check_task_directives(program, task, known, created) -> list[Problem]:
    if not (task.releases or task.offloads or task.prefetches):
        return []
    problems = []
    named: dict[str, str] = {}
    outputs = getattr(task, "outputs", ())
    for directive, obj in task.directives():
        where = (
            f"the prologue: {directive.value} {obj!r}"
            if task.id == PROLOGUE
            else f"task {task.id!r}: {directive.value} {obj!r}"
        )
        if obj not in known:
            problems.append(
                Problem(
                    "directive-unknown-object",
                    f"{where} names an unknown object",
                    task=task.id,
                    obj=obj,
                )
            )
            continue
        visible = program.exists_at_start(obj) or obj in created or obj in outputs
        if not visible:
            problems.append(
                Problem(
                    "directive-not-visible",
                    f"{where}: the object is not created until task {_creator(program, obj)!r}",
                    task=task.id,
                    obj=obj,
                )
            )
        if obj in named:
            problems.append(
                Problem(
                    "directive-conflict",
                    f"{where} conflicts with its {named[obj]} of the same object",
                    task=task.id,
                    obj=obj,
                )
            )
        named.setdefault(obj, directive.value)
    return problems


def _check_task_footprint(program, task, known) -> list[Problem]:
    if program.budget is None:
        return []
    footprint = task.workspace_bytes + sum(
        known[obj].size_bytes for obj in set(task.uses) if obj in known
    )
    if footprint <= program.budget.fast_bytes:
        return []
    return [
        Problem(
            "footprint",
            f"task {task.id!r} needs {footprint} bytes resident at once "
            f"(inputs + mutates + outputs + workspace) but budget.fast_bytes is "
            f"{program.budget.fast_bytes}",
            task=task.id,
        )
    ]


def _check_final_locations(program: Program, sane_budget: bool) -> list[Problem]:
    problems = []
    totals = {Location.FAST: 0, Location.SLOW: 0}
    for obj, location in program.final_locations.items():
        if obj not in program.objects_by_id:
            problems.append(
                Problem(
                    "final-unknown-object", f"final_locations names unknown object {obj!r}", obj=obj
                )
            )
            continue
        totals[location] += program.objects_by_id[obj].size_bytes
    budget = program.budget if sane_budget else None
    if budget is not None and totals[Location.FAST] > budget.fast_bytes:
        problems.append(
            Problem(
                "final-fast-overflow",
                f"final_locations keep "
                f"{totals[Location.FAST]} bytes in fast memory but "
                f"budget.fast_bytes is {budget.fast_bytes}",
            )
        )
    if (
        budget is not None
        and budget.slow_bytes is not None
        and totals[Location.SLOW] > budget.slow_bytes
    ):
        problems.append(
            Problem(
                "final-slow-overflow",
                f"final_locations keep "
                f"{totals[Location.SLOW]} bytes in slow memory but "
                f"budget.slow_bytes is {budget.slow_bytes}",
            )
        )
    return problems


def _check_persistent(program: Program) -> list[Problem]:
    problems = [
        Problem("duplicate-persistent", f"persistent names object {obj!r} more than once", obj=obj)
        for obj in _duplicates(list(program.persistent))
    ]
    for obj in dict.fromkeys(program.persistent):
        if obj not in program.objects_by_id:
            problems.append(
                Problem(
                    "persistent-unknown-object", f"persistent names unknown object {obj!r}", obj=obj
                )
            )
        elif not program.exists_at_start(obj):
            problems.append(
                Problem(
                    "persistent-created",
                    f"persistent object {obj!r} is created by task {_creator(program, obj)!r}; "
                    "a persistent object exists at start (it carries over from the last "
                    "iteration)",
                    obj=obj,
                )
            )
    return problems
