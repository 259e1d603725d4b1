"""Static placement: one fast-memory arena, an offset for every resident interval.

From a plan's simulated timeline every stretch of time an object holds fast memory becomes
a block: from its reservation (time 0 for an object that starts fast, its creating task's
start for an output, its transfer's start for a prefetch) to its freeing (the end of the
task whose release drops it, or of the write-back of a dirty offload; the end of the run if
it stays). Every task's workspace is a block from its start to its end. Two blocks that
are live at the same time never share an address.

Packing is greedy (the TFLite arena planner's "greedy by size for offset calculation"):
blocks are taken largest first, each put in the tightest hole left between the blocks
already placed that overlap it in time (lowest such hole on ties), else on top. When that
arena is over the budget, other orders are tried (``ORDERS``: by start time, by size then
lifetime into the lowest hole, longest-lived first) and the smallest arena is kept.
Intervals are half-open ``[start, end)``: what is freed at an instant can be reused at
that instant, which is the order the execution model processes events in; a block of zero
length is taken to hold its instant.

If the arena comes out larger than the budget (fragmentation), ``place`` re-plans at a
capacity reduced by the excess, and packs again, a bounded number of times.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import attrs

from dataflow.planning.api import Plan, plan
from dataflow.planning.feasibility import InfeasibleBudget
from dataflow.planning.intervals import PlanningError
from dataflow.schema import Location
from dataflow.units import format_size

#: How many times ``place`` re-plans at a smaller capacity before giving up.
REPLANS = 6


@attrs.frozen
class Block:
    """One interval of fast memory: ``obj_id``'s bytes, or ``task_id``'s workspace."""

    start_us: float
    end_us: float
    size_bytes: int
    offset_bytes: int
    obj_id: str | None = None
    task_id: str | None = None

    @property
    def end_bytes(self) -> int:
        return self.offset_bytes + self.size_bytes


@attrs.frozen
class Placement:
    """Offsets of every block of ``plan`` in one arena of ``arena_bytes``.

    ``budget_bytes`` is the budget asked for; ``plan`` is the plan the blocks come from,
    planned at ``plan.budget_bytes`` (below ``budget_bytes`` when it had to be re-planned
    for the packing to fit). ``peak_bytes`` is the most bytes live at once (the least any
    packing needs).
    """

    plan: Plan
    budget_bytes: int
    arena_bytes: int
    peak_bytes: int
    blocks: tuple[Block, ...]

    def blocks_of(self, obj_id: str) -> tuple[Block, ...]:
        return tuple(block for block in self.blocks if block.obj_id == obj_id)


def place(planned: Plan, *, replans: int = REPLANS) -> Placement:
    """Pack ``planned`` into one arena no larger than its budget.

    When fragmentation makes the arena larger than the budget, re-plan (same planner) at a
    capacity reduced by the excess and pack again (never below the smallest budget the
    planner reports when a capacity is infeasible). Raises ``PlanningError`` naming the
    budget and the smallest arena found when ``replans`` re-plans do not make it fit.
    """
    budget = planned.budget_bytes
    current = planned
    smallest: int | None = None
    floor = 1
    for _ in range(replans + 1):
        intervals = residency_blocks(current)
        blocks, arena = _pack_within(intervals, budget)
        if arena <= budget:
            return Placement(current, budget, arena, live_peak_bytes(intervals), blocks)
        smallest = arena if smallest is None else min(smallest, arena)
        capacity = max(floor, current.budget_bytes - (arena - budget))
        if capacity >= current.budget_bytes:
            break
        try:
            current = plan(
                planned.program,
                capacity,
                planner=planned.planner,
                slow_budget_bytes=planned.slow_budget_bytes,
            )
        except InfeasibleBudget as exc:
            floor = exc.minimal_budget_bytes
            if floor >= current.budget_bytes:
                break
            current = plan(
                planned.program,
                floor,
                planner=planned.planner,
                slow_budget_bytes=planned.slow_budget_bytes,
            )
    raise PlanningError(
        f"program {planned.program.name!r}: fragmentation keeps every packing of its plan "
        f"above the fast budget of {format_size(budget)} ({budget} bytes): the smallest "
        f"arena found takes {smallest} bytes, and re-planning at smaller capacities "
        f"({replans} at most) did not make one fit; give a slightly larger budget"
    )


def _pack_within(intervals: list[Block], budget_bytes: int) -> tuple[tuple[Block, ...], int]:
    """The first packing order whose arena fits ``budget_bytes``, else the smallest arena."""
    best: tuple[tuple[Block, ...], int] | None = None
    for order in ORDERS:
        blocks = pack(intervals, order)
        arena = max((block.end_bytes for block in blocks), default=0)
        if best is None or arena < best[1]:
            best = (blocks, arena)
        if arena <= budget_bytes:
            break
    assert best is not None
    return best


def residency_blocks(planned: Plan) -> list[Block]:
    """Every fast-memory interval of the plan's recorded run, unplaced (offset 0)."""
    program, sim = planned.program, planned.sim
    times = {timing.task_id: (timing.start_us, timing.end_us) for timing in sim.tasks}
    transfers = {(t.obj_id, t.direction, t.enqueued_by): t for t in sim.transfers}
    sizes = {obj.id: obj.size_bytes for obj in program.objects}
    since: dict[str, float] = {
        obj.id: 0.0
        for obj in program.objects
        if program.exists_at_start(obj.id) and obj.location is Location.FAST
    }
    blocks: list[Block] = []

    def close(obj_id: str, end_us: float) -> None:
        blocks.append(Block(since.pop(obj_id), end_us, sizes[obj_id], 0, obj_id=obj_id))

    for task in program.tasks:
        start_us, end_us = times[task.id]
        for obj_id in task.outputs:
            since[obj_id] = start_us
        if task.workspace_bytes:
            blocks.append(Block(start_us, end_us, task.workspace_bytes, 0, task_id=task.id))
        for obj_id in task.releases:
            close(obj_id, end_us)
        for obj_id in task.offloads:
            write_back = transfers.get((obj_id, "d2h", task.id))
            close(obj_id, write_back.end_us if write_back is not None else end_us)
        for obj_id in task.prefetches:
            since[obj_id] = transfers[(obj_id, "h2d", task.id)].start_us
    for obj_id in list(since):
        close(obj_id, sim.makespan_us)
    blocks.sort(
        key=lambda block: (block.start_us, block.end_us, block.obj_id or "", block.task_id or "")
    )
    return blocks


def _overlap(a: Block, b: Block) -> bool:
    """Whether two blocks are live at one instant (``[start, end)``; a zero-length block
    holds its instant)."""
    if a.start_us == a.end_us:
        if b.start_us == b.end_us:
            return a.start_us == b.start_us
        return b.start_us <= a.start_us < b.end_us
    if b.start_us == b.end_us:
        return a.start_us <= b.start_us < a.end_us
    return a.start_us < b.end_us and b.start_us < a.end_us


def live_peak_bytes(blocks: list[Block]) -> int:
    """The most bytes live at one instant (frees before reservations at equal times)."""
    events = sorted(
        [(block.start_us, 1, block.size_bytes) for block in blocks]
        + [
            (block.end_us, 2 if block.start_us == block.end_us else 0, -block.size_bytes)
            for block in blocks
        ]
    )
    live = peak = 0
    for _, _, change in events:
        live += change
        peak = max(peak, live)
    return peak


#: Packing orders, tried in turn until one fits the budget (the smallest arena is kept):
#: name -> (sort key of a block, tightest hole (True) or lowest hole (False)).
ORDERS: dict[str, tuple[Callable[[Block], tuple[float, ...]], bool]] = {
    "size": (lambda b: (-b.size_bytes, b.start_us, b.end_us), True),
    "start": (lambda b: (b.start_us, -b.size_bytes, b.end_us), True),
    "size-then-life": (lambda b: (-b.size_bytes, b.start_us - b.end_us, b.start_us), False),
    "life": (lambda b: (b.start_us - b.end_us, -b.size_bytes, b.start_us), True),
}


def pack(blocks: list[Block], order: str = "size", buckets: int = 128) -> tuple[Block, ...]:
    """Offsets for ``blocks`` in the given ``ORDERS`` order; returned in the order given."""
    if not blocks:
        return ()
    key, tightest = ORDERS[order]
    first = min(block.start_us for block in blocks)
    last = max(block.end_us for block in blocks)
    width = (last - first) / buckets or 1.0
    index: list[list[int]] = [[] for _ in range(buckets + 1)]

    def span(block: Block) -> range:
        low = min(buckets, int((block.start_us - first) / width))
        high = min(buckets, int((block.end_us - first) / width))
        return range(low, high + 1)

    ranked = sorted(range(len(blocks)), key=lambda i: (*key(blocks[i]), i))
    offsets = [0] * len(blocks)
    seen = [-1] * len(blocks)
    for i in ranked:
        block = blocks[i]
        taken: list[tuple[int, int]] = []
        for bucket in span(block):
            for j in index[bucket]:
                if seen[j] != i and _overlap(block, blocks[j]):
                    taken.append((offsets[j], offsets[j] + blocks[j].size_bytes))
                seen[j] = i
        offsets[i] = _fit(sorted(taken), block.size_bytes, tightest)
        for bucket in span(block):
            index[bucket].append(i)
    return tuple(
        attrs.evolve(block, offset_bytes=offset)
        for block, offset in zip(blocks, offsets, strict=True)
    )


def _fit(taken: list[tuple[int, int]], size_bytes: int, tightest: bool) -> int:
    """The offset of the tightest (or the lowest) hole of at least ``size_bytes`` between
    the sorted ``taken`` ranges (lowest on ties); above all of them when none fits."""
    best_offset, best_hole = -1, None
    top = 0
    for low, high in taken:
        hole = low - top
        if hole >= size_bytes and (best_hole is None or hole < best_hole):
            best_offset, best_hole = top, hole
            if not tightest:
                break
        top = max(top, high)
    return best_offset if best_hole is not None else top


def check_placement(placement: Placement) -> list[str]:
    """Every pair of blocks live at the same time whose addresses overlap (empty: sound)."""
    faults = []
    blocks = sorted(placement.blocks, key=lambda block: block.offset_bytes)
    starts = [block.offset_bytes for block in blocks]
    for i, block in enumerate(blocks):
        stop = bisect.bisect_left(starts, block.end_bytes)
        for other in blocks[i + 1 : stop]:
            if _overlap(block, other):
                faults.append(f"{_name(block)} and {_name(other)} overlap in time and address")
    return faults


def _name(block: Block) -> str:
    return f"object {block.obj_id!r}" if block.obj_id else f"workspace of {block.task_id!r}"
