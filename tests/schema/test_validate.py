"""validate() returns every structural problem at once, each naming its task and object."""

from __future__ import annotations

from pathlib import Path

from dataflow.schema import (
    Budget,
    Link,
    Links,
    Obj,
    Program,
    Prologue,
    Task,
    TensorMeta,
    validate,
)

GOLDEN = Path(__file__).parent / "golden" / "two_layer_chain.json"


def _codes(program: Program) -> list[tuple[str, str | None, str | None]]:
    return [(p.code, p.task, p.obj) for p in validate(program)]


def _chain(*tasks: Task, objects=None, **fields) -> Program:
    objects = objects or (
        Obj("w", 100, "param", "slow"),
        Obj("x", 10, "data", "fast"),
        Obj("y", 10, "activation"),
        Obj("z", 10, "activation"),
    )
    return Program(name="t", objects=objects, tasks=tasks, **fields)


def test_a_program_without_tasks_is_a_problem() -> None:
    """(Read from a file it is refused sooner, as a schema error: test_program_file.py.)"""
    assert _codes(_chain()) == [("no-tasks", None, None)]


def test_a_valid_chain_has_no_problem() -> None:
    program = _chain(
        Task("a", "k", "k", inputs=("x", "w"), outputs=("y",), releases=("x",)),
        Task("b", "k", "k", inputs=("y",), outputs=("z",), releases=("y",), offloads=("z",)),
        final_locations={"z": "slow"},
        budget=Budget(fast_bytes=1000),
    )
    assert validate(program) == []


def test_use_before_definition_names_task_object_and_creator() -> None:
    program = _chain(
        Task("a", "k", "k", inputs=("z",), outputs=("y",)),
        Task("b", "k", "k", inputs=("y",), outputs=("z",)),
    )
    (problem,) = validate(program)
    assert (problem.code, problem.task, problem.obj) == ("use-before-definition", "a", "z")
    assert "before task 'b' creates it" in problem.message


def test_output_that_already_exists() -> None:
    program = _chain(
        Task("a", "k", "k", inputs=("x",), outputs=("y",)),
        Task("b", "k", "k", inputs=("x",), outputs=("y",)),
    )
    assert _codes(program) == [("output-exists", "b", "y")]


def test_outputting_an_object_present_at_start_is_reported_once_created_twice() -> None:
    # 'x' is created by task a, so it does not exist at start; creating it again is the fault.
    program = _chain(
        Task("a", "k", "k", outputs=("x",)),
        Task("b", "k", "k", inputs=("w",), outputs=("x",)),
    )
    assert _codes(program) == [("output-exists", "b", "x")]


def test_directives_on_objects_the_task_cannot_see() -> None:
    program = _chain(
        Task("a", "k", "k", inputs=("x",), outputs=("y",), prefetches=("z", "nope")),
        Task("b", "k", "k", inputs=("y",), outputs=("z",), releases=("y",), offloads=("y",)),
    )
    assert _codes(program) == [
        ("directive-not-visible", "a", "z"),
        ("directive-unknown-object", "a", "nope"),
        ("directive-conflict", "b", "y"),
    ]


def test_sizes_tensor_metadata_and_numbers() -> None:
    program = _chain(
        Task(
            "a", "k", "k", inputs=("x",), outputs=("y",), workspace_bytes=-1, cost_us=float("nan")
        ),
        objects=(
            Obj("x", 0, "data", "fast"),
            Obj("y", 12, "activation", tensor=TensorMeta("bfloat16", (2, 2))),
        ),
        links=Links(h2d=Link(0.0), d2h=Link(1.0, latency_us=-2.0)),
        budget=Budget(fast_bytes=0, slow_bytes=-1),
    )
    codes = [p.code for p in validate(program)]
    assert codes == ["size", "tensor-size", "link", "link", "budget", "budget", "workspace", "cost"]
    messages = "\n".join(p.message for p in validate(program))
    assert "object 'y': tensor bfloat16[2, 2] holds 8 bytes but size_bytes is 12" in messages
    assert "links.h2d.bw_bytes_per_us must be a positive number" in messages


def test_budget_checks_wait_for_a_sane_budget() -> None:
    # A budget that is itself wrong is reported once, not again through every task.
    program = _chain(
        Task("a", "k", "k", inputs=("x",), outputs=("y",)),
        final_locations={"y": "slow"},
        budget=Budget(fast_bytes=0, slow_bytes=-1),
    )
    assert [p.code for p in validate(program)] == ["budget", "budget"]


def test_unknown_and_repeated_objects_in_a_task() -> None:
    program = _chain(Task("a", "k", "k", inputs=("x", "ghost"), mutates=("x",), outputs=("y",)))
    assert _codes(program) == [
        ("repeated-use", "a", "x"),
        ("unknown-object", "a", "ghost"),
    ]


def test_duplicate_ids() -> None:
    program = _chain(
        Task("a", "k", "k", inputs=("x",), outputs=("y",)),
        Task("a", "k", "k", inputs=("y",), outputs=("z",)),
        objects=(
            Obj("x", 1, "data", "fast"),
            Obj("x", 1, "data"),
            Obj("y", 1, "activation"),
            Obj("z", 1, "activation"),
        ),
    )
    assert ("duplicate-object", None, "x") in _codes(program)
    assert ("duplicate-task", "a", None) in _codes(program)


def test_footprint_over_budget_names_the_task() -> None:
    program = _chain(
        Task("a", "k", "k", inputs=("x", "w"), outputs=("y",), workspace_bytes=5),
        budget=Budget(fast_bytes=100),
    )
    (problem,) = validate(program)
    assert (problem.code, problem.task) == ("footprint", "a")
    assert "needs 125 bytes" in problem.message and "budget.fast_bytes is 100" in problem.message


def test_final_locations_that_cannot_hold() -> None:
    program = _chain(
        Task("a", "k", "k", inputs=("x",), outputs=("y",)),
        final_locations={"w": "fast", "y": "fast", "ghost": "slow"},
        budget=Budget(fast_bytes=105, slow_bytes=10**6),
    )
    assert _codes(program) == [
        ("final-unknown-object", None, "ghost"),
        ("final-fast-overflow", None, None),
    ]


def test_all_problems_come_at_once() -> None:
    program = Program.from_json(GOLDEN)
    broken = Program(
        name=program.name,
        objects=program.objects,
        tasks=(
            Task("t0", "k", "k", inputs=("y_0",), outputs=("y_1",)),
            Task("t1", "k", "k", inputs=("nobody",), outputs=("y_0", "y_1"), releases=("also",)),
        ),
        final_locations={"gone": "slow"},
    )
    assert [p.code for p in validate(broken)] == [
        "use-before-definition",
        "unknown-object",
        "output-exists",
        "directive-unknown-object",
        "final-unknown-object",
    ]


def test_prologue_directives_are_checked_like_a_tasks() -> None:
    program = _chain(
        Task("a", "k", "k", inputs=("x", "w"), outputs=("y",)),
        prologue=Prologue(releases=("x",), offloads=("q",), prefetches=("w", "y", "x")),
    )
    assert _codes(program) == [
        ("directive-unknown-object", "<prologue>", "q"),
        ("directive-not-visible", "<prologue>", "y"),
        ("directive-conflict", "<prologue>", "x"),
    ]
    assert "the prologue: prefetch 'y'" in validate(program)[1].message


def test_persistent_objects_exist_at_start_and_are_named_once() -> None:
    program = _chain(
        Task("a", "k", "k", inputs=("x", "w"), outputs=("y",)),
        persistent=("w", "w", "y", "nope"),
    )
    assert _codes(program) == [
        ("duplicate-persistent", None, "w"),
        ("persistent-created", None, "y"),
        ("persistent-unknown-object", None, "nope"),
    ]


def test_no_task_may_take_the_prologues_name() -> None:
    program = _chain(Task("<prologue>", "k", "k", inputs=("x",)))
    assert ("reserved-task-id", "<prologue>", None) in _codes(program)
