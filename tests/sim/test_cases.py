"""Hand-computed runs, one rule of docs/execution_model.md each, and every failure kind.

Links throughout: h2d takes ``1 + size / 10`` us, d2h ``size / 5`` us.
"""

from __future__ import annotations

import pytest

from dataflow.schema import Budget, Link, Links, Location, Obj, Program, Role, Task
from dataflow.sim import FailureKind, InvalidProgramError, simulate

LINKS = Links(h2d=Link(10.0, 1.0), d2h=Link(5.0, 0.0))


def obj(name: str, size: int, where: str = "slow") -> Obj:
    return Obj(name, size, Role.DATA, Location(where))


def task(name: str, cost_us: float, **fields) -> Task:
    return Task(name, "k", "k", cost_us=cost_us, **fields)


def program(objects, tasks, *, budget=None, finals=None, slow_budget=None) -> Program:
    return Program(
        name="case",
        objects=objects,
        tasks=tasks,
        final_locations=finals or {},
        budget=None if budget is None else Budget(budget, slow_budget),
        links=LINKS,
    )


def spans(result) -> list[tuple]:
    return [(t.task_id, t.start_us, t.end_us) for t in result.tasks]


def moves(result) -> list[tuple]:
    return [(t.obj_id, t.direction, t.enqueue_us, t.start_us, t.end_us) for t in result.transfers]


def test_prefetch_waits_for_room_and_a_task_reserves_first() -> None:
    # At 16 both t1 (reserving b) and W2 could take memory; t1 goes first (tie order),
    # after which W2 no longer fits (120 + 100 > 215) and waits for t1's release at 36.
    result = simulate(
        program(
            [obj("a", 10, "fast"), obj("W1", 100), obj("W2", 100), obj("b", 10), obj("c", 10)],
            [
                task("t0", 5, inputs=["a"], prefetches=["W1", "W2"]),
                task("t1", 20, inputs=["a", "W1"], outputs=["b"], releases=["W1"]),
                task("t2", 10, inputs=["b", "W2"], outputs=["c"], releases=["W2", "b"]),
            ],
            budget=215,
        )
    )
    assert result.valid
    assert spans(result) == [("t0", 0, 5), ("t1", 16, 36), ("t2", 47, 57)]
    assert moves(result) == [("W1", "h2d", 5, 5, 16), ("W2", "h2d", 5, 36, 47)]
    assert result.transfers[1].wait_us == 31
    assert result.fast_memory == (
        (0, 10), (5, 110), (16, 120), (36, 20), (36, 120), (47, 130), (57, 20),
    )  # fmt: skip
    assert result.fast_peak_bytes == 130 and result.makespan_us == 57


def test_clean_release_and_clean_offload_move_nothing() -> None:
    result = simulate(
        program(
            [obj("a", 10, "fast"), obj("W", 100)],
            [
                task("t0", 5, inputs=["a"], prefetches=["W"]),
                task("t1", 10, inputs=["a", "W"], releases=["W"]),  # clean: dropped, no d2h
                task("t2", 10, inputs=["a"], prefetches=["W"]),  # the slow copy is current
                task("t3", 10, inputs=["a", "W"], offloads=["W"]),  # clean: dropped at once
            ],
            finals={"W": "slow"},
        )
    )
    assert result.valid
    assert spans(result) == [("t0", 0, 5), ("t1", 16, 26), ("t2", 26, 36), ("t3", 47, 57)]
    assert [t.direction for t in result.transfers] == ["h2d", "h2d"]
    assert result.d2h.transfers == 0 and result.d2h.bytes == 0
    assert result.fast_memory == ((0, 10), (5, 110), (26, 10), (36, 110), (57, 10))
    assert result.makespan_us == 57


def test_a_task_waits_for_an_object_coming_back_from_an_offload() -> None:
    # y leaves (d2h 10-20) and the prefetch of it waits for its slow copy to be current.
    result = simulate(
        program(
            [obj("a", 10, "fast"), obj("y", 50)],
            [
                task("t0", 10, inputs=["a"], outputs=["y"], offloads=["y"]),
                task("t1", 1, inputs=["a"], prefetches=["y"]),
                task("t2", 1, mutates=["y"], offloads=["y"]),  # dirty again: written back
            ],
            finals={"y": "slow"},
        )
    )
    assert result.valid
    assert moves(result) == [
        ("y", "d2h", 10, 10, 20),
        ("y", "h2d", 11, 20, 26),
        ("y", "d2h", 27, 27, 37),
    ]
    assert result.makespan_us == 37  # the run ends when the last write-back ends
    assert result.slow_peak_bytes == 50  # y's slow space is reserved once, kept


def test_zero_cost_tasks_run_at_one_instant_in_chain_order() -> None:
    result = simulate(
        program(
            [obj("a", 10, "fast")],
            [task(f"t{i}", 0, inputs=["a"]) for i in range(3)] + [task("t3", 2, inputs=["a"])],
        )
    )
    assert spans(result) == [("t0", 0, 0), ("t1", 0, 0), ("t2", 0, 0), ("t3", 0, 2)]


def test_workspace_is_held_from_start_to_end() -> None:
    result = simulate(
        program(
            [obj("a", 10, "fast"), obj("b", 10)],
            [task("t0", 4, inputs=["a"], outputs=["b"], workspace_bytes=30)],
        )
    )
    assert result.fast_memory == ((0, 10), (0, 50), (4, 20))
    assert result.fast_peak_bytes == 50


def test_use_after_a_dirty_release_is_an_error_naming_both_tasks() -> None:
    result = simulate(
        program(
            [obj("a", 10, "fast"), obj("b", 10, "fast")],
            [
                task("t0", 5, inputs=["b"], mutates=["a"], releases=["a"]),
                task("t1", 5, inputs=["a"]),
            ],
        )
    )
    assert not result.valid
    error = result.error
    assert error.kind is FailureKind.LOST
    assert (error.task, error.objects, error.time_us) == ("t1", ("a",), 5)
    assert "'t0'" in error.message and "dirty" in error.message
    assert error.resident == ("b",) and error.fast_bytes_in_use == 10


def test_final_location_violations_are_listed() -> None:
    result = simulate(
        program(
            [obj("a", 10, "fast"), obj("W", 20), obj("y", 10)],
            [task("t0", 5, inputs=["a"], outputs=["y"], releases=["y"])],
            finals={"W": "fast", "y": "slow", "a": "fast"},
        )
    )
    error = result.error
    assert error.kind is FailureKind.FINAL_LOCATION
    assert error.objects == ("W", "y") and error.time_us == 5
    assert "'W' should end in fast memory" in error.message
    assert "'y' should end in slow memory but has no slow copy" in error.message
    assert "dropped dirty by task 't0'" in error.message


def test_use_of_an_object_nothing_brings_in_fails_at_once() -> None:
    result = simulate(
        program([obj("a", 10, "fast"), obj("W", 20)], [task("t0", 5, inputs=["a", "W"])])
    )
    assert result.error.kind is FailureKind.NOT_RESIDENT
    assert (result.error.task, result.error.objects, result.error.time_us) == ("t0", ("W",), 0)


def test_use_while_offload_pending_without_prefetch_fails() -> None:
    result = simulate(
        program(
            [obj("a", 10, "fast"), obj("y", 10)],
            [
                task("t0", 5, inputs=["a"], outputs=["y"], offloads=["y"]),
                task("t1", 5, inputs=["y"]),
            ],
        )
    )
    assert result.error.kind is FailureKind.NOT_RESIDENT and result.error.objects == ("y",)


@pytest.mark.parametrize(
    ("directives", "kind", "words"),
    [
        ({"releases": ["W"]}, FailureKind.RELEASE_NOT_RESIDENT, "not in fast memory"),
        ({"offloads": ["W"]}, FailureKind.OFFLOAD_NOT_RESIDENT, "not in fast memory"),
        ({"prefetches": ["a"]}, FailureKind.PREFETCH_RESIDENT, "already resident"),
        ({"prefetches": ["y"]}, FailureKind.PREFETCH_NO_SLOW_COPY, "no slow copy"),
    ],
)
def test_directive_errors(directives: dict, kind: FailureKind, words: str) -> None:
    result = simulate(
        program(
            [obj("a", 10, "fast"), obj("W", 20), obj("y", 10)],
            [
                task("t0", 5, inputs=["a"], outputs=["y"], releases=["y"]),  # y: dropped dirty
                task("t1", 5, inputs=["a"], **directives),
            ],
        )
    )
    assert result.error.kind is kind
    assert result.error.task == "t1" and result.error.time_us == 10
    assert words in result.error.message


def test_double_prefetch_and_release_of_a_leaving_object_are_errors() -> None:
    double = simulate(
        program(
            [obj("a", 10, "fast"), obj("W", 20)],
            [task("t0", 1, inputs=["a"], prefetches=["W"]), task("t1", 1, prefetches=["W"])],
        )
    )
    assert double.error.kind is FailureKind.PREFETCH_RESIDENT
    assert "already queued" in double.error.message or "already resident" in double.error.message
    leaving = simulate(
        program(
            [obj("a", 10, "fast"), obj("y", 1000)],
            [
                task("t0", 1, inputs=["a"], outputs=["y"], offloads=["y"]),
                task("t1", 1, inputs=["a"], releases=["y"]),
            ],
        )
    )
    assert leaving.error.kind is FailureKind.RELEASE_NOT_RESIDENT
    assert "offload is still pending" in leaving.error.message


def test_budget_failures() -> None:
    objects = [obj("a", 10, "fast"), obj("W", 100), obj("y", 50)]
    footprint = simulate(
        program(objects, [task("t0", 1, inputs=["a"], outputs=["y"], workspace_bytes=45)]),
        budget_bytes=100,
    )
    assert footprint.error.kind is FailureKind.FOOTPRINT and footprint.error.task == "t0"
    too_large = simulate(
        program(objects, [task("t0", 1, inputs=["a"], prefetches=["W"])]), budget_bytes=99
    )
    assert too_large.error.kind is FailureKind.TRANSFER_TOO_LARGE
    initial = simulate(program(objects, [task("t0", 1, inputs=["a"])]), budget_bytes=9)
    assert initial.error.kind is FailureKind.INITIAL_OVERFLOW and initial.makespan_us == 0
    slow = simulate(
        program(objects, [task("t0", 1, inputs=["a"], outputs=["y"], offloads=["y"])]),
        slow_budget_bytes=120,
    )
    assert slow.error.kind is FailureKind.SLOW_BUDGET and slow.error.objects == ("y",)
    assert "100 of the slow budget 120" in slow.error.message


def test_budget_argument_overrides_the_programs_budget() -> None:
    case = program(
        [obj("a", 10, "fast"), obj("W1", 100), obj("W2", 100)],
        [task("t0", 5, inputs=["a"], prefetches=["W1", "W2"]), task("t1", 1, inputs=["W2"])],
        budget=150,
    )
    assert simulate(case).error.kind is FailureKind.DEADLOCK
    wide = simulate(case, budget_bytes=300)
    assert wide.valid and wide.fast_budget_bytes == 300 and wide.fast_peak_bytes == 210
    unbounded = simulate(case.bare().with_budget(10**9))
    assert unbounded.error.kind is FailureKind.NOT_RESIDENT


def test_deadlock_after_the_last_task_names_the_stuck_prefetch() -> None:
    result = simulate(
        program(
            [obj("a", 10, "fast"), obj("W", 100)],
            [task("t0", 5, inputs=["a"], prefetches=["W"])],
            budget=50,
        ),
    )
    # W fits nowhere: that is caught when it is enqueued.
    assert result.error.kind is FailureKind.TRANSFER_TOO_LARGE
    stuck = simulate(
        program(
            [obj("a", 40, "fast"), obj("W", 20)],
            [task("t0", 5, inputs=["a"], prefetches=["W"])],
            budget=50,
        ),
    )
    assert stuck.error.kind is FailureKind.DEADLOCK
    assert stuck.error.task is None and stuck.error.objects == ("W",)
    assert stuck.deadlock is stuck.error


def test_structural_problems_raise_listing_all_of_them() -> None:
    bad = program(
        [obj("a", 0, "fast")],
        [task("t0", 1, inputs=["a", "ghost"]), task("t0", 1)],
    )
    with pytest.raises(InvalidProgramError) as caught:
        simulate(bad)
    codes = {problem.code for problem in caught.value.problems}
    assert {"size", "unknown-object", "duplicate-task"} <= codes
    assert "not structurally valid" in str(caught.value)


def test_budget_dependent_problems_are_run_failures_not_exceptions() -> None:
    over = program(
        [obj("a", 10, "fast"), obj("b", 100)],
        [task("t0", 1, inputs=["a"], outputs=["b"])],
        budget=50,
    )
    result = simulate(over)
    assert result.error.kind is FailureKind.FOOTPRINT
    assert simulate(over, budget_bytes=200).valid


def test_to_timeline_and_chrome_trace(tmp_path) -> None:
    case = program(
        [obj("a", 10, "fast"), obj("y", 50)],
        [
            task("t0", 10, inputs=["a"], outputs=["y"], offloads=["y"]),
            task("t1", 5, inputs=["a"], prefetches=["y"]),
            task("t2", 10, inputs=["y"], releases=["y"]),
        ],
    )
    result = simulate(case)
    timeline = result.to_timeline()
    assert timeline.name == "case (predicted)"
    assert [span.task_id for span in timeline.tasks] == ["t0", "t1", "t2"]
    assert timeline.tasks[0].args["outputs"] == {"y": 50}
    assert [(t.direction, t.enqueued_by) for t in timeline.transfers] == [
        ("d2h", "t0"),
        ("h2d", "t1"),
    ]
    assert [c.name for c in timeline.counters] == ["fast memory", "slow memory"]
    document = result.to_chrome_trace(tmp_path / "trace.json", name="mine")
    assert (tmp_path / "trace.json").exists()
    assert document["traceEvents"][0]["args"] == {"name": "mine"}
    with pytest.raises(ValueError, match="record=False"):
        simulate(case, record=False).to_timeline()
