"""Prefetch placement: when each prefetch is issued, given the cuts.

Every object that starts slow needs a *head* prefetch before its first use; every cut gap
needs one before its next use. A prefetch issued when task ``p`` ends holds its object's
bytes from task ``p+1`` until its use (from when its transfer starts, at the latest), so
the issue task trades memory against stalls: too early wastes memory, too late stalls
compute. Rules (``RULES``):

- ``jit``: just in time. The ``h2d`` link is one FIFO, so prefetches are ordered by the
  task that needs them (earliest deadline first: the order that minimises the worst delay
  on one link) and scheduled backwards from their deadlines in the ideal, stall-free
  timeline: each transfer ends when its task starts or when the next transfer starts,
  whichever is first. Each is issued by the last task that ends before its planned start.
- ``early``: as early as the gap allows (right after the cut; task 0 for a head). Most
  hiding, most memory.
- ``margin``: ``jit`` with every lead doubled (a margin against queueing the ideal
  timeline does not see).

Then every rule fits the windows into the capacity, earliest deadline first: where a window
would push some task over, it starts after that task instead (a later issue: less memory,
maybe a stall). A window never has to vanish, since its object is counted at its use
anyway, so placement always succeeds once the cuts fit.
"""

from __future__ import annotations

from bisect import bisect_right

import attrs

from dataflow.planning.blockmax import BlockMax
from dataflow.planning.intervals import Chain, Gaps, Origin, kept_profile

RULES = ("jit", "early", "margin")


@attrs.frozen
class Prefetch:
    """One prefetch: of object ``obj`` for its use at task ``use``; ``gap`` is the cut gap
    it refills (-1 for a head); issued when task ``issue`` ends (``earliest <= issue``;
    -1: by the prologue, at program start).
    ``planned_start_us`` is when the just-in-time schedule wants its transfer to start, in
    the stall-free timeline."""

    obj: int
    use: int
    gap: int
    size_bytes: int
    earliest: int
    issue: int
    planned_start_us: float


@attrs.frozen
class PrefetchPlan:
    """Prefetches in deadline order and the bytes each task then holds (write-backs in
    flight not counted)."""

    prefetches: tuple[Prefetch, ...]
    held_bytes: tuple[int, ...]


def prefetch_requests(chain: Chain, gaps: Gaps, cut: tuple[bool, ...]) -> list[tuple[int, ...]]:
    """(use, obj, gap, earliest issue task) of every prefetch the cuts need, deadline order."""
    requests = []
    for life in chain.objects:
        if life.origin is Origin.SLOW and life.uses:
            requests.append((life.uses[0], life.index, -1, -1))  # the prologue may issue it
    for g, is_cut in enumerate(cut):
        if is_cut:
            requests.append((gaps.b[g], gaps.obj[g], g, gaps.a[g] + 1))
    requests.sort()
    return requests


def place_prefetches(
    chain: Chain,
    gaps: Gaps,
    cut: tuple[bool, ...],
    capacity_bytes: int,
    rule: str = "jit",
) -> PrefetchPlan:
    """Issue task of every prefetch the cuts need, fitted into ``capacity_bytes``."""
    return PrefetchWindows(chain, gaps, cut, rule).fit(capacity_bytes)


class PrefetchWindows:
    """The prefetches one set of cuts needs, each with its planned start under ``rule``,
    and what every task holds before any window (its base and the kept gaps spanning it):
    worked out once, then fitted into one capacity or several (``fit``)."""

    def __init__(self, chain: Chain, gaps: Gaps, cut: tuple[bool, ...], rule: str = "jit"):
        if rule not in RULES:
            raise ValueError(f"unknown prefetch rule {rule!r}; known: {', '.join(RULES)}")
        self.chain, self.rule = chain, rule
        start = chain.start_us
        self.requests = requests = prefetch_requests(chain, gaps, cut)
        self.sizes = [chain.objects[obj].size_bytes for _, obj, _, _ in requests]
        load_us = chain.load_us
        planned = [0.0] * len(requests)
        next_start = float("inf")
        stretch = 2.0 if rule == "margin" else 1.0
        for k in range(len(requests) - 1, -1, -1):
            use = requests[k][0]
            transfer_us = load_us[requests[k][1]]
            planned[k] = min(start[use], next_start) - transfer_us * stretch
            next_start = min(start[use], next_start) - transfer_us
        self.planned = planned
        self.held = [
            b + k for b, k in zip(chain.base_bytes, kept_profile(chain, gaps, cut), strict=True)
        ]
        #: the least capacity the windows fit into (each object is counted at its use anyway)
        self.need_bytes = max(self.held, default=0)

    def fit(self, capacity_bytes: int) -> PrefetchPlan:
        """Every window fitted into ``capacity_bytes``, earliest deadline first."""
        start, planned, sizes = self.chain.start_us, self.planned, self.sizes
        early = self.rule == "early"
        held = BlockMax(self.held)
        placed = []
        for k, (use, obj, gap, earliest) in enumerate(self.requests):
            if early:
                issue = earliest
            else:
                issue = bisect_right(start, planned[k]) - 2  # the task before the one then
            issue = min(use - 1, max(earliest, issue))
            size = sizes[k]
            room = capacity_bytes - size
            if issue + 1 < use:
                over = held.last_over(issue + 1, use, room)  # the last task it would push over
                if over >= 0:
                    issue = over
            held.add(issue + 1, use, size)
            placed.append(Prefetch(obj, use, gap, size, earliest, issue, planned[k]))
        return PrefetchPlan(prefetches=tuple(placed), held_bytes=tuple(held.to_list()))
