"""Directives from decisions: the largest-first order of a task's final write-backs."""

from __future__ import annotations

import random

from dataflow.planning.emit import annotate, directives, largest_first, reannotate
from dataflow.planning.intervals import build_chain, build_gaps
from dataflow.planning.prefetch import place_prefetches
from dataflow.schema import Link, Links, Location, Obj, Program, Task
from dataflow.sim import simulate
from dataflow.testing.shapes import training_linkbound

LINKS = Links(h2d=Link(1.0, 0.0), d2h=Link(1.0, 0.0))


def _emitted(program: Program, cut: tuple[bool, ...] | None = None):
    chain = build_chain(program)
    gaps = build_gaps(chain)
    cut = cut if cut is not None else tuple(False for _ in gaps.obj)
    placement = place_prefetches(chain, gaps, cut, 10**12)
    return chain, directives(chain, gaps, cut, placement)


def test_final_write_backs_go_largest_first_after_the_others() -> None:
    """``t1`` changes ``s`` and writes it back (cut: needed again by ``t3``) and, finally,
    the small ``w`` and the large ``o``: the cut's write-back stays first, then ``o``,
    then ``w``."""
    objects = [
        Obj("w", 2, "param", "slow"),
        Obj("o", 8, "opt_state", "slow"),
        Obj("s", 4, "activation"),
    ]
    tasks = [
        Task("t0", "k", "k", outputs=("s",), cost_us=1.0),
        Task("t1", "k", "k", mutates=("s", "w", "o"), cost_us=1.0),
        Task("t2", "k", "k", cost_us=1.0),
        Task("t3", "k", "k", mutates=("s",), cost_us=1.0),
    ]
    final = {"w": Location.SLOW, "o": Location.SLOW, "s": Location.SLOW}
    program = Program("orders", objects, tasks, final_locations=final, links=LINKS)
    chain = build_chain(program)
    gaps = build_gaps(chain)
    s = next(life.index for life in chain.objects if life.obj_id == "s")
    cut = tuple(gaps.obj[g] == s and gaps.a[g] == 1 for g in range(len(gaps.obj)))  # after t1
    placement = place_prefetches(chain, gaps, cut, 10**12)
    found = directives(chain, gaps, cut, placement)
    ids = [life.obj_id for life in chain.objects]
    assert [ids[o] for o in found.offloads[1]] == ["s", "w", "o"]  # object order
    reordered, changed = largest_first(chain, found)
    assert changed == (1,)
    assert [ids[o] for o in reordered.offloads[1]] == ["s", "o", "w"]
    assert reordered.releases == found.releases and reordered.prefetches == found.prefetches
    planned = annotate(chain, found, 100)
    again = reannotate(planned, chain, reordered, changed)
    assert again.tasks[1].offloads == ("s", "o", "w")
    assert [task for k, task in enumerate(again.tasks) if k != 1] == [
        task for k, task in enumerate(planned.tasks) if k != 1
    ]
    assert simulate(again).valid and simulate(planned).valid


def test_reordering_sorts_each_changed_task_and_then_changes_nothing() -> None:
    """On a training step (weights before their larger optimizer state in object order)
    every changed task ends largest first; reordering that again changes no task."""
    program = training_linkbound(random.Random(0))
    chain, found = _emitted(program)
    for t, listed in enumerate(found.offloads):
        finals = [o for o in listed if found.tails.get(o) == t]
        sizes = [chain.objects[o].size_bytes for o in finals]
        if sizes != sorted(sizes, reverse=True):
            break
    else:
        raise AssertionError("expected a task with final write-backs out of size order")
    reordered, changed = largest_first(chain, found)
    assert changed and all(
        [chain.objects[o].size_bytes for o in reordered.offloads[t] if found.tails.get(o) == t]
        == sorted(
            (chain.objects[o].size_bytes for o in found.offloads[t] if found.tails.get(o) == t),
            reverse=True,
        )
        for t in changed
    )
    same, none = largest_first(chain, reordered)
    assert none == () and same is reordered
