"""Small programs that any plugin can be tested on, without a model or torch."""

from __future__ import annotations

from dataflow.schema import Obj, Program, Task


def tiny_chain(name: str = "tiny-chain") -> Program:
    """Three tasks over objects that all start in fast memory and may stay there.

    With a budget of ``keep_all_bytes(program)`` it runs without a single directive, so
    every planner must return a valid plan for it.
    """
    objects = (
        Obj("x", 64, "data", "fast"),
        Obj("w0", 256, "param", "fast"),
        Obj("w1", 256, "param", "fast"),
        Obj("h0", 128, "activation"),
        Obj("h1", 128, "activation"),
        Obj("loss", 8, "output"),
    )
    tasks = (
        Task("layer_0", "forward", "matmul", inputs=("x", "w0"), outputs=("h0",), cost_us=10.0),
        Task("layer_1", "forward", "matmul", inputs=("h0", "w1"), outputs=("h1",), cost_us=10.0),
        Task(
            "loss",
            "loss",
            "sum",
            inputs=("h1",),
            outputs=("loss",),
            workspace_bytes=32,
            cost_us=2.0,
        ),
    )
    return Program(name=name, objects=objects, tasks=tasks, final_locations={"loss": "fast"})


def task_footprint_bytes(program: Program, task_index: int) -> int:
    """Fast bytes task ``task_index`` needs while it runs, whatever the plan."""
    task = program.tasks[task_index]
    return sum(program.obj(obj).size_bytes for obj in task.uses) + task.workspace_bytes


def largest_footprint_bytes(program: Program) -> int:
    """No plan fits a budget below this: the biggest single task's footprint."""
    return max(task_footprint_bytes(program, index) for index in range(len(program.tasks)))


def keep_all_bytes(program: Program) -> int:
    """A budget that holds every object at once plus the largest workspace."""
    workspace_bytes = max((task.workspace_bytes for task in program.tasks), default=0)
    return sum(obj.size_bytes for obj in program.objects) + workspace_bytes
