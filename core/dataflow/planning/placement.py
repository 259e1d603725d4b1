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

If the arena comes out larger than the budget (fragmentation), ``pack_plan`` re-plans at
the plan's live peak less the excess, and packs again, a bounded number of times. How to
re-plan is handed in (``Replan``): ``api.place`` passes the planner's own re-planner.

In a cyclic plan a persistent object homed in fast memory is resident at the end of an
iteration and at the start of the next: its last block (to the end) and its first block
(from time 0) are one residency across the boundary, so they are packed as one unit and
share an offset; the next iteration finds the object where the last one left it, and the
engine moves nothing between steps.

The blocks and one packing of them are ``arena.py``'s (``residency_blocks``, ``pack``);
this module tries the orders, restarts and repairs, and calls the re-planner.
"""

from __future__ import annotations

import bisect
from collections.abc import Callable

import attrs

from dataflow.planning.arena import (
    AT_START,
    END_PASS,
    ORDERS,
    Block,
    live_peak_bytes,
    offsets_of,
    overlap,
    overlapping,
    ranking,
    residency_blocks,
)
from dataflow.planning.intervals import PlanningError
from dataflow.planning.plans import Plan
from dataflow.schema import Location, Program
from dataflow.units import format_size

#: ``replan(current, capacity_bytes)``: a plan of the same program at ``capacity_bytes``
#: (or near it), None when there is none; ``current`` is the last plan packed.
Replan = Callable[[Plan, int], Plan | None]

#: How many times ``place`` re-plans at a smaller capacity before giving up.
REPLANS = 6
#: Once a re-planned capacity packs, bisection towards the budget stops when the capacity
#: is known within budget / REFINE_PARTS.
REFINE_PARTS = 256
#: Seeded restarts tried when no fixed order fits, for plans of at most RESTART_BLOCKS blocks.
RESTARTS = 32
RESTART_BLOCKS = 1000
#: When nothing above fits, the repair (``_repair``): the blocks that end above the budget
#: move forward in the packing order by each of these fractions of the block count in
#: turn, for up to REPAIR_ROUNDS packings per fraction. Session 19: of 73 packings that
#: two device runs' plans (OLMoE 1B-7B at 16 GiB by layer, Llama 3.2 1B at 4 GiB by
#: round) asked for, each with its live peak within the budget, 3 fitted by the orders
#: and restarts alone, 40 with the repair (12 rounds of 0.05, 0.2, 1; 16 rounds of 0.05
#: and 0.2 fitted 39, 32 of 0.1 fitted 36).
REPAIR_STEPS = (0.05, 0.2, 1.0)
REPAIR_ROUNDS = 12
#: The repair is tried only when the smallest arena is at most this times the budget: of
#: those 73 packings it fitted 37 of the 43 that started up to 8 % over (the most, 6.8 %)
#: and none of the 27 that started further; each try costs up to 36 packings, and a
#: minimal-budget search probes many capacities that cannot fit (OLMoE's at 8 GiB: 27 s
#: without the repair, 94 s with it at every probe, 54 s with this bound).
REPAIR_WITHIN = 1.08


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


def pack_plan(
    planned: Plan,
    replan: Replan,
    *,
    replans: int = REPLANS,
    workspace_in_arena: bool = True,
    workspace_beside_bytes: int = 0,
) -> Placement:
    """Pack ``planned`` into one arena no larger than its budget, re-planning with
    ``replan`` while fragmentation keeps it over (what ``api.place`` does; see there)."""
    budget = planned.budget_bytes + workspace_beside_bytes
    outside = (
        workspace_beside_bytes
        if workspace_in_arena
        else max(
            workspace_beside_bytes,
            max((task.workspace_bytes for task in planned.program.tasks), default=0),
        )
    )
    placement, smallest = pack_or_replan(planned, budget, outside, replans, replan)
    if placement is not None:
        return placement
    held = live_peak_bytes([b for b in residency_blocks(planned) if b.obj_id is not None])
    why = ""
    if outside and held > budget - outside:
        why = (
            f"; its plan holds {held} bytes of objects at once, more than that: it counts "
            "each task's workspace within the budget only while the task runs, so plan the "
            "program without task workspace at the budget less the largest "
            "(without_workspace, workspace_beside_bytes)"
        )
    raise PlanningError(
        f"program {planned.program.name!r}: fragmentation keeps every packing of its plan "
        f"above the fast budget of {format_size(budget)} ({budget} bytes"
        f"{f', less {outside} bytes of task workspace beside the arena' if outside else ''}): "
        f"the smallest arena found takes {smallest} bytes, and re-planning at smaller capacities "
        f"({replans} at most) did not make one fit; give a slightly larger budget{why}"
    )


def without_workspace(program: Program) -> tuple[Program, int]:
    """``program`` with no task holding workspace, and the most any task held: planned at
    a budget less that, its objects leave room for any task's workspace beside the arena
    at every instant (``place(..., workspace_beside_bytes=...)``)."""
    largest = max((task.workspace_bytes for task in program.tasks), default=0)
    tasks = tuple(attrs.evolve(task, workspace_bytes=0) for task in program.tasks)
    return attrs.evolve(program, tasks=tasks), largest


def pack_or_replan(
    planned: Plan,
    budget: int,
    outside: int,
    replans: int,
    replan: Replan,
    *,
    refine: bool = True,
) -> tuple[Placement | None, int | None]:
    """Pack ``planned``; while no packing fits, re-plan at the last plan's live peak less
    its excess and pack again (twice that excess, and so on, while the arena does not
    shrink: a smaller plan can fragment more); once one fits (with ``refine``), bisect the
    capacity between the largest that packed and the smallest that did not, keeping the
    fastest placement. At most ``replans`` re-plans in all (``place``). The placement
    (None when none fits) and the smallest arena found."""
    limit = budget - outside
    tolerance = max(1, budget // REFINE_PARTS)
    current: Plan | None = planned
    best: Placement | None = None
    smallest: int | None = None
    capacity = fails_at = planned.budget_bytes
    fits_at = live = arena = 0
    shave, last_arena = 0, None
    for attempt in range(replans + 1):
        if attempt:
            if best is None:
                # Fragmentation of this packing is arena - live peak; ask the next plan
                # for a live peak that much below the budget (more when the last re-plan
                # did not shrink the arena).
                grew = last_arena is not None and arena >= last_arena
                shave = 2 * shave if grew else arena - limit
                last_arena = arena
                smaller = min(capacity, current.budget_bytes, live) - shave
                if smaller < 1 or smaller >= capacity:
                    break
                capacity = smaller
            elif refine and fails_at - fits_at > tolerance:
                capacity = (fits_at + fails_at) // 2
            else:
                break
            found = replan(current, capacity)
            if found is None:
                if best is None:
                    break
                fails_at = capacity
                continue
            current = found
        intervals = residency_blocks(current)
        if outside:
            intervals = [block for block in intervals if block.obj_id is not None]
        blocks, arena = _pack_within(intervals, limit, wrap_pairs(current, intervals))
        live = live_peak_bytes(intervals)
        smallest = arena if smallest is None else min(smallest, arena)
        if arena > limit:
            fails_at = min(fails_at, capacity)
            continue
        fits_at = max(fits_at, capacity)
        if best is None or _step_us(current) < _step_us(best.plan):
            best = Placement(current, budget, arena, live, blocks, outside)
    return best, smallest


def _step_us(planned: Plan) -> float:
    """What one step of ``planned`` takes: a cyclic plan's steady-state iteration."""
    return planned.cycle.iteration_us if planned.cycle is not None else planned.makespan_us


def wrap_pairs(planned: Plan, blocks: list[Block]) -> dict[int, int]:
    """For a cyclic plan: each fast-homed persistent object's last block index -> its first
    block index, where they are two blocks (the object is dropped and fetched again within
    the iteration); they must share an offset (module doc). Empty for other plans."""
    program = planned.program
    if not planned.cyclic:
        return {}
    homed = {
        obj
        for obj in program.persistent
        if program.objects_by_id[obj].location is Location.FAST
        and program.final_locations.get(obj) is Location.FAST
    }
    first: dict[str, int] = {}
    last: dict[str, int] = {}
    for i, block in enumerate(blocks):
        if block.obj_id in homed:
            first.setdefault(block.obj_id, i)
            last[block.obj_id] = i
    return {
        last[obj]: first[obj]
        for obj in first
        if last[obj] != first[obj]
        and blocks[first[obj]].start == AT_START
        and blocks[last[obj]].end[1] == END_PASS
    }


def _pack_within(
    intervals: list[Block], budget_bytes: int, pairs: dict[int, int] | None = None
) -> tuple[tuple[Block, ...], int]:
    """The first packing whose arena fits ``budget_bytes`` (the fixed orders, then up to
    ``RESTARTS`` seeded restarts for up to ``RESTART_BLOCKS`` blocks, then ``_repair`` of
    the smallest), else the smallest.
    ``pairs`` maps a block to the one it must share an offset with (``wrap_pairs``)."""
    if not intervals:
        return (), 0
    best: tuple[list[int], int] | None = None
    restarts = RESTARTS if len(intervals) <= RESTART_BLOCKS else 0
    attempts = [(order, None) for order in ORDERS] + [("size", k) for k in range(restarts)]
    neighbours = overlapping(intervals)
    sizes = [block.size_bytes for block in intervals]
    for later, earlier in (pairs or {}).items():  # one unit: either one's neighbours
        joined = sorted(set(neighbours[later]) | set(neighbours[earlier]) - {later, earlier})
        neighbours[later] = neighbours[earlier] = joined
    start: tuple[list[int], bool] | None = None
    for order, seed in attempts:
        ranked, tightest = ranking(intervals, order, seed)
        offsets = offsets_of(sizes, neighbours, ranked, tightest, pairs or {})
        arena = max(offset + size for offset, size in zip(offsets, sizes, strict=True))
        if best is None or arena < best[1]:
            best, start = (offsets, arena), (ranked, tightest)
        if arena <= budget_bytes:
            break
    assert best is not None and start is not None
    if budget_bytes < best[1] <= budget_bytes * REPAIR_WITHIN:
        best = _repair(sizes, neighbours, pairs or {}, budget_bytes, best, *start)
    placed = tuple(
        attrs.evolve(block, offset_bytes=offset)
        for block, offset in zip(intervals, best[0], strict=True)
    )
    return placed, best[1]


def _repair(
    sizes: list[int],
    neighbours: list[list[int]],
    pairs: dict[int, int],
    budget_bytes: int,
    best: tuple[list[int], int],
    ranked: list[int],
    tightest: bool,
) -> tuple[list[int], int]:
    """Pack again from the best packing's order, each time moving the blocks that ended
    above ``budget_bytes`` forward (a "squeaky wheel": they take their holes before the
    blocks that crowded them out), until one fits (``REPAIR_STEPS``, ``REPAIR_ROUNDS``).
    The offsets and arena of the first packing that fits, else of the smallest found."""
    count, first = len(sizes), best[0]
    for step in REPAIR_STEPS:
        rank = {block: position for position, block in enumerate(ranked)}
        offsets = first
        for _ in range(REPAIR_ROUNDS):
            for block in range(count):
                if offsets[block] + sizes[block] > budget_bytes:
                    rank[block] -= step * count
            order = sorted(range(count), key=rank.__getitem__)
            offsets = offsets_of(sizes, neighbours, order, tightest, pairs)
            arena = max(offset + size for offset, size in zip(offsets, sizes, strict=True))
            if arena < best[1]:
                best = (offsets, arena)
            if arena <= budget_bytes:
                return best
    return best


#: Order of the steps of one pass at one instant (docs/execution_model.md).
def check_placement(placement: Placement) -> list[str]:
    """Every pair of blocks live at the same time whose addresses overlap (empty: sound)."""
    faults = []
    blocks = sorted(placement.blocks, key=lambda block: block.offset_bytes)
    starts = [block.offset_bytes for block in blocks]
    for i, block in enumerate(blocks):
        stop = bisect.bisect_left(starts, block.end_bytes)
        for other in blocks[i + 1 : stop]:
            if overlap(block, other):
                faults.append(f"{_name(block)} and {_name(other)} overlap in time and address")
    return faults


def _name(block: Block) -> str:
    return f"object {block.obj_id!r}" if block.obj_id else f"workspace of {block.task_id!r}"
