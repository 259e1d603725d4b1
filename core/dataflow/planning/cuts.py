"""Cut selection: which gaps leave fast memory so that every task fits the capacity.

One sweep over the tasks in chain order keeps the bytes each task would hold: its own uses
and workspace, the kept gaps that span it, the prefetch windows that cover it (a prefetch
issued when task ``p`` ends holds its object from task ``p+1`` to its use) and, as a *soft*
charge, write-backs still in flight (an offload frees memory only when its transfer ends;
optionally the ``d2h`` link is modelled as one FIFO, so a write-back queued behind others
ends late).
Where a task is over the capacity, the sweep cuts, among the kept gaps that span it, the
one the score ranks first, until the task fits. When no cut helps it delays prefetch
windows that cover the task (later issue, less memory, maybe a stall), and as a last
resort cuts dirty gaps whose write-back is still running (the task then waits for it).

Scores (``SCORES``) rank a gap that spans the task; higher is cut first:

- ``farthest``: next use farthest in time (Belady), clean before dirty, large first;
- ``clean``: clean before dirty (a release costs no write-back), then farthest;
- ``benefit``: bytes x µs freed per µs of link time the cut costs;
- ``large``: largest first, then farthest.
"""

from __future__ import annotations

import heapq
import math
from bisect import bisect_right
from collections.abc import Callable
from operator import neg

import attrs

from dataflow.planning.intervals import Chain, Gaps, Origin
from dataflow.schema import Location

#: score name -> (size_bytes, next_use_us, span_us, dirty, link_us) -> sort key (max first)
SCORES: dict[str, Callable[[int, float, float, bool, float], tuple[float, ...]]] = {
    "farthest": lambda size, next_us, span, dirty, link: (next_us, not dirty, size),
    "clean": lambda size, next_us, span, dirty, link: (not dirty, next_us, size),
    "benefit": lambda size, next_us, span, dirty, link: (size * span / link, next_us),
    "large": lambda size, next_us, span, dirty, link: (size, next_us),
}


@attrs.frozen
class CutSelection:
    """The gaps to cut (``cut[g]``); ``failed_task`` is the first task that cannot fit the
    capacity even with every spanning gap cut and every window delayed (None: all fit)."""

    cut: tuple[bool, ...]
    failed_task: int | None
    over_bytes: int = 0


def slow_room(chain: Chain, slow_capacity_bytes: int | None) -> tuple[float, list[bool]]:
    """Slow bytes left for the slow copies of objects that have none (a write-back, or a
    read-only object's first drop: ``Program.backed_ids``), and which objects have (or
    are sure to get) one: those that start or end slow."""
    has_slow = [life.origin is Origin.SLOW or life.final is Location.SLOW for life in chain.objects]
    if slow_capacity_bytes is None:
        return math.inf, has_slow
    taken = sum(life.size_bytes for life, slow in zip(chain.objects, has_slow, strict=True) if slow)
    return slow_capacity_bytes - taken, has_slow


def issue_task(chain: Chain, use: int, lead_us: float) -> int:
    """The latest task whose end is at least ``lead_us`` before task ``use`` starts (the
    ideal, stall-free schedule); -1 (the prologue) or less when even task 0 ends too late."""
    return chain.task_at_or_before(chain.start_us[use] - lead_us) - 1


@attrs.frozen
class SweepSetup:
    """What every sweep of one chain starts from, whatever the capacity: the gaps entering
    and leaving each task, the objects each task leaves dirty, the final write-backs, and
    the head prefetch windows (every sweep of a search shares it: ``_sweep_setup``)."""

    entering: tuple[tuple[int, ...], ...]
    leaving: tuple[tuple[int, ...], ...]
    #: per task: the objects its use leaves dirty
    dirtied_at: tuple[tuple[int, ...], ...]
    tails_at: tuple[tuple[int, ...], ...]
    head_use: tuple[int, ...]
    head_p: tuple[int, ...]
    head_size: tuple[int, ...]
    #: the latest task whose end still hides the window's transfer (``issue_task``)
    head_latest: tuple[int, ...]
    head_diff: tuple[int, ...]
    head_from: tuple[tuple[int, ...], ...]


#: The last chains and gaps swept, and their setups (a search sweeps one chain many times,
#: and two views of it where it has read-only objects: ``pressurefit.written_view``).
_LAST_SETUP: list[tuple[Chain, Gaps, SweepSetup]] = []
#: How many ``_LAST_SETUP`` keeps.
SETUPS_KEPT = 2


def _sweep_setup(chain: Chain, gaps: Gaps) -> SweepSetup:
    """``chain``'s ``SweepSetup``, made once for each of the last chains and gaps swept
    (checked by identity: both are frozen)."""
    for kept_chain, kept_gaps, kept in _LAST_SETUP:
        if kept_chain is chain and kept_gaps is gaps:
            return kept
    n = chain.n_tasks
    g_a, g_b = gaps.a, gaps.b
    entering: list[list[int]] = [[] for _ in range(n + 2)]
    leaving: list[list[int]] = [[] for _ in range(n + 2)]
    for g in range(len(gaps.obj)):
        if g_b[g] - g_a[g] >= 2:
            entering[g_a[g] + 1].append(g)
            leaving[g_b[g]].append(g)
    dirtied_at: list[list[int]] = [[] for _ in range(n + 1)]
    for life in chain.objects:
        for use, dirties in zip(life.uses, life.dirties, strict=True):
            if dirties:
                dirtied_at[use].append(life.index)
    tails_at: list[list[int]] = [[] for _ in range(n + 2)]
    for life in chain.objects:
        if life.uses and life.final is Location.SLOW:
            tails_at[life.uses[-1] + 1].append(life.index)
    head_use, head_p, head_size, head_latest = [], [], [], []
    head_diff = [0] * (n + 2)
    head_from: list[list[int]] = [[] for _ in range(n + 2)]
    for life in chain.objects:
        if life.origin is Origin.SLOW and life.uses:
            use = life.uses[0]
            latest = issue_task(chain, use, chain.load_us[life.index])
            p = max(-1, min(use - 1, latest))
            if p + 1 > use - 1:
                continue
            head_from[p + 1].append(len(head_use))
            head_use.append(use)
            head_p.append(p)
            head_size.append(life.size_bytes)
            head_latest.append(latest)
            head_diff[p + 1] += life.size_bytes
            head_diff[use] -= life.size_bytes
    setup = SweepSetup(
        entering=tuple(map(tuple, entering)),
        leaving=tuple(map(tuple, leaving)),
        dirtied_at=tuple(map(tuple, dirtied_at)),
        tails_at=tuple(map(tuple, tails_at)),
        head_use=tuple(head_use),
        head_p=tuple(head_p),
        head_size=tuple(head_size),
        head_latest=tuple(head_latest),
        head_diff=tuple(head_diff),
        head_from=tuple(map(tuple, head_from)),
    )
    _LAST_SETUP[:] = [(chain, gaps, setup), *_LAST_SETUP[: SETUPS_KEPT - 1]]
    return setup


def select_cuts(
    chain: Chain,
    gaps: Gaps,
    capacity_bytes: int,
    score: str = "farthest",
    slow_capacity_bytes: int | None = None,
    queue: bool = False,
    pinned: frozenset[int] = frozenset(),
) -> CutSelection:
    """Sweep the chain and cut gaps until every task fits ``capacity_bytes``.

    ``queue`` models the ``d2h`` link as a FIFO when estimating when a write-back frees its
    bytes (else each write-back is timed alone, which is optimistic when many queue).

    With ``slow_capacity_bytes``, a gap of an object that has no slow copy yet is cut
    only while the slow budget has room for it (slow space is never given back; objects
    that start or end slow have theirs set aside first).

    Gaps of ``pinned`` objects (indices) are cut only as a last resort, once nothing else
    helps a task: a huge object kept resident can beat moving it again and again."""
    key_of = SCORES[score]
    n = chain.n_tasks
    start = chain.start_us
    base = chain.base_bytes
    objects = chain.objects
    g_obj, g_a, g_b, g_size = gaps.obj, gaps.a, gaps.b, gaps.size_bytes
    cut = [False] * len(g_obj)

    setup = _sweep_setup(chain, gaps)
    entering, leaving, dirtied_at, tails_at = (
        setup.entering,
        setup.leaving,
        setup.dirtied_at,
        setup.tails_at,
    )

    # Prefetch windows: (object, use, issue task p, size); they cover p+1 .. use-1.
    win_use: list[int] = list(setup.head_use)
    win_p: list[int] = list(setup.head_p)
    win_size: list[int] = list(setup.head_size)
    win_latest: list[int] = list(setup.head_latest)  # its latest hiding issue
    window_diff = list(setup.head_diff)
    windows_from: list[list[int]] = [list(ws) for ws in setup.head_from]
    load_us, write_us = chain.load_us, chain.write_us

    soft_diff = [0] * (n + 2)

    def offload_end_task(end_us: float, a: int) -> int:
        """The last task that starts while a write-back issued at the end of ``a`` runs."""
        return max(a + 1, bisect_right(start, end_us - 1e-9) - 1)

    # With ``queue``, the d2h link as one FIFO in the ideal timeline, served in the order
    # write-backs are decided: a write-back frees its bytes once those before it are done.
    d2h_free_us = 0.0

    def write_back_end_us(a: int, o: int) -> float:
        """When object ``o``'s write-back, issued when task ``a`` ends, is done."""
        begin = max(start[a + 1], d2h_free_us) if queue else start[a + 1]
        return begin + write_us[o]

    def gap_offload_end(g: int) -> int:
        """``offload_end_task`` of gap ``g``'s write-back (inlined: a hot path)."""
        a = g_a[g]
        begin = max(start[a + 1], d2h_free_us) if queue else start[a + 1]
        return max(a + 1, bisect_right(start, begin + write_us[g_obj[g]] - 1e-9) - 1)

    slow_free, has_slow = slow_room(chain, slow_capacity_bytes)

    def cut_gap(g: int, t: int) -> None:
        """Cut gap ``g`` while sweeping task ``t``: its prefetch is issued at ``t`` or later."""
        nonlocal slow_free, d2h_free_us
        o, a, b, size = g_obj[g], g_a[g], g_b[g], g_size[g]
        cut[g] = True
        if not has_slow[o]:  # its first write-back, or a read-only one's first drop
            slow_free -= size
            has_slow[o] = True
        if dirty[o]:
            d2h_free_us = write_back_end_us(a, o)
        dirty[o] = False  # offloaded if it was dirty; the copy that comes back is clean
        # its prefetch window: issued at the latest task that hides its transfer
        # (``issue_task``, inlined), not before ``t``; it covers p+1 .. b-1
        latest = bisect_right(start, start[b] - load_us[o]) - 2
        p = min(b - 1, max(t, a + 1, latest))
        if p + 1 <= b - 1:
            windows_from[p + 1].append(len(win_use))
            win_use.append(b)
            win_p.append(p)
            win_size.append(size)
            win_latest.append(latest)
            window_diff[p + 1] += size
            window_diff[b] -= size

    dirty = [life.origin is Origin.FAST and life.dirties[0] for life in objects]
    candidates: list[tuple[tuple[float, ...], int]] = []  # (negated key, gap)
    reserve: list[tuple[tuple[float, ...], int]] = []  # the same, for pinned objects
    # Dirty gaps whose write-back would still be running: parked until it is done (they
    # cannot relieve a task before), and reachable meanwhile as a last resort.
    parked: list[tuple[tuple[float, ...], int]] = []
    waking: list[list[tuple[tuple[float, ...], int]]] = [[] for _ in range(n + 2)]
    set_aside: list[tuple[tuple[float, ...], int]] = []  # dirty, while the d2h FIFO is full
    d2h_latency_us = chain.d2h_us(0)
    active_windows: list[tuple[int, int]] = []  # (-use, window)
    kept = windows = soft = 0
    failed, over = None, 0
    for t in range(n + 1):
        for o in dirtied_at[t]:
            dirty[o] = True
        for o in tails_at[t]:
            if dirty[o]:
                size = objects[o].size_bytes
                d2h_free_us = write_back_end_us(t - 1, o)
                end = offload_end_task(d2h_free_us, t - 1)
                soft += size
                soft_diff[end + 1] -= size
        for g in leaving[t]:
            if not cut[g]:
                kept -= g_size[g]
        for g in entering[t]:
            kept += g_size[g]
            o, size, b = g_obj[g], g_size[g], g_b[g]
            link = load_us[o] + (write_us[o] if dirty[o] else 0.0)
            key = key_of(size, start[b], start[b] - start[t], dirty[o], link)
            heapq.heappush(reserve if o in pinned else candidates, (tuple(map(neg, key)), g))
        windows += window_diff[t]
        soft += soft_diff[t]
        for w in windows_from[t]:
            heapq.heappush(active_windows, (-win_use[w], w))
        for entry in waking[t]:
            if not cut[entry[1]]:
                heapq.heappush(candidates, entry)
        hard = base[t] + kept + windows
        if hard + soft <= capacity_bytes:
            continue
        # With ``queue``, no write-back decided now ends before the d2h link drains: while
        # that is after task ``t`` starts, no dirty gap can relieve it (set them aside).
        blocked = queue and d2h_free_us + d2h_latency_us - 1e-9 >= start[t]
        if not blocked and set_aside:
            for entry in set_aside:
                heapq.heappush(candidates, entry)
            set_aside.clear()
        while hard + soft > capacity_bytes and (candidates or reserve or active_windows):
            if not candidates and not active_windows:
                # nothing unpinned left to cut, no window to delay: pinned gaps come next
                candidates.append(heapq.heappop(reserve))
            if candidates:
                entry = heapq.heappop(candidates)
                g = entry[1]
                if cut[g] or g_b[g] <= t:
                    continue
                if not has_slow[g_obj[g]] and g_size[g] > slow_free:
                    continue  # no slow space left for its slow copy (and there never will be)
                if dirty[g_obj[g]] and blocked:
                    heapq.heappush(parked, entry)
                    set_aside.append(entry)
                    continue
                if dirty[g_obj[g]]:
                    end = gap_offload_end(g)
                    if end >= t:  # its write-back would still hold the bytes
                        heapq.heappush(parked, entry)
                        waking[min(end + 1, n + 1)].append(entry)
                        continue
                cut_gap(g, t)
                kept -= g_size[g]
                hard -= g_size[g]
                continue
            w = heapq.heappop(active_windows)[1]
            use = win_use[w]
            if win_p[w] + 1 > t or use - 1 < t:
                continue  # ended, or already delayed past t (it re-enters later)
            # Issue the window's prefetch later, so that it no longer covers task t: when
            # t ends, or at the latest issue that still hides its own transfer if that is
            # later (one jump, not one task at a time). Inlined: millions of delays in a
            # large model's search (glm5's predict: 5.8 million).
            p = win_latest[w]
            if p < t:
                p = t
            if p > use - 1:
                p = use - 1
            win_p[w] = p
            held = win_size[w]
            window_diff[p + 1] += held
            if p + 1 <= use - 1:
                windows_from[p + 1].append(w)
            windows -= held
            hard -= held
        while hard > capacity_bytes and parked:
            g = heapq.heappop(parked)[1]
            if cut[g] or g_b[g] <= t:
                continue
            if not has_slow[g_obj[g]] and g_size[g] > slow_free:
                continue
            end = gap_offload_end(g)
            cut_gap(g, t)
            kept -= g_size[g]
            hard -= g_size[g]
            if end >= t:
                soft += g_size[g]
                soft_diff[end + 1] -= g_size[g]
        if hard > capacity_bytes:
            failed, over = t, hard - capacity_bytes
            break
    return CutSelection(cut=tuple(cut), failed_task=failed, over_bytes=over)
