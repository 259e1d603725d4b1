"""The event loop: docs/execution_model.md, step by step, over integer indices.

One function with local variables only: the planner calls it hundreds of times per plan,
so the hot path avoids attribute lookups, dict lookups and per-event objects. State per
object is a small int in a list (``fast``: 0 absent, 1 incoming, 2 resident; ``slow``:
0 absent, 1 current, 2 stale). With ``record=False`` nothing per event is kept.

A collective task holds the collective link, not compute: ``coll_task`` is the one running
(-1 when idle) and ``held`` the objects it uses, which no compute task may use and no
directive may drop until it ends. Programs without one never enter those branches.

With a duplex limit (``Links.duplex_bytes_per_us`` below the two directions' sum), a
transfer that starts while the other direction is busy runs at its shared rate, and the
one in flight on the other direction is re-timed (``duplex.retimed_end_us``); when either
ends, the other is re-timed back to its own rate. ``*_drain``: when the running
transfer's bytes start to move (its start plus the link's latency). Programs without a
limit never enter those branches.
"""

from __future__ import annotations

import math
from collections import deque

import attrs

from dataflow.schema import Links
from dataflow.sim.compiled import CompiledProgram
from dataflow.sim.diagnose import (
    MemoryState,
    bad_prefetch,
    describe_deadlock,
    describe_missing,
    failure,
    final_locations,
    not_resident,
)
from dataflow.sim.duplex import retimed_end_us
from dataflow.sim.failure import FailureKind, SimError
from dataflow.sim.states import ABSENT, CURRENT, INCOMING, RESIDENT, STALE

H2D, D2H, COLLECTIVE = "h2d", "d2h", "collective"


@attrs.frozen
class Outcome:
    """Raw totals and logs of one run; ``dataflow.sim.simulate`` turns it into a SimResult.

    Link totals are keyed by direction (``collective``: the collective tasks, counted as
    transfers of the bytes they reduce). Logs are None unless recording: ``task_log``
    holds (task index, start_us, end_us); ``transfer_log`` (object index, direction,
    enqueuing task index, enqueue_us, start_us, end_us), in the order transfers end;
    ``fast_log``/``slow_log`` (time_us, bytes) after every change.
    """

    makespan_us: float
    fast_peak_bytes: int
    slow_peak_bytes: int
    compute_busy_us: float
    link_transfers: dict[str, int]
    link_bytes: dict[str, int]
    link_busy_us: dict[str, float]
    error: SimError | None
    #: per object at the end (or the failure): the ``fast`` and ``slow`` states
    fast_state: list[int] = attrs.field(factory=list, repr=False)
    slow_state: list[int] = attrs.field(factory=list, repr=False)
    task_log: list[tuple[int, float, float]] | None = None
    transfer_log: list[tuple[int, str, int, float, float, float]] | None = None
    fast_log: list[tuple[float, int]] | None = None
    slow_log: list[tuple[float, int]] | None = None


def run(
    c: CompiledProgram,
    links: Links,
    fast_budget_bytes: int | None,
    slow_budget_bytes: int | None,
    record: bool,
) -> Outcome:
    """Run the compiled program to its end or its first failure."""
    inf = math.inf
    cap = inf if fast_budget_bytes is None else fast_budget_bytes
    slow_cap = inf if slow_budget_bytes is None else slow_budget_bytes
    size = c.size_bytes
    n_obj, n_task = len(size), c.n_tasks
    h2d_us = [links.h2d.latency_us + s / links.h2d.bw_bytes_per_us for s in size]
    d2h_us = [links.d2h.latency_us + s / links.d2h.bw_bytes_per_us for s in size]
    duplex = links.duplex_limited
    h2d_bw, d2h_bw = links.h2d.bw_bytes_per_us, links.d2h.bw_bytes_per_us
    h2d_lat, d2h_lat = links.h2d.latency_us, links.d2h.latency_us
    h2d_shared_bw, d2h_shared_bw = links.shared_bw
    h2d_shared_us = [h2d_lat + s / h2d_shared_bw for s in size] if duplex else h2d_us
    d2h_shared_us = [d2h_lat + s / d2h_shared_bw for s in size] if duplex else d2h_us
    needs, reserve, footprint, cost = c.needs, c.reserve_bytes, c.footprint_bytes, c.cost_us
    outputs, mutates, workspace = c.outputs, c.mutates, c.workspace_bytes
    releases, offloads, prefetches = c.releases, c.offloads, c.prefetches
    on_link, link_bytes = c.collective, c.collective_bytes
    coll_us = (
        [
            links.collective_us(b) if flag else 0.0
            for flag, b in zip(on_link, link_bytes, strict=True)
        ]
        if c.has_collectives
        else []
    )

    fast = [ABSENT] * n_obj
    slow = [ABSENT] * n_obj
    slow_space = [False] * n_obj
    leaving = [False] * n_obj  # an offload (d2h) of it is queued or running
    coming = [False] * n_obj  # a prefetch (h2d) of it is queued or running
    lost_by = [-1] * n_obj  # the task whose release dropped its only copy
    used = slow_used = 0
    for o in c.initial_fast:
        fast[o] = RESIDENT
        used += size[o]
    for o in (*c.initial_slow, *c.initial_backed):
        slow[o] = CURRENT
        slow_space[o] = True
        slow_used += size[o]
    peak, slow_peak = used, slow_used
    task_log = transfer_log = fast_log = slow_log = None
    if record:
        task_log, transfer_log = [], []
        fast_log, slow_log = [(0.0, used)], [(0.0, slow_used)]
    compute_busy = 0.0
    h2d_n = d2h_n = h2d_bytes = d2h_bytes = 0
    h2d_busy = d2h_busy = 0.0
    coll_n = coll_bytes = 0
    coll_busy = 0.0
    coll_task = -1  # the collective task running, -1 when the link is idle
    coll_end, coll_start = inf, 0.0
    held: frozenset[int] = frozenset()  # the objects the running collective task uses

    # FIFOs of entries (object, enqueue_us, enqueuing task); *_entry: the one running.
    h2d_q: deque[tuple[int, float, int]] = deque()
    d2h_q: deque[tuple[int, float, int]] = deque()
    h2d_entry = d2h_entry = (-1, 0.0, -1)
    h2d_obj = d2h_obj = -1  # the transfer running on the link, -1 when idle
    h2d_end = d2h_end = task_end = inf
    h2d_start = d2h_start = task_start = 0.0
    h2d_drain = d2h_drain = 0.0
    nxt = 0  # the next task to dispatch
    running = -1
    if c.has_prologue:  # the pseudo-task n_task: it "ends" at time 0, firing the prologue
        running, task_end = n_task, 0.0
    checked = -1  # the last task checked for certain failure when it became next
    now = 0.0
    error: SimError | None = None

    if used > cap or slow_used > slow_cap:
        which = "fast" if used > cap else "slow"
        error = failure(
            c,
            FailureKind.INITIAL_OVERFLOW,
            f"the objects that start in {which} memory take "
            f"{used if which == 'fast' else slow_used} bytes, more than its budget "
            f"{cap if which == 'fast' else slow_cap}",
            now,
            MemoryState(fast, used, fast_budget_bytes),
            objects=c.initial_fast if which == "fast" else c.initial_slow,
        )

    while error is None:
        # Passes at this instant: completions (collective task, task, d2h, h2d), dispatch,
        # d2h start, h2d start. Only a completion can enable more (a transfer's start never
        # enables a dispatch or the other link's start; a collective task's dispatch lets
        # the next task dispatch, which the dispatch loop does at once), so passes repeat
        # while something ends at this instant: a zero-cost task dispatched in this pass.
        while error is None:
            # completions: the collective task first, then the compute task
            while task_end <= now or coll_end <= now:
                if coll_end <= now:
                    i = coll_task
                    coll_task, coll_end, held = -1, inf, frozenset()
                    coll_n += 1
                    coll_bytes += link_bytes[i]
                    coll_busy += now - coll_start
                    if record:
                        task_log.append((i, coll_start, now))
                else:
                    i = running
                    running = -1
                    task_end = inf
                    compute_busy += cost[i]
                    if record and i != n_task:
                        task_log.append((i, task_start, now))
                before = used
                if workspace[i]:
                    used -= workspace[i]
                for o in outputs[i]:
                    fast[o] = RESIDENT
                for o in mutates[i]:
                    if slow[o] == CURRENT:
                        slow[o] = STALE
                for o in releases[i]:
                    if fast[o] != RESIDENT or leaving[o] or o in held:
                        memory = MemoryState(fast, used, fast_budget_bytes)
                        by = coll_task if o in held else -1
                        error = not_resident(c, "release", i, o, leaving, now, memory, by)
                        break
                    fast[o] = ABSENT
                    used -= size[o]
                    if slow[o] != CURRENT:
                        lost_by[o] = i
                for o in offloads[i] if error is None else ():
                    if fast[o] != RESIDENT or leaving[o] or o in held:
                        memory = MemoryState(fast, used, fast_budget_bytes)
                        by = coll_task if o in held else -1
                        error = not_resident(c, "offload", i, o, leaving, now, memory, by)
                        break
                    if slow[o] == CURRENT:  # clean: its slow copy is current, just drop it
                        fast[o] = ABSENT
                        used -= size[o]
                    else:
                        leaving[o] = True
                        d2h_q.append((o, now, i))
                for o in prefetches[i] if error is None else ():
                    if (
                        coming[o]
                        or (fast[o] and not leaving[o])
                        or size[o] > cap
                        or (slow[o] != CURRENT and not leaving[o])
                    ):
                        memory = MemoryState(fast, used, fast_budget_bytes)
                        error = bad_prefetch(c, i, o, slow, leaving, coming, cap, now, memory)
                        break
                    coming[o] = True
                    h2d_q.append((o, now, i))
                if record and used != before:
                    fast_log.append((now, used))
                if error is not None:
                    break
            if error is not None:
                break
            if d2h_end <= now:
                o = d2h_obj
                d2h_obj = -1
                d2h_end = inf
                slow[o] = CURRENT
                leaving[o] = False
                fast[o] = ABSENT
                used -= size[o]
                d2h_n += 1
                d2h_bytes += size[o]
                d2h_busy += now - d2h_start
                if duplex and h2d_obj >= 0:  # h2d goes back to its own rate
                    h2d_end = retimed_end_us(h2d_end, h2d_drain, now, h2d_shared_bw, h2d_bw)
                if record:
                    transfer_log.append((o, D2H, d2h_entry[2], d2h_entry[1], d2h_start, now))
                    fast_log.append((now, used))
            if h2d_end <= now:
                o = h2d_obj
                h2d_obj = -1
                h2d_end = inf
                fast[o] = RESIDENT
                coming[o] = False
                h2d_n += 1
                h2d_bytes += size[o]
                h2d_busy += now - h2d_start
                if duplex and d2h_obj >= 0:  # d2h goes back to its own rate
                    d2h_end = retimed_end_us(d2h_end, d2h_drain, now, d2h_shared_bw, d2h_bw)
                if record:
                    transfer_log.append((o, H2D, h2d_entry[2], h2d_entry[1], h2d_start, now))
            # dispatch: the next task once every compute task before it has ended; a
            # collective task dispatched lets the task after it dispatch in this pass
            while running < 0 and nxt < n_task:
                if checked != nxt and coll_task < 0:
                    checked = nxt
                    if footprint[nxt] > cap:
                        error = failure(
                            c,
                            FailureKind.FOOTPRINT,
                            f"task {c.task_ids[nxt]!r} needs {footprint[nxt]} bytes resident "
                            "at once (inputs + mutates + outputs + workspace), more than the "
                            f"fast budget {cap}",
                            now,
                            MemoryState(fast, used, fast_budget_bytes),
                            task=nxt,
                        )
                        break
                    missing = [
                        o for o in needs[nxt] if not coming[o] and (not fast[o] or leaving[o])
                    ]
                    if missing:
                        error = describe_missing(
                            c,
                            now,
                            MemoryState(fast, used, fast_budget_bytes),
                            nxt,
                            missing,
                            lost_by,
                        )
                        break
                if coll_task >= 0 and (on_link[nxt] or any(o in held for o in needs[nxt])):
                    break  # the link is taken, or the task uses what is being reduced
                if used + reserve[nxt] > cap:
                    break
                for o in needs[nxt]:
                    if fast[o] != RESIDENT or leaving[o]:
                        break
                else:
                    used += reserve[nxt]
                    if used > peak:
                        peak = used
                    if record and reserve[nxt]:
                        fast_log.append((now, used))
                    nxt += 1
                    if not coll_us or not on_link[nxt - 1]:
                        running = nxt - 1
                        task_start = now
                        task_end = now + cost[running]
                        break
                    coll_task = nxt - 1
                    held = frozenset((*needs[coll_task], *outputs[coll_task]))
                    coll_start = now
                    coll_end = now + coll_us[coll_task]
                    continue
                break
            if error is not None:
                break
            if d2h_obj < 0 and d2h_q:
                o = d2h_q[0][0]
                if not slow_space[o]:
                    if slow_used + size[o] > slow_cap:
                        error = failure(
                            c,
                            FailureKind.SLOW_BUDGET,
                            f"the offload of {c.obj_ids[o]!r} needs {size[o]} bytes of slow "
                            f"memory, but {slow_used} of the slow budget {slow_cap} are taken "
                            "(slow space is never given back)",
                            now,
                            MemoryState(
                                fast,
                                used,
                                fast_budget_bytes,
                                reserve[running] if running >= 0 else 0,
                            ),
                            task=d2h_q[0][2],
                            objects=(o,),
                        )
                        break
                    slow_space[o] = True
                    slow_used += size[o]
                    if slow_used > slow_peak:
                        slow_peak = slow_used
                    if record:
                        slow_log.append((now, slow_used))
                d2h_entry = d2h_q.popleft()
                d2h_obj = o
                d2h_start, d2h_drain = now, now + d2h_lat
                shared = duplex and h2d_obj >= 0  # both busy: each at its share
                d2h_end = now + (d2h_shared_us if shared else d2h_us)[o]
                if shared:
                    h2d_end = retimed_end_us(h2d_end, h2d_drain, now, h2d_bw, h2d_shared_bw)
            if h2d_obj < 0 and h2d_q:
                o = h2d_q[0][0]
                if slow[o] == CURRENT and used + size[o] <= cap:
                    h2d_entry = h2d_q.popleft()
                    h2d_obj = o
                    fast[o] = INCOMING
                    used += size[o]
                    if used > peak:
                        peak = used
                    h2d_start, h2d_drain = now, now + h2d_lat
                    shared = duplex and d2h_obj >= 0  # both busy: each at its share
                    h2d_end = now + (h2d_shared_us if shared else h2d_us)[o]
                    if shared:
                        d2h_end = retimed_end_us(d2h_end, d2h_drain, now, d2h_bw, d2h_shared_bw)
                    if record:
                        fast_log.append((now, used))
            if task_end > now and d2h_end > now and h2d_end > now and coll_end > now:
                break
        if error is not None:
            break
        if task_end == inf and d2h_end == inf and h2d_end == inf and coll_end == inf:
            if nxt == n_task and not d2h_q and not h2d_q:
                break  # the end
            waiting = [o for o in needs[nxt] if fast[o] != RESIDENT] if nxt < n_task else []
            head = h2d_q[0][0] if h2d_q else -1
            error = describe_deadlock(
                c,
                now,
                MemoryState(fast, used, fast_budget_bytes),
                nxt if nxt < n_task else -1,
                waiting,
                head,
                len(h2d_q),
            )
            break
        now = min(task_end, d2h_end, h2d_end, coll_end)

    if error is None:
        error = final_locations(
            c, fast, slow, lost_by, now, MemoryState(fast, used, fast_budget_bytes)
        )
    return Outcome(
        makespan_us=now,
        fast_peak_bytes=peak,
        slow_peak_bytes=slow_peak,
        compute_busy_us=compute_busy,
        link_transfers={H2D: h2d_n, D2H: d2h_n, COLLECTIVE: coll_n},
        link_bytes={H2D: h2d_bytes, D2H: d2h_bytes, COLLECTIVE: coll_bytes},
        link_busy_us={H2D: h2d_busy, D2H: d2h_busy, COLLECTIVE: coll_busy},
        error=error,
        fast_state=fast,
        slow_state=slow,
        task_log=task_log,
        transfer_log=transfer_log,
        fast_log=fast_log,
        slow_log=slow_log,
    )
