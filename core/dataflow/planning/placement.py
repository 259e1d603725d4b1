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
lifetime into the lowest hole, longest-lived first), then seeded restarts with sizes
jittered, and the smallest arena is kept.
Intervals are half-open in the run's event order (``Block.start``/``end``): what is freed
can be reused by a reservation that comes after it, even at the same instant.

If the arena comes out larger than the budget (fragmentation), ``place`` re-plans at the
plan's live peak less the excess, and packs again, a bounded number of times.
"""

from __future__ import annotations

import bisect
import random
from collections.abc import Callable

import attrs

from dataflow.planning.api import Plan, plan
from dataflow.planning.feasibility import InfeasibleBudget
from dataflow.planning.intervals import PlanningError
from dataflow.schema import Location
from dataflow.units import format_size

#: How many times ``place`` re-plans at a smaller capacity before giving up.
REPLANS = 6
#: Seeded restarts tried when no fixed order fits, for plans of at most RESTART_BLOCKS blocks.
RESTARTS = 32
RESTART_BLOCKS = 1000


@attrs.frozen
class Block:
    """One interval of fast memory: ``obj_id``'s bytes, or ``task_id``'s workspace.

    ``start``/``end`` order the reservation and the freeing among all events of the run,
    as ``(time_us, pass, phase)``: within one instant the execution model runs passes of
    completions (task, d2h, h2d), then dispatch, then the d2h and h2d starts (``PHASE``),
    and a task that costs nothing ends one pass after it starts. The block is live over
    ``[start, end)``.
    """

    start_us: float
    end_us: float
    size_bytes: int
    offset_bytes: int
    obj_id: str | None = None
    task_id: str | None = None
    start: tuple[float, int, int] = (0.0, 0, 0)
    end: tuple[float, int, int] = (0.0, 0, 0)

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
    #: when task workspace is not in the arena: the most any task takes from the device
    #: allocator beside it (``arena_bytes`` + this stays within ``budget_bytes``)
    workspace_outside_bytes: int = 0

    def blocks_of(self, obj_id: str) -> tuple[Block, ...]:
        return tuple(block for block in self.blocks if block.obj_id == obj_id)


def place(planned: Plan, *, replans: int = REPLANS, workspace_in_arena: bool = True) -> Placement:
    """Pack ``planned`` into one arena no larger than its budget.

    With ``workspace_in_arena=False`` tasks' workspace is not packed: their kernels take it
    from the device allocator (temporaries of framework ops), so the arena must leave the
    largest task workspace free beside it: ``arena_bytes + workspace_outside_bytes`` stays
    within the budget.

    When fragmentation makes the arena larger than the budget, re-plan (same planner) at
    the plan's live peak less the excess, and pack again (never below the smallest budget the
    planner reports when a capacity is infeasible). Raises ``PlanningError`` naming the
    budget and the smallest arena found when ``replans`` re-plans do not make it fit.
    """
    budget = planned.budget_bytes
    outside = (
        0
        if workspace_in_arena
        else max((task.workspace_bytes for task in planned.program.tasks), default=0)
    )
    limit = budget - outside
    current = planned
    smallest: int | None = None
    floor = 1
    for _ in range(replans + 1):
        intervals = residency_blocks(current)
        if outside:
            intervals = [block for block in intervals if block.obj_id is not None]
        blocks, arena = _pack_within(intervals, limit)
        if arena <= limit:
            return Placement(current, budget, arena, live_peak_bytes(intervals), blocks, outside)
        smallest = arena if smallest is None else min(smallest, arena)
        # Fragmentation of this packing is arena - live peak; ask the next plan for a live
        # peak that much below the budget.
        live = live_peak_bytes(intervals)
        capacity = max(floor, min(current.budget_bytes, live) - (arena - limit))
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
        f"above the fast budget of {format_size(budget)} ({budget} bytes"
        f"{f', less {outside} bytes of task workspace beside the arena' if outside else ''}): "
        f"the smallest arena found takes {smallest} bytes, and re-planning at smaller capacities "
        f"({replans} at most) did not make one fit; give a slightly larger budget"
    )


def _pack_within(intervals: list[Block], budget_bytes: int) -> tuple[tuple[Block, ...], int]:
    """The first packing whose arena fits ``budget_bytes`` (the fixed orders, then up to
    ``RESTARTS`` seeded restarts for up to ``RESTART_BLOCKS`` blocks), else the smallest."""
    best: tuple[tuple[Block, ...], int] | None = None
    restarts = RESTARTS if len(intervals) <= RESTART_BLOCKS else 0
    attempts = [(order, None) for order in ORDERS] + [("size", k) for k in range(restarts)]
    for order, seed in attempts:
        blocks = pack(intervals, order, seed=seed)
        arena = max((block.end_bytes for block in blocks), default=0)
        if best is None or arena < best[1]:
            best = (blocks, arena)
        if arena <= budget_bytes:
            break
    assert best is not None
    return best


#: Order of the steps of one pass at one instant (docs/execution_model.md).
PHASE = {"task-end": 0, "d2h-end": 1, "h2d-end": 2, "dispatch": 3, "d2h-start": 4, "h2d-start": 5}
_AT_START = (0.0, 0, 0)


def residency_blocks(planned: Plan) -> list[Block]:
    """Every fast-memory interval of the plan's recorded run, unplaced (offset 0)."""
    program, sim = planned.program, planned.sim
    transfers = {(t.obj_id, t.direction, t.enqueued_by): t for t in sim.transfers}
    sizes = {obj.id: obj.size_bytes for obj in program.objects}
    since: dict[str, tuple[float, float, int, int]] = {
        obj.id: (0.0, *_AT_START)
        for obj in program.objects
        if program.exists_at_start(obj.id) and obj.location is Location.FAST
    }
    blocks: list[Block] = []

    def close(obj_id: str, end_us: float, end: tuple[float, int, int]) -> None:
        start_us, *start = since.pop(obj_id)
        blocks.append(
            Block(start_us, end_us, sizes[obj_id], 0, obj_id=obj_id, start=tuple(start), end=end)
        )

    previous_end_us, previous_end_pass = None, 0
    end_pass: dict[str, int] = {}
    for task, timing in zip(program.tasks, sim.tasks, strict=True):
        start_us, end_us = timing.start_us, timing.end_us
        # The pass of this instant in which the task starts, and the one in which it ends.
        start_pass = previous_end_pass if previous_end_us == start_us else 1
        finish_pass = start_pass + 1 if end_us == start_us else 1
        previous_end_us, previous_end_pass = end_us, finish_pass
        end_pass[task.id] = finish_pass
        started = (start_us, start_pass, PHASE["dispatch"])
        ended = (end_us, finish_pass, PHASE["task-end"])
        for obj_id in task.outputs:
            since[obj_id] = (start_us, *started)
        if task.workspace_bytes:
            blocks.append(
                Block(
                    start_us,
                    end_us,
                    task.workspace_bytes,
                    0,
                    task_id=task.id,
                    start=started,
                    end=ended,
                )
            )
        for obj_id in task.releases:
            close(obj_id, end_us, ended)
        for obj_id in task.offloads:
            back = transfers.get((obj_id, "d2h", task.id))
            if back is None:  # clean: dropped at once
                close(obj_id, end_us, ended)
            else:
                close(obj_id, back.end_us, (back.end_us, 1, PHASE["d2h-end"]))
        for obj_id in task.prefetches:
            load = transfers[(obj_id, "h2d", task.id)]
            # The earliest pass it can have started in: a block that starts no later than
            # it really did is only ever more cautious.
            first = end_pass[task.id] if load.start_us == load.enqueue_us else 1
            since[obj_id] = (load.start_us, load.start_us, first, PHASE["h2d-start"])
    finish = (sim.makespan_us, 1 << 30, 0)
    for obj_id in list(since):
        close(obj_id, sim.makespan_us, finish)
    blocks.sort(key=lambda block: (block.start, block.end, block.obj_id or "", block.task_id or ""))
    return blocks


def _overlap(a: Block, b: Block) -> bool:
    """Whether two blocks are live at one moment of the run's event order."""
    return a.start < b.end and b.start < a.end


def live_peak_bytes(blocks: list[Block]) -> int:
    """The most bytes live at one moment of the run's event order."""
    events = sorted(
        [(block.start, 1, block.size_bytes) for block in blocks]
        + [(block.end, 0, -block.size_bytes) for block in blocks]
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


def pack(
    blocks: list[Block], order: str = "size", *, seed: int | None = None, buckets: int = 128
) -> tuple[Block, ...]:
    """Offsets for ``blocks`` in the given ``ORDERS`` order; returned in the order given.

    With ``seed``, a restart for when the fixed orders all fail: blocks are ranked by
    ``size ** weight`` times a random factor in [0.5, 1.5], where ``weight`` cycles through
    1, 1/2 and 0 with the seed (0: a random order), with a random hole rule
    (``random.Random(seed)``: the same seed gives the same packing).
    """
    if not blocks:
        return ()
    if seed is None:
        key, tightest = ORDERS[order]
        keys = [(*key(block), i) for i, block in enumerate(blocks)]
    else:
        rng = random.Random(seed)
        tightest = rng.random() < 0.5
        keys = [
            (-block.size_bytes * rng.uniform(0.5, 1.5), rng.random(), i)
            for i, block in enumerate(blocks)
        ]
    first = min(block.start_us for block in blocks)
    last = max(block.end_us for block in blocks)
    width = (last - first) / buckets or 1.0
    index: list[list[int]] = [[] for _ in range(buckets + 1)]

    def span(block: Block) -> range:
        low = min(buckets, int((block.start_us - first) / width))
        high = min(buckets, int((block.end_us - first) / width))
        return range(low, high + 1)

    offsets = [0] * len(blocks)
    seen = [-1] * len(blocks)
    for i in sorted(range(len(blocks)), key=keys.__getitem__):
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
