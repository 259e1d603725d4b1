"""Lower bounds: hand-computed cases, and no run of any plan beats them."""

from __future__ import annotations

import attrs
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from dataflow.planning import PlanningError, lower_bound, plan
from dataflow.planning.intervals import build_chain, no_offload_peak_bytes
from dataflow.schema import Link, Links, Location, Obj, Program, Task
from dataflow.sim import simulate
from dataflow.testing.shapes import SMALL_LINKS as LINKS
from dataflow.testing.shapes import MiB, tiny_streaming
from dataflow.testing.strategies import annotated_chains, bare_chains

SETTINGS = settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])


def test_compute_bound_is_the_sum_of_costs() -> None:
    program = Program(
        "fast-only",
        [Obj("a", 8, "data", "fast"), Obj("b", 8, "activation")],
        [
            Task("t0", "k", "k", inputs=("a",), outputs=("b",), cost_us=3.0),
            Task("t1", "k", "k", inputs=("b",), cost_us=4.5),
        ],
    )
    bound = lower_bound(program)
    assert (bound.compute_us, bound.link_us, bound.volume_us, bound.handoff_us) == (
        7.5,
        7.5,
        0.0,
        0.0,
    )


def test_link_bound_counts_first_loads_from_the_start_and_final_write_backs() -> None:
    links = Links(h2d=Link(1.0, 1.0), d2h=Link(2.0, 0.0))
    program = Program(
        "loads",
        [Obj("x", 1, "data", "fast"), Obj("w", 10, "param", "slow"), Obj("v", 20, "param", "slow")],
        [
            Task("t0", "k", "k", inputs=("x",), cost_us=5.0),
            Task("t1", "k", "k", inputs=("w",), cost_us=1.0),
            Task("t2", "k", "k", mutates=("v",), cost_us=1.0),
        ],
        final_locations={"v": "slow"},
        links=links,
    )
    # The prologue can start w's load at time 0: t1 starts after t0 (5) and w's load (11):
    # 11; t2 after v's load too (21 more): 32; t2 ends at 33, v's write-back takes 10 more.
    assert lower_bound(program).link_us == 43.0


def test_volume_and_handoff_bounds_need_a_budget() -> None:
    program = tiny_streaming(4)
    assert lower_bound(program).volume_us == 0.0
    assert lower_bound(program).handoff_us == 0.0
    # At 10 MiB, each layer holds h_i, W_i and h_{i+1} (10 MiB): no room for the next
    # weights while it runs, so every W_{i+1} crosses between layers.
    bound = lower_bound(program, 10 * MiB)
    gap_us = LINKS.h2d.transfer_us(8 * MiB)
    assert bound.handoff_us == 300.0 + 4 * 500.0 + 3 * gap_us
    # the link bound adds those forced gaps to its own: no earlier than either
    assert bound.link_us >= bound.handoff_us and bound.best_us == bound.link_us
    assert bound.writeback_us == bound.link_us  # nothing dirty must make room


@SETTINGS
@given(annotated_chains())
def test_no_valid_run_of_any_plan_beats_the_lower_bound(program: Program) -> None:
    result = simulate(program)
    if not result.valid:
        return
    budget = program.budget.fast_bytes if program.budget is not None else None
    bound = lower_bound(attrs.evolve(program.bare(), budget=None), budget)
    assert result.makespan_us >= bound.best_us * (1 - 1e-12), bound


def test_final_fast_objects_that_start_slow_count_as_loads() -> None:
    program = Program(
        "final-fast",
        [Obj("x", 1, "data", "fast"), Obj("w", 10, "param", "slow")],
        [Task("t0", "k", "k", inputs=("x",), cost_us=2.0)],
        final_locations={"w": Location.FAST},
        links=Links(h2d=Link(1.0, 0.0), d2h=Link(1.0, 0.0)),
    )
    assert lower_bound(program).link_us == 10.0  # w's load, from time 0


def test_volume_bound_counts_every_peak_a_cut_cannot_serve_twice() -> None:
    """Two stretches over the budget, with a task between them that uses the objects kept
    across both: a cut relieves one stretch only, so the excess of each comes back."""
    links = Links(h2d=Link(1.0, 0.0), d2h=Link(1.0, 0.0))
    objects = [Obj("a", 10, "data", "fast"), Obj("b", 10, "data", "fast")]
    objects += [Obj("s0", 10, "activation"), Obj("s1", 10, "activation")]
    tasks = [
        Task("t0", "k", "k", inputs=("a", "b"), cost_us=1.0),
        Task("t1", "k", "k", outputs=("s0",), cost_us=1.0),  # s0 + a + b kept: 30 > 20
        Task("t2", "k", "k", inputs=("a", "b"), cost_us=1.0),
        Task("t3", "k", "k", outputs=("s1",), cost_us=1.0),  # the same again
        Task("t4", "k", "k", inputs=("a", "b"), cost_us=1.0),
    ]
    program = Program("two-peaks", objects, tasks, links=links)
    bound = lower_bound(program, 20)
    # 10 bytes leave before t1 and come back for t2; 10 more before t3, back for t4: 20 µs
    # of h2d (the largest excess alone would say 10)
    assert bound.volume_us == 20.0


def test_the_write_back_bound_counts_what_must_leave_to_make_room() -> None:
    """Three 4 MiB outputs within 8 MiB, over 1 MiB/us links without latency: A and B
    must end slow, C is read by a 10 us task. When t2 starts it holds C, so of A and B
    (dirty, still needed) at most 4 MiB can be resident: the other 4 MiB crossed d2h
    after its creator ended, and A's ends first (at 1 us), so t2 starts no sooner than
    5 us and the run ends no sooner than 16 us. Without it the bounds say 13 us (the
    compute, or t0's end plus the three write-backs; the handoff bound sees only what
    t1 leaves behind). The optimum is 16 us: write A back after t0, B while t3 runs."""
    links = Links(h2d=Link(float(MiB), 0.0), d2h=Link(float(MiB), 0.0))
    program = Program(
        "behind",
        [Obj(name, 4 * MiB, "activation") for name in "ABC"],
        [
            Task("t0", "k", "k", outputs=("A",), cost_us=1.0),
            Task("t1", "k", "k", outputs=("B",), cost_us=1.0),
            Task("t2", "k", "k", outputs=("C",), cost_us=1.0),
            Task("t3", "k", "k", inputs=("C",), cost_us=10.0),
        ],
        final_locations={"A": "slow", "B": "slow"},
        links=links,
    )
    bound = lower_bound(program, 8 * MiB)
    assert (bound.compute_us, bound.link_us, bound.handoff_us) == (13.0, 13.0, 13.0)
    assert bound.writeback_us == 16.0 and bound.best_us == 16.0
    assert lower_bound(program, 12 * MiB).writeback_us == 13.0  # room for all three
    assert lower_bound(program).writeback_us == 0.0  # needs a budget
    assert plan(program, 8 * MiB).makespan_us == 16.0


def test_the_handoff_bound_waits_for_the_write_back_that_makes_room_for_a_load() -> None:
    """t0 creates A (4 MiB, read again by t2), t1 reads B and C (3 MiB each, slow), within
    8 MiB over 1 MiB/us links without latency. While t0 runs only 4 MiB of B and C can be
    there; the last of them starts loading when all t1 reads is reserved, so only once A
    is written back: t1 starts no sooner than t0's end plus A's write-back plus one
    load, 1 + 4 + 3 = 8 us (the loads and the write-back each alone: 5 us); t2 then
    waits for A's load (4 us): 14 us, the optimum PressureFit finds (was 12 us)."""
    links = Links(h2d=Link(float(MiB), 0.0), d2h=Link(float(MiB), 0.0))
    objects = [Obj("A", 4 * MiB, "activation")]
    objects += [Obj(name, 3 * MiB, "param", "slow") for name in "BC"]
    tasks = [
        Task("t0", "k", "k", outputs=("A",), cost_us=1.0),
        Task("t1", "k", "k", inputs=("B", "C"), cost_us=1.0),
        Task("t2", "k", "k", inputs=("A",), cost_us=1.0),
    ]
    program = Program("handoff", objects, tasks, links=links)
    bound = lower_bound(program, 8 * MiB)
    assert bound.handoff_us == 3.0 + 7.0 + 4.0 and bound.best_us == 14.0
    assert plan(program, 8 * MiB).makespan_us == 14.0


def test_the_room_bound_waits_for_room_before_a_large_load() -> None:
    """A tied embedding's optimizer state (twice the embedding) at the floor budget
    (embedding + its gradient + its state): it fits only once every task before its update
    has ended (the layer's update holds its own weights and state besides the embedding
    and its gradient), so its load starts after that task, and the embedding's and the
    head's write-backs follow its update. Worked by hand: the loads the layer's update
    needs, that update, the state's load, the embedding's update, then the four
    write-backs. PressureFit's plan is 1.5 % above it; without the room bound the link
    bound is 2.4 % below the plan."""
    import random

    from dataflow.planning.intervals import build_chain
    from dataflow.planning.lower_bound import ChainBounds
    from dataflow.testing.shapes import tied_embedding

    program = tied_embedding(random.Random(0), layers=1, rounds=1)
    chain = build_chain(program)
    sizes = {obj.id: obj.size_bytes for obj in program.objects}
    cost = {task.id: task.cost_us for task in program.tasks}
    budget = sizes["W_emb"] + sizes["dW_emb"] + sizes["O_emb"]
    h2d, d2h = program.links.h2d.transfer_us, program.links.d2h.transfer_us
    before = sum(h2d(sizes[o]) for o in ("W_emb", "x_0", "W_0", "W_head", "O_0"))
    expected = (
        before
        + cost["opt_0_0_0"]
        + h2d(sizes["O_emb"])
        + cost["opt_0_0_1"]
        + sum(d2h(sizes[o]) for o in ("W_emb", "O_emb", "W_head", "O_head"))
    )
    bounds = ChainBounds(chain)
    assert bounds.at(budget).link_us == pytest.approx(expected, rel=1e-12)
    assert bounds.at(budget, rooms=False).link_us < expected * 0.995  # the room: 313 us
    planned = plan(program, budget)
    assert planned.makespan_us >= expected
    assert planned.makespan_us <= expected * 1.02
    # With the write-backs that make room: if the state's load starts after the layer's
    # update, the layer's weights and state (12 MiB) must be back in slow memory first
    # (the embedding and its gradient are the embedding update's to hold, or to load
    # again after the state: as long over the link either way). The other cases (the
    # state arriving while the layer's update holds it: the embedding or its gradient
    # must go and come back whole) give a little less, 20 us (two latencies) under the
    # plan.
    room = d2h(sizes["W_0"] + sizes["O_0"]) + h2d(sizes["O_emb"])
    after = expected - h2d(sizes["O_emb"]) + room
    assert after <= planned.makespan_us <= after + 10.0  # one latency under the plan
    writeback_us = bounds.at(budget).writeback_us
    assert expected + 500.0 < writeback_us < after  # 34.618 ms against 34.114 ms
    assert bounds.at(budget).best_us == writeback_us


def test_the_ahead_bound_counts_what_no_room_lets_arrive_early() -> None:
    """Four tasks, each reading its own 4 MiB weight from slow memory over a 1 MiB/µs
    link, the first one 100 µs long, within 8 MiB. When task 1 starts (104 µs at the
    earliest: W0's load, then task 0) it holds W1, so at most 4 MiB of W2 and W3 can be
    resident or arriving: the other 4 MiB crosses after that, so task 3 starts no sooner
    than 108 µs and the run ends no sooner than 109 µs (without the room, loads done
    during task 0: 107 µs). The optimum is 113 µs: W2 can only start once task 0 frees
    W0, and W3 once task 1 frees W1 and W2 is in; PressureFit finds it."""
    links = Links(h2d=Link(float(MiB), 0.0), d2h=Link(float(MiB), 0.0))
    program = Program(
        "ahead",
        [Obj(f"W{i}", 4 * MiB, "param", "slow") for i in range(4)],
        [
            Task(f"t{i}", "k", "k", inputs=(f"W{i}",), cost_us=100.0 if i == 0 else 1.0)
            for i in range(4)
        ],
        links=links,
    )
    assert lower_bound(program).link_us == 107.0
    assert lower_bound(program, 8 * MiB).link_us == 109.0
    assert plan(program, 8 * MiB).makespan_us == 113.0


@settings(max_examples=80, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    bare_chains(first_task_fast=False, max_tasks=12),
    st.floats(min_value=0.0, max_value=1.0),
)
def test_no_plan_pressurefit_finds_beats_the_lower_bound(program: Program, share: float) -> None:
    """PressureFit's plans, at budgets from the largest base to the no-offload peak."""
    chain = build_chain(program)
    floor = max(chain.base_bytes, default=1)
    budget = max(1, int(floor + share * (max(floor, no_offload_peak_bytes(chain)) - floor)))
    try:
        planned = plan(program, budget)
    except PlanningError:
        return
    bound = lower_bound(program.bare(), budget)
    assert bound.writeback_us >= bound.link_us  # the link bound's timeline and more
    assert planned.makespan_us >= bound.best_us * (1 - 1e-12), bound
