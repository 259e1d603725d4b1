"""Lower bounds on the makespan of any plan of a chain: no valid plan can finish sooner.

Five bounds, each true for every plan the execution model allows:

- **compute**: the tasks run one at a time, so the makespan is at least the sum of costs.
- **link** (link-aware: bytes that must cross each link over its bandwidth, against the
  compute they can overlap): every object that starts in slow memory and is needed (by a
  task, or in fast memory at the end) crosses ``h2d`` once before its first use; transfers
  start at the earliest at program start (the prologue), and one link carries one
  transfer at a time. Task ``i`` therefore cannot start before the ``h2d`` time of every
  first load needed by tasks 0..i, nor before the
  earliest end of task ``i-1`` plus the gap the *handoff* bound (below) forces between
  them. Every object whose final location is ``slow`` and that ends dirty (created,
  mutated, or started in fast memory) is written back after its last change, over ``d2h``,
  one at a time: the run cannot end before the earliest end of task ``j`` plus the
  write-backs of every object last changed at or after ``j``. With a budget, a large
  load also waits for room (``ChainBounds._room_us``): an object that starts slow and
  that some task before its first use cannot hold beside what that task holds is either
  loaded after the last such task ends, or every task it overlaps makes room for it (the
  volume cover with those tasks' excess raised by its size, and what the fullest of them
  cannot keep comes back whole after the load starts); the least of the two timelines
  over where the load starts is a bound. And no load arrives early without
  room (the *ahead* bound, ``AheadPairs``): when task ``k`` starts, the objects that
  some task in ``(k, u]`` needs and that ``k`` does not use, that start slow or were used
  before ``k`` (their gap spans it), are resident or arriving only as far as the budget
  less ``k``'s footprint allows; the rest crosses ``h2d`` after ``k`` starts and before
  ``u`` starts, one transfer at a time (for checkpoint pairs ``k < u``).
- **volume** (needs a budget): at a task where the objects that must stay resident between
  two uses exceed the budget, at least that excess must leave fast memory and come back
  over ``h2d``, on top of the first loads. A gap cut once relieves every task it spans,
  but not a task after its next use: the bytes counted are the fewest that cover every
  task's excess (``cover_bytes``), so stretches over the budget that no one gap spans
  each count.
- **handoff** (needs a budget): the gaps between consecutive tasks do not overlap, so the
  makespan is at least the compute plus every gap forced between ``t`` and ``t+1`` (the
  end counts as a task that holds the objects whose final location is fast), the larger
  of two reasons:

  - *loads*: when ``t`` ends, fast memory holds at least what ``t`` itself holds (its
    base: uses and workspace), so of the objects ``t+1`` reads that ``t`` does not use, at
    most ``budget - base(t)`` bytes can already be there (resident or arriving); the rest
    must cross ``h2d`` after ``t`` ends and before ``t+1`` starts;
  - *write-backs*: when ``t+1`` starts, fast memory holds its base plus whatever of ``t``'s
    objects it does not use is still there; if that is over the budget, some of them must
    have left. Dead or clean ones leave at once, but one that ``t`` created or mutated and
    that is needed later (used again, or final location slow) leaves only when its
    write-back, which cannot start before ``t`` ends, is done. And when loads are forced,
    the last one starts only once everything ``t+1`` reads is reserved: if that and
    those objects of ``t`` are over the budget, the write-backs that make room end
    before it starts, so the gap is at least they plus the smallest thing ``t+1`` reads.

  Objects move whole: the transfers counted are the cheapest set of whole objects that
  covers the bytes (exact for up to ``EXACT_COVER`` objects, else bytes and the fewest
  transfers).
- **write-back** (needs a budget): the link bound's timeline, with the write-backs that
  must have *ended* to make room (``WritebackPairs``). When task ``k`` starts, fast
  memory holds its footprint and whichever of its *dirty candidates* are resident (the
  objects it does not use, needed after it, created or changed before it); an absent one
  has a current slow copy, which only a ``d2h`` transfer started after its last change
  and ended before ``k`` starts gives. So for a slot ``j`` (the end of task ``j - 1``),
  the candidates changed last at ``j`` or later, beyond the budget less ``k``'s
  footprint, crossed ``d2h`` one at a time between the earliest end of ``j - 1`` and the
  start of ``k``. An object that starts slow and is not changed before ``k`` may be
  absent for free. The room bound's loads are bounded the same way: when the load of
  ``X`` for task ``u`` starts (after task ``m`` ends), fast memory holds ``X``, and of
  ``u``'s other objects those not absent (the absent ones cross ``h2d`` after ``X``
  starts), and of the dirty objects changed by task ``m`` and needed after ``u``, those
  not written back (``ChainBounds._room_after_us``). Each direction runs at its own rate
  (a duplex limit only slows them), so it is a bound.

What the bounds read whatever the budget (the ahead and write-back pairs, the handoff
needs, the covers) is worked out once per chain in ``bound_tables.py``.
"""

from __future__ import annotations

import bisect
import itertools

import attrs

from dataflow.planning.bound_tables import (
    ahead_pairs,
    cover_bytes,
    cover_us,
    handoff_needs,
    object_changes,
    spanning_from,
    writeback_pairs,
)
from dataflow.planning.intervals import (
    Chain,
    Gaps,
    Origin,
    build_chain,
    build_gaps,
    kept_profile,
)
from dataflow.schema import Location, Program


@attrs.frozen
class LowerBound:
    """The bounds, in µs; ``best_us`` is the largest (the one a plan is measured against).
    ``writeback_us`` is the link bound with the write-backs that make room added, so it
    is never below ``link_us`` when there is a budget (0 without one)."""

    compute_us: float
    link_us: float
    volume_us: float = 0.0
    handoff_us: float = 0.0
    writeback_us: float = 0.0

    @property
    def best_us(self) -> float:
        return max(
            self.compute_us, self.link_us, self.volume_us, self.handoff_us, self.writeback_us
        )


def lower_bound(
    program: Program, budget_bytes: int | None = None, *, cyclic: bool = False
) -> LowerBound:
    """Lower bounds of ``program``'s bare chain (its directives are ignored); the volume
    bound needs ``budget_bytes`` (else the program's own budget, else it is 0). With
    ``cyclic``, bounds on the steady-state time of one iteration (``cyclic_lower_bound``)."""
    if budget_bytes is None and program.budget is not None:
        budget_bytes = program.budget.fast_bytes
    if cyclic:
        return cyclic_lower_bound(program, budget_bytes)
    return chain_lower_bound(build_chain(program), budget_bytes)


def cyclic_lower_bound(program: Program, budget_bytes: int | None) -> LowerBound:
    """Bounds on one iteration of ``program`` run as a loop, whatever home (fast or slow)
    its persistent objects get between iterations:

    - **compute**: the sum of task costs;
    - **link**: every iteration, each fed object that starts slow crosses ``h2d`` and each
      non-persistent object that must end slow and ends dirty crosses ``d2h``;
    - **volume**: where the objects that would stay resident between two uses (a
      persistent object's last use and its first use in the next iteration included)
      exceed the budget, at least that excess leaves and comes back every iteration, on
      top of the fed objects' loads.
    """
    persistent = set(program.persistent)
    objects = tuple(
        attrs.evolve(obj, location=Location.SLOW) if obj.id in persistent else obj
        for obj in program.objects
    )
    finals = {o: where for o, where in program.final_locations.items() if o not in persistent}
    chain = build_chain(attrs.evolve(program, objects=objects, final_locations=finals))
    n = chain.n_tasks
    compute_us = chain.start_us[n]
    loads_us = write_us = 0.0
    wrap = [0] * (n + 2)
    for life in chain.objects:
        if not life.uses:
            continue
        if life.obj_id in persistent:
            first, last = life.uses[0], life.uses[-1]
            wrap[last + 1] += life.size_bytes  # held from after its last use to the end
            wrap[n + 1] -= life.size_bytes
            wrap[0] += life.size_bytes  # and from the start to its first use
            wrap[first] -= life.size_bytes
            continue
        if life.origin is Origin.SLOW:
            loads_us += chain.h2d_us(life.size_bytes)
        if life.final is Location.SLOW and any(life.dirties):
            write_us += chain.d2h_us(life.size_bytes)
    volume_us = 0.0
    if budget_bytes is not None:
        kept = kept_profile(chain, build_gaps(chain))
        excess, held = 0, 0
        for t in range(n + 1):
            held += wrap[t]
            excess = max(excess, chain.base_bytes[t] + kept[t] + held - budget_bytes)
        volume_us = loads_us + (chain.h2d_us(excess) if excess > 0 else 0.0)
    return LowerBound(compute_us=compute_us, link_us=max(loads_us, write_us), volume_us=volume_us)


def chain_lower_bound(chain: Chain, budget_bytes: int | None) -> LowerBound:
    return ChainBounds(chain).at(budget_bytes)


#: The room bound looks at this many of the largest objects that start slow.
ROOM_LOADS = 2
#: Brackets of the tasks before ``last`` the room bound splits the load's start into.
ROOM_BRACKETS = 6


class ChainBounds:
    """``chain``'s lower bounds at any budget: what does not depend on the budget (first
    loads, last changes, the gaps, what each task boundary reads and leaves behind) is
    worked out once, so bounding several budgets of one chain (the monotone ladder) costs
    little more than the timeline walk per budget. ``at`` keeps what it found per budget:
    the search asks for its budget's bound, ``plan`` for the same one again.

    ``gaps`` are ``build_gaps(chain)`` when the caller has them already."""

    def __init__(self, chain: Chain, gaps: Gaps | None = None):
        self.chain = chain
        self._found: dict[tuple[int | None, bool], LowerBound] = {}
        self._last_plain: tuple[int | None, tuple] | None = None
        self._spanning: list[list[tuple[int, int]]] | None = None  # for ``cover_bytes``
        n = chain.n_tasks
        self.first_load_us = [0.0] * (n + 1)  # by the index of the first use
        self.write_back_us = [0.0] * (n + 1)  # by the index of the last change
        for life in chain.objects:
            if not life.uses:
                continue
            if life.origin is Origin.SLOW:
                self.first_load_us[life.uses[0]] += chain.h2d_us(life.size_bytes)
            if life.final is Location.SLOW:
                changed = [use for use, dirty in zip(life.uses, life.dirties, strict=True) if dirty]
                if changed:
                    self.write_back_us[changed[-1]] += chain.d2h_us(life.size_bytes)
        self.first_loads_us = sum(self.first_load_us)
        self.ahead = (
            ahead_pairs(chain, gaps if gaps is not None else build_gaps(chain)) if n else None
        )
        self.gaps = self.ahead.gaps if self.ahead is not None else build_gaps(chain)
        self.held = [
            base + kept
            for base, kept in zip(chain.base_bytes, kept_profile(chain, self.gaps), strict=True)
        ]
        self.peak_held = max(self.held, default=0)
        self.handoff = handoff_needs(chain) if n else None
        self.behind = writeback_pairs(chain) if n else None
        # the largest objects loaded for a first use after task 0: the room bound's loads
        heads = [
            life
            for life in chain.objects
            if life.origin is Origin.SLOW and life.uses and life.uses[0] >= 1
        ]
        heads.sort(key=lambda life: (-life.size_bytes, life.index))
        self.room_heads = tuple((life.size_bytes, life.uses[0]) for life in heads[:ROOM_LOADS])
        self.room_objects = tuple(life.index for life in heads[:ROOM_LOADS])
        self._room_behind_found: dict[tuple[int, int], tuple[int, tuple[int, ...]]] = {}
        self._covers: tuple[int | None, dict] = (None, {})  # ``_reloads`` of one budget
        self._spanning_at: dict[int, tuple[tuple[int, int], ...]] = {}
        self._changes: tuple[list, dict[str, int]] | None = None  # ``object_changes(chain)``

    def _reloads(self, budget_bytes: int, raised: tuple[int, int, int] | None = None) -> list[int]:
        """The volume cover's reloads by the index of the next use (``cover_bytes``); with
        ``raised`` = (first task, end task, bytes), every task in that range also holds
        that many bytes more. The room bound asks for the same covers with and without
        the write-back bound: those of the last budget are kept."""
        key = (budget_bytes, raised)
        if self._covers[0] != budget_bytes:
            self._covers = (budget_bytes, {})
        found = self._covers[1].get(key)
        if found is None:
            found = self._covers[1][key] = self._cover(budget_bytes, raised)
        return found

    def _cover(self, budget_bytes: int, raised: tuple[int, int, int] | None) -> list[int]:
        excess = [held - budget_bytes for held in self.held]
        if raised is not None:
            first, end, extra = raised
            excess[first:end] = [value + extra for value in excess[first:end]]
        if max(excess) <= 0:
            return [0] * self.chain.n_tasks
        if self._spanning is None:
            self._spanning = spanning_from(self.gaps, len(excess))
        return cover_bytes(self.gaps, excess, self._spanning)

    def _timeline(
        self,
        first_load_us: list[float],
        gaps: list[float],
        ready: tuple[int, float] = (-1, 0.0),
        budget_bytes: int | None = None,
        writeback: bool = False,
    ) -> tuple[float, list[float]]:
        """The link bound's timeline: task ``t`` starts no sooner than the loads due by it
        (``first_load_us`` by the index of the use), nor than the task before it ends plus
        ``gaps``, nor (``ready`` = (task, µs)) than a given time, nor (with a budget) than
        the *ahead* bound says (``AheadPairs``), nor (with ``writeback`` too) than the
        write-backs that must have ended for it to fit (``WritebackPairs``); the run ends
        no sooner than the loads
        due at the end, nor than a task's end plus the write-backs of everything last
        changed at or after it. Returns the bound and each task's earliest end."""
        cost = self.chain.cost_us
        n = self.chain.n_tasks
        start_us, loads_us = 0.0, 0.0
        earliest_end = []
        ahead = self.ahead if budget_bytes is not None else None
        if ahead is not None:
            per_byte_us = 1.0 / self.chain.h2d.bw_bytes_per_us
            points, column, bytes_ahead = ahead.points, ahead.column, ahead.bytes_ahead
            # per checkpoint k passed: its start less the room it leaves, in µs
            passed: list[float] = []
        behind = self.behind if writeback and budget_bytes is not None else None
        if behind is not None:
            d2h = self.chain.d2h
            d2h_per_byte_us = 1.0 / d2h.bw_bytes_per_us
            slots, rows, most = behind.slots, behind.behind_bytes, behind.most_bytes
            tasks_at = behind.column
        for t in range(n):
            loads_us += first_load_us[t]
            if loads_us > start_us:
                start_us = loads_us
            if t == ready[0] and ready[1] > start_us:
                start_us = ready[1]
            # before the ahead bound's checkpoint: its start counts for the pairs after it
            if behind is not None and tasks_at[t] >= 0 and most[tasks_at[t]] > budget_bytes:
                for slot, behind_bytes in zip(slots, rows[tasks_at[t]], strict=False):
                    over = behind_bytes - budget_bytes
                    if over <= 0:
                        break  # fewer bytes from later slots on
                    since_us = earliest_end[slot - 1] if slot else 0.0
                    count, written = behind.written_bytes(tasks_at[t], over)
                    bound_us = since_us + count * d2h.latency_us + written * d2h_per_byte_us
                    if bound_us > start_us:
                        start_us = bound_us
            if ahead is not None and column[t] >= 0:
                row = bytes_ahead[column[t]]
                for k_us, ahead_bytes in zip(passed, row, strict=False):
                    bound_us = k_us + ahead_bytes * per_byte_us
                    if bound_us > start_us:
                        start_us = bound_us
                passed.append(start_us - (budget_bytes - ahead.held_bytes[t]) * per_byte_us)
            end_us = start_us + cost[t]
            earliest_end.append(end_us)
            start_us = end_us + gaps[t]
        loads_us += first_load_us[n]
        link_us = max(start_us, loads_us, ready[1] if ready[0] == n else 0.0)
        if ahead is not None:
            for k_us, ahead_bytes in zip(passed, bytes_ahead[len(points)], strict=False):
                link_us = max(link_us, k_us + ahead_bytes * per_byte_us)
        write_back_us = self.write_back_us
        after_us = 0.0
        for t in range(n - 1, -1, -1):
            after_us += write_back_us[t]
            if after_us:
                link_us = max(link_us, earliest_end[t] + after_us)
        return link_us, earliest_end

    def _rooms(self, budget_bytes: int) -> list[tuple[int, int, int, int]]:
        """(size, first use, task, object) of each room-bound load: the last task before
        the object's first use at which it does not fit beside what is held there."""
        found = []
        held = self.held
        for (size, use), obj in zip(self.room_heads, self.room_objects, strict=True):
            room = budget_bytes - size
            last = next((t for t in range(use - 1, -1, -1) if held[t] > room), None)
            if last is not None:
                found.append((size, use, last, obj))
        return found

    def _room_behind(self, obj: int, last: int) -> tuple[int, tuple[int, ...]]:
        """For the load of object ``obj`` (first used by task ``use``) started after task
        ``last`` ends: the bytes of ``use``'s other inputs and mutates that exist then,
        and per write-back slot (``WritebackPairs.slots`` up to ``last + 1``) the bytes
        of the objects ``use`` does not use, needed after it (a later use, or a final
        location), changed last by task ``last`` at a slot at or after that one."""
        key = (obj, last)
        if key in self._room_behind_found:
            return self._room_behind_found[key]
        chain = self.chain
        lives = chain.objects
        use = lives[obj].uses[0]
        task = chain.program.tasks[use]
        used = {*task.inputs, *task.mutates}
        if self._changes is None:
            self._changes = object_changes(chain)
        slots = [slot for slot in self.behind.slots if slot <= last + 1]
        by_slot = [0] * (len(slots) + 1)
        held_bytes = 0
        index_of = self._changes[1]
        for obj_id in used:
            life = lives[index_of[obj_id]]
            if life.index != obj and (life.origin is not Origin.CREATED or life.uses[0] <= last):
                held_bytes += life.size_bytes
        for index, obj_id, size, needed_after, at, slot_of in self._changes[0]:
            if index == obj or obj_id in used or needed_after <= use:
                continue  # the load, the use's own, or not needed after the use
            changed = bisect.bisect_right(at, last)
            if changed:
                by_slot[bisect.bisect_right(slots, slot_of[changed - 1])] += size
        behind, running = [], 0
        for position in range(len(slots), 0, -1):
            running += by_slot[position]
            behind.append(running)
        found = (held_bytes, tuple(reversed(behind)))
        self._room_behind_found[key] = found
        return found

    def _room_after_us(
        self, budget_bytes: int, size: int, last: int, obj: int, earliest_end: list[float]
    ) -> float:
        """The earliest start of the first use of ``obj`` (``size`` bytes) when its load
        starts after task ``last`` ends, with the write-backs that make room for it: when
        the load starts, fast memory holds it, and of the first use's other inputs and
        mutates, those not absent (``a`` bytes absent, loaded after it), and of the dirty
        objects still needed after it, those not absent (written back since their last
        change). So for any write-back slot ``j``, ``behind_j + held + size - budget - a``
        bytes crossed ``d2h`` between the end of task ``j - 1`` and the load's start, and
        ``size + a`` cross ``h2d`` after it: the least over ``a`` (at its ends or the kink,
        the bound being convex in ``a`` until the write-backs are not needed) bounds the
        start, for each ``j``."""
        chain = self.chain
        h2d, d2h = chain.h2d, chain.d2h
        held_bytes, behind = self._room_behind(obj, last)
        after_us = earliest_end[last]
        best_us = after_us + h2d.transfer_us(size)
        for slot, behind_bytes in zip(self.behind.slots, behind, strict=False):
            over = behind_bytes + held_bytes + size - budget_bytes
            if over <= 0:
                break  # fewer bytes from later slots on
            since_us = (earliest_end[slot - 1] if slot else 0.0) + d2h.latency_us

            def start_us(absent: float, over: int = over, since_us: float = since_us) -> float:
                written = over - absent
                ready_us = after_us
                if written > 0:
                    ready_us = max(ready_us, since_us + written / d2h.bw_bytes_per_us)
                return ready_us + h2d.latency_us + (size + absent) / h2d.bw_bytes_per_us

            points = [0.0, float(min(held_bytes, over))]
            kink = over - (after_us - since_us) * d2h.bw_bytes_per_us
            if 0.0 < kink < points[1]:
                points.append(kink)
            best_us = max(best_us, min(map(start_us, points)))
        return best_us

    def _room_us(
        self,
        budget_bytes: int,
        size: int,
        use: int,
        last: int,
        gaps: list[float],
        plain: tuple[list[float], float, list[float]],
        writeback: bool = False,
        obj: int = -1,
    ) -> float:
        """The room bound of one load (the module docstring): the load of ``size`` bytes
        for task ``use`` starts after some task ``k - 1`` ends and before task ``k`` ends
        (or after task ``use - 1``), so every task from ``k`` to ``use - 1`` holds it too
        and no task from ``use`` on starts before it is in. ``last`` is the last task
        before ``use`` that cannot hold it beside everything it holds without cuts. The
        bound is the least over ``k``; the ``k`` up to ``last`` are taken in a few
        brackets, each bounded by its weakest ends (the fewest tasks that hold the load,
        the earliest start), so the minimum is never overstated. ``plain`` is the link
        bound's own timeline (its loads, bound and earliest ends); with ``writeback``, the
        timelines (``plain`` too) count the write-back bound, and so does the start of the
        load after ``last`` (``_room_after_us``; ``obj`` is the object loaded)."""
        loads_us, plain_us, earliest_end = plain
        load_us = self.chain.h2d_us(size)

        def ready_us(k: int) -> float:
            return (earliest_end[k - 1] if k >= 1 else 0.0) + load_us

        # after ``last``: nothing needs making room but write-backs
        after_us = ready_us(last + 1)
        if writeback and use < self.chain.n_tasks:
            after_us = self._room_after_us(budget_bytes, size, last, obj, earliest_end)
        least_us, _ = self._timeline(loads_us, gaps, (use, after_us), budget_bytes, writeback)
        if least_us <= plain_us:
            return least_us  # no better than the link bound whatever the brackets give
        points = sorted({max(0, last + 1 - 2**step) for step in range(ROOM_BRACKETS)} | {0})
        points.append(last + 1)
        for low, high in itertools.pairwise(points):
            high = min(high, last)  # the bracket's fewest holders still include ``last``
            reloads = self._reloads(budget_bytes, (high, use, size))
            start_us = ready_us(low) + self._held_reload_us(budget_bytes, size, high, use)
            if writeback and low >= 1 and use < self.chain.n_tasks:
                start_us = max(
                    start_us, self._room_after_us(budget_bytes, size, low - 1, obj, earliest_end)
                )
            bound_us, _ = self._timeline(
                self._loads_with(reloads), gaps, (use, start_us), budget_bytes, writeback
            )
            least_us = min(least_us, bound_us)
            if least_us <= plain_us:
                break
        return least_us

    def _held_reload_us(self, budget_bytes: int, size: int, high: int, use: int) -> float:
        """In a room-bound bracket (the load of ``size`` bytes for task ``use`` started
        before task ``high`` ends), the ``h2d`` time of the whole objects that must come
        back after the load starts and before ``use``: at some instant of each task ``t``
        from ``high`` to ``use - 1`` (the one holding the most is taken), fast memory holds
        the load, ``t``'s base and the objects kept across ``t`` that are still there;
        those beyond the budget are absent and cross ``h2d`` after that instant, before
        their next use. Those next used after ``use`` are counted as a share of their
        bytes, the others whole (``cover_us``)."""
        held = self.held
        first = max(high, 1)
        if first >= use:
            return 0.0
        t = max(range(first, use), key=lambda task: (held[task], task))
        need = held[t] + size - budget_bytes
        if need <= 0:
            return 0.0
        spanning = self._spanning_at.get(t)
        if spanning is None:
            gaps = self.gaps
            spanning = self._spanning_at[t] = tuple(
                (gaps.size_bytes[g], b)
                for g, (a, b) in enumerate(zip(gaps.a, gaps.b, strict=True))
                if a < t < b
            )
        near = [object_bytes for object_bytes, b in spanning if b <= use]
        need -= sum(object_bytes for object_bytes, b in spanning if b > use)
        return cover_us(near, need, self.chain.h2d) if near and need > 0 else 0.0

    def _loads_with(self, reloads: list[int]) -> list[float]:
        """First loads plus ``reloads`` (bytes, by the index of the next use)."""
        bandwidth = self.chain.h2d.bw_bytes_per_us
        loads = list(self.first_load_us)
        for use, size in enumerate(reloads):
            if size:
                loads[use] += size / bandwidth
        return loads

    def at(self, budget_bytes: int | None, *, rooms: bool = True) -> LowerBound:
        """The bounds at ``budget_bytes``; ``rooms=False`` leaves the room bound out of the
        link bound (cheaper, and still a bound: the search's stopping tests use it)."""
        key = (budget_bytes, rooms)
        if key not in self._found:
            self._found[key] = self._at(budget_bytes, rooms)
        return self._found[key]

    def _at(self, budget_bytes: int | None, rooms: bool) -> LowerBound:
        chain = self.chain
        n = chain.n_tasks
        compute_us = chain.start_us[n]
        if n == 0:
            return LowerBound(0.0, 0.0, 0.0)
        first_load_us, gaps, reload_us, link_us, earliest_end = self._plain(budget_bytes)
        writeback_us = link_us if budget_bytes is not None else 0.0
        behind = self.behind is not None and budget_bytes is not None
        writeback_end = earliest_end
        if behind and max(self.behind.most_bytes) > budget_bytes:
            writeback_us, writeback_end = self._timeline(
                first_load_us, gaps, budget_bytes=budget_bytes, writeback=True
            )
        if budget_bytes is not None and rooms:
            plain = (first_load_us, link_us, earliest_end)
            with_writeback = (first_load_us, writeback_us, writeback_end)
            for size, use, last, obj in self._rooms(budget_bytes):
                room = (budget_bytes, size, use, last, gaps)
                link_us = max(link_us, self._room_us(*room, plain))
                if behind:
                    writeback_us = max(
                        writeback_us, self._room_us(*room, with_writeback, True, obj)
                    )
            writeback_us = max(writeback_us, link_us)
        volume_us = handoff_us = 0.0
        if budget_bytes is not None:
            handoff_us = compute_us + sum(gaps)
            if reload_us or self.first_loads_us:
                volume_us = self.first_loads_us + reload_us
        return LowerBound(
            compute_us=compute_us,
            link_us=link_us,
            volume_us=volume_us,
            handoff_us=handoff_us,
            writeback_us=writeback_us,
        )

    def _plain(
        self, budget_bytes: int | None
    ) -> tuple[list[float], list[float], float, float, list[float]]:
        """What the bounds at ``budget_bytes`` share with and without the room bound: the
        loads by the index of the use (first loads and reloads), the handoff gaps, the
        reloads' time, and the link bound's timeline (its bound and earliest ends). Kept
        for the last budget asked (``at`` asks for both at one budget)."""
        if self._last_plain is not None and self._last_plain[0] == budget_bytes:
            return self._last_plain[1]
        chain = self.chain
        n = chain.n_tasks
        first_load_us = list(self.first_load_us)  # reloads added below
        # gaps[t]: idle time forced between task t and the next (0 without a budget)
        gaps = [0.0] * n
        reload_us = 0.0  # the fewest bytes that must leave and come back, over h2d
        if budget_bytes is not None:
            gaps = self.handoff.gaps_us(chain, budget_bytes)
            if self.peak_held > budget_bytes:
                # each reload lands before the gap's next use: the timeline below counts it
                # there, bytes only (a cut may be a share of one transfer)
                reloads = self._reloads(budget_bytes)
                bandwidth = chain.h2d.bw_bytes_per_us
                for use, size in enumerate(reloads):
                    if size:
                        first_load_us[use] += size / bandwidth
                reload_us = max(
                    chain.h2d_us(self.peak_held - budget_bytes),
                    chain.h2d.latency_us + sum(reloads) / bandwidth,
                )
        link_us, earliest_end = self._timeline(first_load_us, gaps, budget_bytes=budget_bytes)
        found = (first_load_us, gaps, reload_us, link_us, earliest_end)
        self._last_plain = (budget_bytes, found)
        return found
