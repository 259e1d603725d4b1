"""Fast-memory blocks of a plan, and packing them into one arena.

``residency_blocks`` reads a plan's simulated timeline into blocks: every stretch of time
an object holds fast memory (from its reservation to its freeing), and every task's
workspace while the task runs, each ordered among the run's events
(``Block.start``/``end``). ``pack`` gives each block an offset, greedily in one of the
``ORDERS`` (largest first into the tightest hole, by start time, ...) or a seeded random
one, so that two blocks live at the same moment never share an address.
``live_peak_bytes`` is the least any packing needs. ``placement.place`` drives these
over a plan and re-plans when fragmentation leaves the arena over the budget.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import attrs

from dataflow.planning.plans import Plan
from dataflow.schema import Location


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


PHASE = {"task-end": 0, "d2h-end": 1, "h2d-end": 2, "dispatch": 3, "d2h-start": 4, "h2d-start": 5}
AT_START = (0.0, 0, 0)
#: The pass number of "the end of the run" (after every pass of the last instant).
END_PASS = 1 << 30


def residency_blocks(planned: Plan) -> list[Block]:
    """Every fast-memory interval of the plan's recorded run, unplaced (offset 0)."""
    program, sim = planned.program, planned.sim
    transfers = {(t.obj_id, t.direction, t.enqueued_by): t for t in sim.transfers}
    sizes = {obj.id: obj.size_bytes for obj in program.objects}
    since: dict[str, tuple[float, float, int, int]] = {
        obj.id: (0.0, *AT_START)
        for obj in program.objects
        if program.exists_at_start(obj.id) and obj.location is Location.FAST
    }
    blocks: list[Block] = []

    def close(obj_id: str, end_us: float, end: tuple[float, int, int]) -> None:
        start_us, *start = since.pop(obj_id)
        blocks.append(
            Block(start_us, end_us, sizes[obj_id], 0, obj_id=obj_id, start=tuple(start), end=end)
        )

    end_pass: dict[str, int] = {}

    def fire(task, end_us: float, ended: tuple[float, int, int]) -> None:
        """Close and open blocks for a task's (or the prologue's) directives."""
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

    # The prologue "ends" at time 0 in the first pass, before task 0 can start.
    end_pass[program.prologue.id] = 1
    fire(program.prologue, 0.0, (0.0, 1, PHASE["task-end"]))
    previous_end_us, previous_end_pass = None, 0
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
        fire(task, end_us, ended)
    finish = (sim.makespan_us, END_PASS, 0)
    for obj_id in list(since):
        close(obj_id, sim.makespan_us, finish)
    blocks.sort(key=lambda block: (block.start, block.end, block.obj_id or "", block.task_id or ""))
    return blocks


def overlap(a: Block, b: Block) -> bool:
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
    # Many blocks of a few sizes (a large model's weights, gradients, saves): the
    # longer-lived of one size first, then bytes x lifetime, so that long-lived small
    # blocks are not left to go on top of every hole.
    "size-longest": (lambda b: (-b.size_bytes, b.start_us - b.end_us, b.start_us), True),
    "area": (lambda b: (-b.size_bytes * (b.end_us - b.start_us), b.start_us), False),
}


def pack(blocks: list[Block], order: str = "size", *, seed: int | None = None) -> tuple[Block, ...]:
    """Offsets for ``blocks`` in the given ``ORDERS`` order; returned in the order given.

    With ``seed``, a restart for when the fixed orders all fail: blocks are ranked by
    size times a random factor in [0.5, 1.5], with a random hole rule
    (``random.Random(seed)``: the same seed gives the same packing).
    """
    if not blocks:
        return ()
    ranked, tightest = ranking(blocks, order, seed)
    sizes = [block.size_bytes for block in blocks]
    offsets = offsets_of(sizes, overlapping(blocks), ranked, tightest)
    return tuple(
        attrs.evolve(block, offset_bytes=offset)
        for block, offset in zip(blocks, offsets, strict=True)
    )


def ranking(blocks: list[Block], order: str, seed: int | None) -> tuple[list[int], bool]:
    """Block indices in packing order, and whether each takes the tightest hole."""
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
    return sorted(range(len(blocks)), key=keys.__getitem__), tightest


def overlapping(blocks: list[Block]) -> list[list[int]]:
    """For each block, the blocks live at some moment it is (one sweep in event order)."""
    events = sorted(
        [(block.start, 1, i) for i, block in enumerate(blocks)]
        + [(block.end, 0, i) for i, block in enumerate(blocks)]
    )
    neighbours: list[list[int]] = [[] for _ in blocks]
    live: set[int] = set()
    for _, starting, i in events:
        if not starting:
            live.discard(i)
            continue
        for j in live:
            neighbours[i].append(j)
            neighbours[j].append(i)
        live.add(i)
    return neighbours


def offsets_of(
    sizes: list[int],
    neighbours: list[list[int]],
    ranked: list[int],
    tightest: bool,
    pairs: dict[int, int] | None = None,
) -> list[int]:
    """Each block in ``ranked`` order put in a hole between the placed blocks it overlaps;
    a block of a pair takes its partner's offset once the partner is placed."""
    partner = dict(pairs or {})
    partner.update({b: a for a, b in list(partner.items())})
    offsets = [-1] * len(sizes)
    for i in ranked:
        if offsets[i] >= 0:
            continue
        taken = sorted(
            (offsets[j], offsets[j] + sizes[j]) for j in neighbours[i] if offsets[j] >= 0
        )
        offsets[i] = _fit(taken, sizes[i], tightest)
        if i in partner:
            offsets[partner[i]] = offsets[i]
    return offsets


#: Every block starts at a multiple of this many bytes (so every typed view of an object
#: is aligned for any dtype and for vectorised loads), or of its own size when smaller.
ALIGN_BYTES = 16


def _aligned(offset: int, size_bytes: int) -> int:
    align = ALIGN_BYTES
    while align > 1 and size_bytes % align:
        align //= 2
    return -(-offset // align) * align


def _fit(taken: list[tuple[int, int]], size_bytes: int, tightest: bool) -> int:
    """The offset of the tightest (or the lowest) hole of at least ``size_bytes`` between
    the sorted ``taken`` ranges (lowest on ties); above all of them when none fits.
    Offsets are aligned (``ALIGN_BYTES``)."""
    best_offset, best_hole = -1, None
    top = 0
    for low, high in taken:
        start = _aligned(top, size_bytes)
        hole = low - start
        if hole >= size_bytes and (best_hole is None or hole < best_hole):
            best_offset, best_hole = start, hole
            if not tightest:
                break
        top = max(top, high)
    return best_offset if best_hole is not None else _aligned(top, size_bytes)
