"""Residency intervals: uses (virtual ones included), dirtiness, gaps and base bytes."""

from __future__ import annotations

from dataflow.planning import plan
from dataflow.planning.intervals import (
    Origin,
    build_chain,
    build_gaps,
    kept_profile,
    no_offload_peak_bytes,
)
from dataflow.schema import Location, Obj, Program, Task
from dataflow.testing.shapes import MiB, tiny_streaming, tiny_training


def _life(chain, obj_id):
    (life,) = [life for life in chain.objects if life.obj_id == obj_id]
    return life


def test_uses_and_dirtiness_follow_the_chain() -> None:
    chain = build_chain(tiny_training())
    w0 = _life(chain, "W0")
    assert (w0.origin, w0.uses, w0.dirties, w0.final) == (
        Origin.SLOW,
        (1, 4, 5),
        (False, False, True),
        Location.SLOW,
    )
    h0 = _life(chain, "h0")
    assert (h0.origin, h0.uses, h0.dirties) == (Origin.CREATED, (0, 1, 4), (True, False, False))


def test_a_fast_object_is_used_at_task_0_and_a_final_fast_one_at_the_end() -> None:
    chain = build_chain(tiny_streaming(3))
    x = _life(chain, "x")
    assert (x.origin, x.uses, x.dirties) == (Origin.FAST, (0,), (True,))
    out = _life(chain, "h3")
    assert out.uses == (3, 4) and chain.n_tasks == 4  # created by layer2, kept to the end


def test_base_bytes_hold_uses_workspace_and_virtual_uses() -> None:
    chain = build_chain(tiny_streaming(3))
    assert chain.base_bytes[0] == 2 * MiB  # x and h0
    assert chain.base_bytes[1] == 10 * MiB  # h0, W0, h1
    assert chain.base_bytes[4] == 1 * MiB  # the end: h3 stays
    assert chain.footprint_bytes == (2 * MiB, 10 * MiB, 10 * MiB, 10 * MiB)


def test_gaps_and_the_kept_profile() -> None:
    chain = build_chain(tiny_training())
    gaps = build_gaps(chain)
    w0 = _life(chain, "W0")
    first = gaps.first_gap[w0.index]
    assert [(gaps.a[g], gaps.b[g]) for g in (first, first + 1)] == [(1, 4), (4, 5)]
    kept = kept_profile(chain, gaps)
    # W0 is kept through tasks 2 and 3; cutting its first gap removes it there.
    cut = [False] * len(gaps.obj)
    cut[first] = True
    without = kept_profile(chain, gaps, cut)
    assert [k - w for k, w in zip(kept, without, strict=True)] == [
        0,
        0,
        4 * MiB,
        4 * MiB,
        0,
        0,
        0,
        0,
    ]
    assert no_offload_peak_bytes(chain) == max(
        b + k for b, k in zip(chain.base_bytes, kept, strict=True)
    )


def test_a_slow_object_the_first_task_needs_is_fetched_by_the_prologue() -> None:
    program = Program(
        "early",
        [Obj("w", 8, "param", "slow"), Obj("y", 8, "activation")],
        [Task("t0", "k", "k", inputs=("w",), outputs=("y",), cost_us=1.0)],
    )
    assert build_chain(program).objects[0].uses == (0,)
    planned = plan(program, 16)
    assert planned.program.prologue.prefetches == ("w",)
    assert planned.sim.valid and planned.sim.tasks[0].start_us == program.links.h2d.transfer_us(8)
