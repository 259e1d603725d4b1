"""Cut selection, most-over-budget task first (the order ARCHITECTURE.md section 5 names).

Same model as ``cuts.select_cuts`` (uses and workspace, kept gaps, prefetch windows at
their own transfer time before the use, write-backs in flight as a soft charge, the same
scores), but instead of sweeping the chain in order it repeatedly takes the task whose
bytes are furthest over the capacity and cuts there the kept gap the score ranks first.
When nothing can be cut there it delays a prefetch window that covers the task, and as a
last resort cuts a gap whose write-back is still running.

It is kept as a measured alternative (``order="peak"`` of a ``Strategy``): on the
benchmark chains, alone it ties the sweep on training and streaming chains, is worse on
random chains, and on tied-embedding chains beats the plain sweep but not the queued one;
added with the other alternatives to the default portfolio it improves the mean makespan
ratio by under 0.5 % on every shape, while each of its cuts costs a pass over the chain
(2-4 s for a 2,000-task chain). So the default portfolio sweeps (docs/planning.md).
"""

from __future__ import annotations

from dataflow.planning.cuts import SCORES, CutSelection, issue_task, slow_room
from dataflow.planning.intervals import Chain, Gaps, Origin, kept_profile
from dataflow.schema import Location


def select_cuts_peak(
    chain: Chain,
    gaps: Gaps,
    capacity_bytes: int,
    score: str = "farthest",
    slow_capacity_bytes: int | None = None,
) -> CutSelection:
    """Cut gaps, most-over-budget task first, until every task fits ``capacity_bytes``
    (and dirty cuts fit ``slow_capacity_bytes``, as in ``cuts.select_cuts``)."""
    key_of = SCORES[score]
    start = chain.start_us
    g_obj, g_a, g_b, g_size = gaps.obj, gaps.a, gaps.b, gaps.size_bytes
    cut = [False] * len(g_obj)
    hard = [b + k for b, k in zip(chain.base_bytes, kept_profile(chain, gaps), strict=True)]
    total = list(hard)
    windows: list[list[int]] = []  # [use, issue task, size]

    def add(profile: list[int], low: int, high: int, size: int) -> None:
        if low < high:
            profile[low:high] = [bytes_ + size for bytes_ in profile[low:high]]

    def add_window(use: int, p: int, size: int) -> None:
        windows.append([use, p, size])
        add(hard, p + 1, use, size)
        add(total, p + 1, use, size)

    def offload_end(a: int, size: int) -> int:
        end_us = start[a + 1] + chain.d2h_us(size)
        return max(a + 1, chain.task_at_or_before(end_us - 1e-9))

    for life in chain.objects:
        if life.origin is Origin.SLOW and life.uses:
            use = life.uses[0]
            p = issue_task(chain, use, chain.h2d_us(life.size_bytes))
            add_window(use, max(-1, min(use - 1, p)), life.size_bytes)
        if life.uses and life.final is Location.SLOW:
            if any(life.dirties):  # a final write-back after the last use
                last = life.uses[-1]
                add(total, last + 1, offload_end(last, life.size_bytes) + 1, life.size_bytes)

    def dirty_after(g: int) -> bool:
        """Whether gap ``g``'s object is dirty after the use that opens the gap."""
        o = g_obj[g]
        life = chain.objects[o]
        k = g - gaps.first_gap[o]
        while k >= 0:
            if life.dirties[k]:
                return True
            if k > 0 and cut[gaps.first_gap[o] + k - 1]:
                return False  # prefetched back clean before this use
            k -= 1
        return False  # it starts slow, or fast and read-only (created: dirty at use 0)

    slow_free, has_slow = slow_room(chain, slow_capacity_bytes)

    def cut_gap(g: int, t: int, dirty: bool) -> None:
        nonlocal slow_free
        a, b, size = g_a[g], g_b[g], g_size[g]
        cut[g] = True
        if not has_slow[g_obj[g]]:  # a write-back, or a read-only object's first drop
            slow_free -= size
            has_slow[g_obj[g]] = True
        add(hard, a + 1, b, -size)
        add(total, a + 1, b, -size)
        if dirty:
            add(total, a + 1, offload_end(a, size) + 1, size)
        p = min(b - 1, max(t, a + 1, issue_task(chain, b, chain.h2d_us(size))))
        add_window(b, p, size)

    cuttable = [g for g in range(len(g_obj)) if g_b[g] - g_a[g] >= 2]
    while True:
        peak = max(total)
        if peak <= capacity_bytes:
            return CutSelection(cut=tuple(cut), failed_task=None)
        t = total.index(peak)
        best, best_key, soft_only = -1, None, []
        for g in cuttable:
            if cut[g] or not g_a[g] < t < g_b[g]:
                continue
            dirty = dirty_after(g)
            if not has_slow[g_obj[g]] and g_size[g] > slow_free:
                continue  # no slow space left for its slow copy
            if dirty and offload_end(g_a[g], g_size[g]) >= t:
                soft_only.append(g)
                continue
            size, b = g_size[g], g_b[g]
            link = chain.h2d_us(size) + (chain.d2h_us(size) if dirty else 0.0)
            key = (*key_of(size, start[b], start[b] - start[t], dirty, link), -g)
            if best_key is None or key > best_key:
                best, best_key = g, key
        if best >= 0:
            cut_gap(best, t, dirty_after(best))
            continue
        covering = [w for w in windows if w[1] + 1 <= t <= w[0] - 1]
        if covering:
            window = max(covering, key=lambda w: (w[0], w[2]))
            use, p, size = window
            add(hard, p + 1, t + 1, -size)
            add(total, p + 1, t + 1, -size)
            window[1] = t
            continue
        if hard[t] > capacity_bytes and soft_only:
            g = min(soft_only)
            cut_gap(g, t, True)
            continue
        if hard[t] > capacity_bytes:
            return CutSelection(cut=tuple(cut), failed_task=t, over_bytes=hard[t] - capacity_bytes)
        # Over only by write-backs in flight: the task will wait for them; accept it.
        total[t] = hard[t]
