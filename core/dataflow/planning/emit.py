"""Directives from decisions: the annotated program for a set of cuts and prefetch issues.

Per object, in use order, tracking whether its fast copy is dirty (no current slow copy):

- after a use followed by a cut gap: ``offload`` when dirty (the copy that comes back is
  clean), else ``release``; the gap's prefetch is issued where the placement put it;
- after its last use: nothing when its final location is ``fast``; ``offload`` when it is
  ``slow`` and the object is dirty; ``release`` otherwise (a dead object, or a clean one
  whose slow copy is current): dropping a dead object is free;
- an object that starts slow gets its head prefetch (from the prologue when no task ends
  early enough to hide it, or when the first task needs it).

Within a task: releases by object order; offloads by how soon the object is needed back
(final write-backs last), so the ``d2h`` FIFO serves the urgent ones first; prefetches by
deadline, then object order (the FIFO order the placement assumed).
"""

from __future__ import annotations

import attrs

from dataflow.planning.intervals import Chain, Gaps
from dataflow.planning.prefetch import PrefetchPlan
from dataflow.schema import Budget, Location, Program, Prologue


@attrs.frozen
class Directives:
    """Per task: object indices, and what the ``d2h`` link will carry. ``prefetches`` has
    one entry more than there are tasks: the last is the prologue's."""

    releases: tuple[tuple[int, ...], ...]
    offloads: tuple[tuple[int, ...], ...]
    prefetches: tuple[tuple[int, ...], ...]
    #: cut gap -> True when its object was dirty (an offload with a write-back)
    dirty_cuts: dict[int, bool]
    #: object -> task whose end issues its final write-back
    tails: dict[int, int]


def directives(chain: Chain, gaps: Gaps, cut: tuple[bool, ...], plan: PrefetchPlan) -> Directives:
    """The directives for ``cut`` and ``plan`` (a task's final write-backs in object order;
    ``largest_first`` reorders them)."""
    n = chain.n_tasks
    releases: list[list[int]] = [[] for _ in range(n)]
    offloads: list[list[tuple[int, int]]] = [[] for _ in range(n)]
    # index n: the prologue (a prefetch issued by "task -1")
    prefetches: list[list[tuple[int, int]]] = [[] for _ in range(n + 1)]
    for prefetch in plan.prefetches:
        prefetches[prefetch.issue if prefetch.issue >= 0 else n].append(
            (prefetch.use, prefetch.obj)
        )
    dirty_cuts: dict[int, bool] = {}
    tails: dict[int, int] = {}
    next_use = gaps.b
    for life in chain.objects:
        uses, dirties = life.uses, life.dirties
        if not uses:
            continue
        o = life.index
        dirty = False
        first_gap = gaps.first_gap[o]
        last = len(uses) - 1
        for k in range(last):  # the gap after each use but the last
            dirty = dirty or dirties[k]
            g = first_gap + k
            if cut[g]:
                dirty_cuts[g] = dirty
                if dirty:
                    offloads[uses[k]].append((next_use[g], o))
                else:
                    releases[uses[k]].append(o)
                dirty = False
        dirty = dirty or dirties[last]
        if life.final is Location.FAST:
            continue
        if life.final is Location.SLOW and dirty:
            offloads[uses[last]].append((n + 1, o))
            tails[o] = uses[last]
        else:
            releases[uses[last]].append(o)
    return Directives(
        releases=tuple(tuple(sorted(r)) if r else () for r in releases),
        offloads=tuple(tuple(o for _, o in sorted(off)) if off else () for off in offloads),
        prefetches=tuple(tuple(o for _, o in sorted(pre)) if pre else () for pre in prefetches),
        dirty_cuts=dirty_cuts,
        tails=tails,
    )


def largest_first(chain: Chain, found: Directives) -> tuple[Directives, tuple[int, ...]]:
    """``found`` with every task's final write-backs (written after its others) largest
    first, and the tasks whose order that changes (none: the same directives)."""
    offloads = list(found.offloads)
    changed = []
    for t in sorted(set(found.tails.values())):
        listed = offloads[t]
        finals = [o for o in listed if found.tails.get(o) == t]
        if len(finals) < 2:
            continue
        ordered = sorted(finals, key=lambda o: (-chain.objects[o].size_bytes, o))
        if ordered != finals:
            offloads[t] = listed[: len(listed) - len(finals)] + tuple(ordered)
            changed.append(t)
    if not changed:
        return found, ()
    return attrs.evolve(found, offloads=tuple(offloads)), tuple(changed)


def reannotate(
    program: Program, chain: Chain, found: Directives, tasks: tuple[int, ...]
) -> Program:
    """``program`` (annotated) with the offloads of ``tasks`` taken from ``found``."""
    ids = [life.obj_id for life in chain.objects]
    rewritten = list(program.tasks)
    for t in tasks:
        rewritten[t] = attrs.evolve(rewritten[t], offloads=tuple(ids[o] for o in found.offloads[t]))
    return attrs.evolve(program, tasks=tuple(rewritten))


def annotate(
    chain: Chain,
    found: Directives,
    budget_bytes: int,
    slow_budget_bytes: int | None = None,
) -> Program:
    """The bare program with ``found``'s directives and the budget written in."""
    program = chain.program
    ids = [life.obj_id for life in chain.objects]
    tasks = []
    for t, task in enumerate(program.tasks):
        rel, off, pre = found.releases[t], found.offloads[t], found.prefetches[t]
        if rel or off or pre or task.releases or task.offloads or task.prefetches:
            task = attrs.evolve(
                task,
                releases=tuple(ids[o] for o in rel),
                offloads=tuple(ids[o] for o in off),
                prefetches=tuple(ids[o] for o in pre),
            )
        tasks.append(task)
    return attrs.evolve(
        program,
        tasks=tuple(tasks),
        prologue=Prologue(prefetches=tuple(ids[o] for o in found.prefetches[-1])),
        budget=Budget(fast_bytes=budget_bytes, slow_bytes=slow_budget_bytes),
    )
