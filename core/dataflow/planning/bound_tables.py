"""The budget-free tables the lower bounds of ``lower_bound.py`` read, each worked out once
per chain and read at any budget: the *ahead* bound's checkpoint pairs (``AheadPairs``),
the *write-back* bound's task and slot pairs (``WritebackPairs``), the *handoff* bound's
per-boundary needs (``HandoffNeeds``), and the covers that price them (``cover_bytes``:
the fewest cut bytes that bring every task within a budget; ``cover_us``: the least time
whole objects covering some bytes take on a link). Why each bounds is said where it is
read (``lower_bound``'s module docstring and ``ChainBounds``)."""

from __future__ import annotations

import bisect
import heapq
import itertools
import math

import attrs

from dataflow.planning.intervals import Chain, Gaps, ObjectLife, Origin
from dataflow.schema import Link, Location

#: Checkpoint tasks of the ahead bound (``AheadPairs``): at most this many, evenly spaced.
AHEAD_POINTS = 48


@attrs.frozen
class AheadPairs:
    """What the *ahead* bound needs at any budget, for checkpoint tasks ``points`` (a
    subset of the tasks, evenly spaced; any subset gives a bound). For checkpoints
    ``k < u`` (``u`` may be the end, index ``len(points)``), ``bytes_ahead[u][k]`` is the
    bytes of objects not used by task ``k`` that some task in ``(k, u]`` needs and that
    cannot be in fast memory before they cross ``h2d``: those that start slow and are
    first used in ``(k, u]``, and those with a gap that spans ``k`` and ends in ``(k, u]``.

    Why it bounds (``ChainBounds._timeline``): when task ``k`` starts, fast memory holds
    its footprint (``held_bytes[k]``: its inputs, mutates, outputs and workspace) and
    every one of those objects that is resident or arriving, within the budget, so at
    most ``budget - held_bytes[k]`` of them are; each of the others crosses ``h2d`` after
    ``k`` starts and before the task in ``(k, u]`` that needs it, one transfer at a time.
    So task ``u`` starts no sooner than ``k`` starts plus ``(bytes_ahead - budget +
    held_bytes[k]) / bandwidth``, with ``k``'s start bounded by the same timeline."""

    gaps: Gaps
    points: tuple[int, ...]
    #: task -> its position in ``points``, or -1
    column: tuple[int, ...]
    bytes_ahead: tuple[tuple[int, ...], ...]
    held_bytes: tuple[int, ...]


def ahead_pairs(chain: Chain, gaps: Gaps) -> AheadPairs:
    """The ahead bound's checkpoint pairs for ``chain`` (``AheadPairs``), from one pass
    over the objects and gaps and a 2-D prefix sum over the checkpoints."""
    bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right
    n = chain.n_tasks
    step = max(1, -(-n // AHEAD_POINTS))
    points = tuple(range(0, n, step))
    m = len(points)
    column = [-1] * n
    for position, task in enumerate(points):
        column[task] = position
    # diff[k][u]: bytes that count for every checkpoint pair (k' >= k row range, u' >= u)
    diff = [[0] * (m + 2) for _ in range(m + 2)]

    def count(after: int, before: int, use: int, size: int) -> None:
        """``size`` counts for checkpoints ``k`` with ``after < k < before`` and ``u`` with
        ``u >= use`` (``u`` = m: the end)."""
        k_lo = bisect_right(points, after)
        k_hi = bisect_left(points, before) - 1
        u_lo = bisect_left(points, use) if use < n else m
        if k_lo > k_hi or u_lo > m:
            return
        diff[k_lo][u_lo] += size
        diff[k_hi + 1][u_lo] -= size

    for life in chain.objects:
        if life.origin is Origin.SLOW and life.uses:
            first = life.uses[0]
            count(-1, first, first, life.size_bytes)  # every k before its first use
    for a, b, size in zip(gaps.a, gaps.b, gaps.size_bytes, strict=True):
        if b - a >= 2:
            count(a, b, b, size)
    bytes_ahead = [[0] * m for _ in range(m + 1)]
    for k in range(m):
        running = 0
        for u in range(m + 1):
            running += diff[k][u]
            diff[k + 1][u] += diff[k][u]  # carry the row range down
            bytes_ahead[u][k] = running if k < u else 0
    held = list(chain.footprint_bytes) + [0]
    return AheadPairs(
        gaps,
        points,
        tuple(column),
        tuple(tuple(row[: min(u, m)]) for u, row in enumerate(bytes_ahead)),
        tuple(held),
    )


#: Tasks the write-back bound checks (``WritebackPairs``): this many evenly spaced, and
#: this many more where the most must have been written back (``writeback_pairs``).
WRITEBACK_TASKS = 48
#: Release slots (the start, or a task's end) it counts write-backs from, evenly spaced.
WRITEBACK_SLOTS = 48


@attrs.frozen
class WritebackPairs:
    """What the *write-back* bound needs at any budget, for the tasks ``tasks`` and the
    release slots ``slots`` (slot 0: program start; slot ``j``: the end of task ``j - 1``;
    any subsets give a bound). ``behind_bytes[i][s]`` is task ``tasks[i]``'s footprint
    plus the bytes of its *dirty candidates* whose last change before it is at slot
    ``slots[s]`` or later (only slots up to that task are kept; the bytes fall as the
    slot rises): the objects it does not use, that exist when it starts, whose value is
    needed after it (a later use, or a final location), and that were created or changed
    before it (or started in fast memory: slot 0). ``most_bytes[i]`` is the first entry.

    Why it bounds (``ChainBounds._timeline``): when task ``k`` starts, fast memory holds
    its footprint and, within the budget, whichever candidates are resident or arriving
    (one with a write-back still running holds its bytes until the write-back ends). A
    candidate that is absent is still needed, so its slow copy is current; for a dirty
    one that takes a ``d2h`` transfer that started after its last change (nothing
    copies an object while a task uses it) and ended before ``k`` starts. So of the dirty
    candidates changed last at slot ``j`` or later, at least ``behind_bytes - budget``
    bytes crossed ``d2h`` between the earliest end of task ``j - 1`` and the start of
    ``k``, one transfer at a time, each spending the link's latency first, in whole
    objects (``written_bytes``): ``k`` starts no sooner than that end plus those
    transfers' latencies and bytes over the link's bandwidth (alone: a shared duplex
    rate is slower). Candidates that start slow and are not
    changed before ``k`` have a current slow copy anyway: they may all be absent."""

    tasks: tuple[int, ...]
    #: task -> its position in ``tasks``, or -1
    column: tuple[int, ...]
    slots: tuple[int, ...]
    behind_bytes: tuple[tuple[int, ...], ...]
    most_bytes: tuple[int, ...]
    #: per task kept: the largest and the smallest of its dirty candidates (objects move
    #: whole: ``over`` bytes take at least ``ceil(over / largest)`` transfers, each at
    #: least the smallest)
    largest_bytes: tuple[int, ...] = ()
    smallest_bytes: tuple[int, ...] = ()

    def written_bytes(self, position: int, over: int) -> tuple[int, int]:
        """The fewest transfers, and the fewest bytes, that whole candidates of task
        ``tasks[position]`` covering ``over`` bytes take."""
        largest = self.largest_bytes[position]
        if largest <= 0:
            return 1, over  # nothing to write: the footprint alone is over the budget
        count = -(-over // largest)
        return count, max(over, count * self.smallest_bytes[position])


def writeback_pairs(chain: Chain) -> WritebackPairs:
    """The write-back bound's pairs for ``chain`` (``WritebackPairs``): each object's
    dirty-candidate stretches (tasks after a use and before the next, or to the end when
    it must end slow, once something changed it), then a 2-D prefix sum over the tasks and
    slots kept. The tasks kept: evenly spaced ones, and those whose footprint plus every
    dirty candidate, over the ``d2h`` bandwidth, less its ideal start, is largest (where
    the bound from program start, plus the compute after, is highest)."""
    bisect_left, bisect_right = bisect.bisect_left, bisect.bisect_right
    n = chain.n_tasks
    first = chain.program.tasks[0] if n else None
    changed_by_first = set(first.mutates) if first is not None else set()
    used_by_first = changed_by_first | set(first.inputs) if first is not None else set()
    stretches: list[tuple[int, int, int, int]] = []  # (first task, end task, slot, size)
    for life in chain.objects:
        slot = -1  # the slot of the last change so far; -1: none (its slow copy is current)
        uses = life.uses
        for k, use in enumerate(uses):
            low = use + 1
            if life.dirties[k]:
                slot = _change_slot(life, k, use, changed_by_first)
                if slot == 0 and life.obj_id not in used_by_first:
                    low = 0  # only the virtual use: task 0 need not hold it
            end = uses[k + 1] if k + 1 < len(uses) else (n if life.final is Location.SLOW else 0)
            if slot >= 0 and end > low:
                stretches.append((low, end, slot, life.size_bytes))
    everything = [0] * (n + 1)
    for low, high, _, size in stretches:
        everything[low] += size
        everything[high] -= size
    running, most = 0, []
    for t in range(n):
        running += everything[t]
        most.append(running + chain.footprint_bytes[t])
    bandwidth = chain.d2h.bw_bytes_per_us
    step = max(1, -(-n // WRITEBACK_TASKS))
    start_us = chain.start_us
    ranked = heapq.nsmallest(
        WRITEBACK_TASKS, range(n), key=lambda t: start_us[t] - most[t] / bandwidth
    )
    tasks = tuple(sorted(set(range(0, n, step)) | set(ranked)))
    slots = tuple(range(0, n, max(1, -(-n // WRITEBACK_SLOTS))))
    rows, columns = len(tasks), len(slots)
    diff = [[0] * (columns + 1) for _ in range(rows + 1)]
    for low, high, slot, size in stretches:
        row_lo, row_hi = bisect_left(tasks, low), bisect_left(tasks, high)
        if row_lo == row_hi:
            continue
        last = bisect_right(slots, slot)  # the slots at or before the change
        diff[row_lo][0] += size
        diff[row_hi][0] -= size
        diff[row_lo][last] -= size
        diff[row_hi][last] += size
    behind = []
    for row in range(rows):
        if row:
            diff[row] = [a + b for a, b in zip(diff[row], diff[row - 1], strict=True)]
        task = tasks[row]
        kept, running = [], chain.footprint_bytes[task]
        for column in range(bisect_right(slots, task)):
            running += diff[row][column]
            kept.append(running)
        behind.append(tuple(kept))
    column_of = [-1] * n
    for position, task in enumerate(tasks):
        column_of[task] = position
    largest, smallest = _extremes(stretches, tasks)
    return WritebackPairs(
        tasks,
        tuple(column_of),
        slots,
        tuple(behind),
        tuple(most[t] for t in tasks),
        largest,
        smallest,
    )


def _change_slot(life: ObjectLife, k: int, use: int, changed_by_first: set[str]) -> int:
    """The write-back slot of the change ``life`` gets at its ``k``-th use (task ``use``):
    the end of that task, or the program start (slot 0) for an object that starts in fast
    memory, dirty, and that task 0 does not change (the prologue may write it back)."""
    if k == 0 and life.origin is Origin.FAST and life.obj_id not in changed_by_first:
        return 0
    return use + 1


def object_changes(chain: Chain) -> tuple[list, dict[str, int]]:
    """Per object that something changes (or that starts in fast memory): its index, id,
    size, the last task it is needed at (``n`` when it must end slow), and its changes'
    tasks and write-back slots (``WritebackPairs``); and every object's index by id."""
    n = chain.n_tasks
    changed_by_first = set(chain.program.tasks[0].mutates) if n else set()
    found = []
    for life in chain.objects:
        at, slot_of = [], []
        for k, (use, dirty) in enumerate(zip(life.uses, life.dirties, strict=True)):
            if dirty:
                at.append(use)
                slot_of.append(_change_slot(life, k, use, changed_by_first))
        if at:
            needed_after = n if life.final is Location.SLOW else life.uses[-1]
            found.append(
                (life.index, life.obj_id, life.size_bytes, needed_after, tuple(at), tuple(slot_of))
            )
    return found, {life.obj_id: life.index for life in chain.objects}


def _extremes(
    stretches: list[tuple[int, int, int, int]], tasks: tuple[int, ...]
) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """Per task of ``tasks`` (ascending), the largest and the smallest size of the
    ``stretches`` (first task, end task, slot, size) that cover it (1 and 0 when none)."""
    order = sorted(stretches)
    largest_heap: list[tuple[int, int]] = []  # (-size, end)
    smallest_heap: list[tuple[int, int]] = []  # (size, end)
    largest, smallest = [], []
    position = 0
    for task in tasks:
        while position < len(order) and order[position][0] <= task:
            low, high, _, size = order[position]
            heapq.heappush(largest_heap, (-size, high))
            heapq.heappush(smallest_heap, (size, high))
            position += 1
        while largest_heap and largest_heap[0][1] <= task:
            heapq.heappop(largest_heap)
        while smallest_heap and smallest_heap[0][1] <= task:
            heapq.heappop(smallest_heap)
        largest.append(-largest_heap[0][0] if largest_heap else 1)
        smallest.append(smallest_heap[0][0] if smallest_heap else 0)
    return tuple(largest), tuple(smallest)


def cover_bytes(
    gaps: Gaps, excess: list[int], entering: list[list[tuple[int, int]]] | None = None
) -> list[int]:
    """By the index of the next use, bytes of cut gaps that bring every task ``t`` within
    the budget (the cut gaps spanning it add up to ``excess[t]``), the fewest in all and
    the fewest due back before any task: a gap cut by ``y`` bytes counts at every task it
    spans, and each cut byte crosses ``h2d`` again before the gap's next use.

    Fractional cuts (a lower bound on whole objects), taken greedily in chain order from
    the spanning gaps whose next use is farthest: an interval covering, for which that
    greedy choice is optimal (a cut at the first task still short can be moved to the
    spanning gap that reaches farthest without uncovering anything, and its bytes then
    come back no earlier). ``entering`` is ``spanning_from(gaps, len(excess))`` when the
    caller has it (it does not depend on the excess)."""
    n = len(excess)
    if entering is None:
        entering = spanning_from(gaps, n)
    next_use = gaps.b
    left = list(gaps.size_bytes)
    spanning: list[tuple[int, int]] = []  # (-next use, gap)
    ending = [0] * (n + 1)
    covered = 0
    for t in range(n):
        covered -= ending[t]
        for entry in entering[t]:
            heapq.heappush(spanning, entry)
        need = excess[t] - covered
        while need > 0 and spanning:
            _, g = spanning[0]
            if next_use[g] <= t:
                heapq.heappop(spanning)
                continue
            take = min(left[g], need)
            left[g] -= take
            need -= take
            covered += take
            ending[next_use[g]] += take
            if left[g] == 0:
                heapq.heappop(spanning)
    return ending[:n]


def spanning_from(gaps: Gaps, n: int) -> list[list[tuple[int, int]]]:
    """Per task ``t < n``: (-next use, gap) of each gap that spans a task from ``t`` on
    (``cover_bytes``'s heap entries)."""
    entering: list[list[tuple[int, int]]] = [[] for _ in range(n + 1)]
    for g, (a, b) in enumerate(zip(gaps.a, gaps.b, strict=True)):
        if b - a >= 2:
            entering[a + 1].append((-b, g))
    return entering


#: Up to this many candidate objects, the cheapest covering set is found by enumeration.
EXACT_COVER = 8


@attrs.frozen
class HandoffNeeds:
    """Per task boundary ``t`` -> ``t+1`` (the last one: the end), what the handoff bound
    needs whatever the budget: the sizes ``t+1`` reads that ``t`` does not use, and of the
    objects ``t`` leaves behind, the bytes that can leave at once and the sizes that must be
    written back first (created or mutated by ``t`` and needed later)."""

    fresh: tuple[tuple[int, ...], ...]
    #: the budget below which loads are forced: sum(fresh[t]) + base[t]
    load_above: tuple[int, ...]
    free: tuple[int, ...]
    pinned: tuple[tuple[int, ...], ...]
    #: the budget below which something must leave: base[t+1] + everything left behind
    leave_above: tuple[int, ...]
    #: what ``t+1`` reads (inputs and mutates; at the end, the final fast objects) plus
    #: the sizes that must be written back first, and the smallest thing it reads
    read_pinned: tuple[int, ...] = ()
    smallest_read: tuple[int, ...] = ()

    def gaps_us(self, chain: Chain, budget_bytes: int) -> list[float]:
        """Per task ``t``, the transfer time forced between it and the next task."""
        gaps_us = [0.0] * len(self.fresh)
        for t, (load_above, leave_above) in enumerate(
            zip(self.load_above, self.leave_above, strict=True)
        ):
            if load_above <= budget_bytes and leave_above <= budget_bytes:
                continue
            load_us = write_us = 0.0
            if load_above > budget_bytes:
                load_us = cover_us(list(self.fresh[t]), load_above - budget_bytes, chain.h2d)
            must_go = leave_above - budget_bytes
            if must_go > self.free[t]:
                write_us = cover_us(list(self.pinned[t]), must_go - self.free[t], chain.d2h)
            if load_us and self.read_pinned[t] > budget_bytes:
                # the last load for t+1 starts once all it reads is reserved: only the
                # write-backs that make room beside that let it start
                room_us = cover_us(
                    list(self.pinned[t]), self.read_pinned[t] - budget_bytes, chain.d2h
                )
                write_us = max(write_us, room_us + chain.h2d_us(self.smallest_read[t]))
            gaps_us[t] = max(load_us, write_us)
        return gaps_us


def handoff_needs(chain: Chain) -> HandoffNeeds:
    """The budget-free part of the handoff bound (see the module docstring)."""
    n = chain.n_tasks
    read_at: list[list[int]] = [[] for _ in range(n + 1)]  # objects each task needs present
    used_at: list[set[int]] = [set() for _ in range(n + 1)]
    pinned_at: list[set[int]] = [set() for _ in range(n + 1)]  # dirtied here, needed later
    for life in chain.objects:
        last = len(life.uses) - 1
        for k, use in enumerate(life.uses):
            used_at[use].add(life.index)
            created_here = k == 0 and life.origin is Origin.CREATED
            if not created_here and not (k == 0 and life.origin is Origin.FAST and use == 0):
                read_at[use].append(life.index)
            if life.dirties[k] and (k < last or life.final is Location.SLOW):
                pinned_at[use].add(life.index)
    size = [life.size_bytes for life in chain.objects]
    base = chain.base_bytes
    fresh, load_above, free, pinned, leave_above = [], [], [], [], []
    read_pinned, smallest_read = [], []
    for t in range(n):
        used, following = used_at[t], used_at[t + 1]
        sizes = tuple(size[o] for o in read_at[t + 1] if o not in used)
        fresh.append(sizes)
        load_above.append(sum(sizes) + base[t])
        leaving = sorted(used - following)
        free.append(sum(size[o] for o in leaving if o not in pinned_at[t]))
        pinned.append(tuple(size[o] for o in leaving if o in pinned_at[t]))
        leave_above.append(base[t + 1] + sum(size[o] for o in leaving))
        reads = [size[o] for o in read_at[t + 1]]
        read_pinned.append(sum(reads) + sum(pinned[-1]))
        smallest_read.append(min(reads, default=0))
    return HandoffNeeds(
        tuple(fresh),
        tuple(load_above),
        tuple(free),
        tuple(pinned),
        tuple(leave_above),
        tuple(read_pinned),
        tuple(smallest_read),
    )


def cover_us(sizes: list[int], need_bytes: int, link: Link) -> float:
    """The least time ``link`` needs to move whole objects of ``sizes`` totalling at least
    ``need_bytes`` (0 when nothing is needed)."""
    if need_bytes <= 0:
        return 0.0
    if len(sizes) <= EXACT_COVER:
        best = math.inf
        for count in range(1, len(sizes) + 1):
            for chosen in itertools.combinations(sizes, count):
                total = sum(chosen)
                if total >= need_bytes:
                    best = min(best, count * link.latency_us + total / link.bw_bytes_per_us)
        if best < math.inf:
            return best
    fewest, covered = 0, 0
    for one in sorted(sizes, reverse=True):
        if covered >= need_bytes:
            break
        fewest, covered = fewest + 1, covered + one
    return max(fewest, 1) * link.latency_us + need_bytes / link.bw_bytes_per_us
