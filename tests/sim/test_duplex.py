"""The shared link (docs/execution_model.md#links), worked by hand.

Both directions: 10 bytes/us alone, 2 us latency; both at once: 10 bytes/us in total, so
5 each. tests/sim/golden/duplex.json has a transfer that starts while the other is in
flight; here both start together, and a link without a duplex limit stays as it was.
"""

from __future__ import annotations

import random

import attrs
import pytest
from hypothesis import given, settings

from dataflow.engine import Engine
from dataflow.planning import lower_bound, plan
from dataflow.planning.intervals import build_chain, no_offload_peak_bytes
from dataflow.schema import Link, Links, Obj, Program, Task
from dataflow.sim import simulate
from dataflow.testing import shapes, strategies

LINK = Link(bw_bytes_per_us=10.0, latency_us=2.0)
SHARED = Links(h2d=LINK, d2h=LINK, duplex_bytes_per_us=10.0)


def swap(links: Links) -> Program:
    """t0 ends at 1 writing A (100 bytes) back and fetching B (200 bytes); t1 needs B."""
    return Program(
        name="swap",
        objects=(
            Obj("x", 10, "data", "fast"),
            Obj("A", 100, "activation", "fast"),
            Obj("B", 200, "param", "slow"),
        ),
        tasks=(
            Task(
                "t0",
                "k",
                "k",
                inputs=("x",),
                mutates=("A",),
                cost_us=1.0,
                offloads=("A",),
                prefetches=("B",),
            ),
            Task("t1", "k", "k", inputs=("x", "B"), cost_us=1.0),
        ),
        links=links,
    )


def spans(result) -> dict[str, tuple[float, float]]:
    return {t.obj_id: (t.start_us, t.end_us) for t in result.transfers}


def test_both_directions_at_once_share_the_duplex_rate() -> None:
    """Both start at 1 and move bytes from 3 at 5/us: A's 100 bytes are done at 23, B has
    100 of its 200 left, which then go alone at 10/us: 33. t1 runs 33-34."""
    result = simulate(swap(SHARED))
    assert result.valid
    assert spans(result) == {"A": (1.0, 23.0), "B": (1.0, 33.0)}
    assert result.makespan_us == 34.0
    assert result.links["d2h"].busy_us == 22.0 and result.links["h2d"].busy_us == 32.0


def test_without_a_duplex_limit_each_direction_runs_alone() -> None:
    """The same program without the limit (or with one at the sum of the two): A takes
    2 + 100/10, B 2 + 200/10, side by side."""
    for links in (Links(h2d=LINK, d2h=LINK), attrs.evolve(SHARED, duplex_bytes_per_us=20.0)):
        result = simulate(swap(links))
        assert spans(result) == {"A": (1.0, 13.0), "B": (1.0, 23.0)}
        assert result.makespan_us == 24.0


def test_a_transfer_alone_is_not_slowed() -> None:
    """One direction at a time (B comes in only after A is out): solo rates, limit or not."""
    program = swap(SHARED)
    t0, t1 = program.tasks
    program = attrs.evolve(
        program,
        tasks=(
            attrs.evolve(t0, prefetches=()),
            Task("wait", "k", "k", inputs=("x",), cost_us=12.0, prefetches=("B",)),
            t1,
        ),
    )
    result = simulate(program)
    assert spans(result) == {"A": (1.0, 13.0), "B": (13.0, 35.0)}
    assert result.makespan_us == 36.0


def test_the_virtual_engine_shares_the_link_the_same_way() -> None:
    engine = Engine("virtual")
    engine.load(swap(SHARED))
    trace = engine.run().steps[0]
    assert {t.obj: (t.start_us, t.end_us) for t in trace.transfers} == spans(simulate(swap(SHARED)))
    assert trace.makespan_us == 34.0


@pytest.mark.parametrize(
    ("h2d", "d2h", "duplex", "shared"),
    [
        (55.0, 55.0, 99.0, (49.5, 49.5)),  # the H200: half each
        (30.0, 60.0, 80.0, (30.0, 50.0)),  # the slow one keeps its rate, the rest to the other
        (60.0, 30.0, 80.0, (50.0, 30.0)),
        (30.0, 60.0, 50.0, (25.0, 25.0)),  # both above half: half each
        (30.0, 60.0, 90.0, (30.0, 60.0)),  # no limit in practice
        (30.0, 60.0, None, (30.0, 60.0)),
    ],
)
def test_the_duplex_total_is_split_max_min_fairly(h2d, d2h, duplex, shared) -> None:
    links = Links(h2d=Link(h2d), d2h=Link(d2h), duplex_bytes_per_us=duplex)
    assert links.shared_bw == shared
    assert links.duplex_limited is (shared != (h2d, d2h))


def test_a_bad_duplex_rate_is_named() -> None:
    with pytest.raises(ValueError, match=r"links.duplex_bytes_per_us must be > 0"):
        Links(duplex_bytes_per_us=0.0)


def _overlap(result) -> bool:
    """Whether an h2d and a d2h transfer were ever in flight at once."""
    h2d = [(t.start_us, t.end_us) for t in result.transfers if t.direction == "h2d"]
    d2h = [(t.start_us, t.end_us) for t in result.transfers if t.direction == "d2h"]
    return any(a < d and c < b for a, b in h2d for c, d in d2h)


@settings(max_examples=150, deadline=None)
@given(strategies.annotated_chains())
def test_a_limit_changes_nothing_when_the_directions_never_overlap(program: Program) -> None:
    """Solo transfers are priced exactly as before: a run in which no h2d and d2h
    transfers overlap is identical with a duplex limit."""
    alone = simulate(program)
    if not alone.valid or _overlap(alone):
        return
    links = program.links
    limited = simulate(
        attrs.evolve(
            program,
            links=attrs.evolve(
                links,
                duplex_bytes_per_us=(links.h2d.bw_bytes_per_us + links.d2h.bw_bytes_per_us) / 3,
            ),
        )
    )
    assert limited.transfers == alone.transfers
    assert limited.tasks == alone.tasks
    assert limited.makespan_us == alone.makespan_us


@settings(max_examples=100, deadline=None)
@given(strategies.annotated_chains())
def test_the_lower_bounds_hold_under_a_duplex_limit(program: Program) -> None:
    """The planner's bounds price every transfer at its direction's own rate; a shared
    link only slows transfers, so no run beats them, however tight the limit."""
    bound = lower_bound(
        attrs.evolve(program.bare(), budget=None),
        None if program.budget is None else program.budget.fast_bytes,
    )
    for total in (1.0, 8.0, 64.0):
        links = attrs.evolve(program.links, duplex_bytes_per_us=total)
        result = simulate(attrs.evolve(program, links=links))
        assert not result.valid or result.makespan_us >= bound.best_us * (1 - 1e-12), total


def test_pressurefit_prices_its_plans_with_the_shared_link() -> None:
    """PressureFit's candidates run through the simulator's loop with the program's links,
    so the plan it returns is priced with the limit: its makespan is the simulator's with
    the limit, and longer than the same directives without it (the link-bound step writes
    back and prefetches at once)."""
    bare = shapes.training_linkbound(random.Random(0))
    links = attrs.evolve(
        bare.links,
        duplex_bytes_per_us=0.6 * (bare.links.h2d.bw_bytes_per_us + bare.links.d2h.bw_bytes_per_us),
    )
    program = attrs.evolve(bare, links=links)
    budget = (
        max(build_chain(program).base_bytes) + no_offload_peak_bytes(build_chain(program))
    ) // 2
    planned = plan(program, budget)
    assert planned.sim.valid and planned.program.links == links
    assert planned.makespan_us == simulate(planned.program).makespan_us
    alone = simulate(attrs.evolve(planned.program, links=bare.links))
    assert alone.valid and alone.makespan_us < planned.makespan_us
