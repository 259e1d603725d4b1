"""Failure reports: the message, the objects at fault and fast memory at that moment.

Called only when a run fails, so clarity matters here, not speed.
"""

from __future__ import annotations

from collections.abc import Sequence

import attrs

from dataflow.sim.compiled import CompiledProgram
from dataflow.sim.failure import FailureKind, SimError
from dataflow.sim.states import ABSENT, CURRENT, INCOMING, RESIDENT
from dataflow.units import format_size

#: how many resident objects a message lists before "... and N more"
LISTED_OBJECTS = 8


@attrs.frozen
class MemoryState:
    """Fast memory at the moment of a failure: the loop's per-object ``fast`` states,
    bytes in use, the budget, and what the running task holds for outputs and workspace."""

    fast: Sequence[int]
    used_bytes: int
    budget_bytes: int | None
    reserved_bytes: int = 0


def failure(
    compiled: CompiledProgram,
    kind: FailureKind,
    message: str,
    time_us: float,
    memory: MemoryState,
    *,
    task: int = -1,
    objects: Sequence[int] = (),
) -> SimError:
    """A SimError carrying the memory state; ``task`` and ``objects`` are indices."""
    ids = compiled.obj_ids
    resident = [o for o, state in enumerate(memory.fast) if state == RESIDENT]
    incoming = [o for o, state in enumerate(memory.fast) if state == INCOMING]
    return SimError(
        kind=kind,
        message=f"{message}; {_describe_memory(compiled, memory, resident, incoming)}",
        time_us=time_us,
        task=compiled.task_ids[task] if task >= 0 else None,
        objects=tuple(ids[o] for o in objects),
        fast_bytes_in_use=memory.used_bytes,
        fast_budget_bytes=memory.budget_bytes,
        resident=tuple(ids[o] for o in resident),
        incoming=tuple(ids[o] for o in incoming),
        reserved_bytes=memory.reserved_bytes,
    )


def _describe_memory(
    compiled: CompiledProgram, memory: MemoryState, resident: list[int], incoming: list[int]
) -> str:
    budget = "no budget" if memory.budget_bytes is None else f"{memory.budget_bytes} bytes"
    text = f"fast memory: {memory.used_bytes} bytes in use of {budget}"
    if memory.reserved_bytes:
        text += f" ({memory.reserved_bytes} reserved by the running task)"
    return (
        text
        + f"; resident: {_list_objects(compiled, resident)}"
        + (f"; incoming: {_list_objects(compiled, incoming)}" if incoming else "")
    )


def _list_objects(compiled: CompiledProgram, objects: list[int]) -> str:
    if not objects:
        return "none"
    largest = sorted(objects, key=lambda o: (-compiled.size_bytes[o], o))[:LISTED_OBJECTS]
    shown = ", ".join(
        f"{compiled.obj_ids[o]} ({format_size(compiled.size_bytes[o])})" for o in sorted(largest)
    )
    more = len(objects) - len(largest)
    return shown + (f" and {more} more" if more else "")


def describe_deadlock(
    compiled: CompiledProgram,
    time_us: float,
    memory: MemoryState,
    next_task: int,
    waiting: list[int],
    h2d_head: int,
    h2d_queued: int,
) -> SimError:
    """Nothing runs and nothing can start: name the blocked task, what it waits for, and
    the prefetch at the head of ``h2d`` that cannot get room (``h2d_head`` < 0: none)."""
    size = compiled.size_bytes
    ids = compiled.obj_ids
    free = None if memory.budget_bytes is None else memory.budget_bytes - memory.used_bytes
    parts = []
    if next_task >= 0:
        name = compiled.task_ids[next_task]
        if waiting:
            parts.append(
                f"task {name!r} waits for {', '.join(repr(ids[o]) for o in waiting)} "
                "(prefetches queued on h2d)"
            )
        else:
            parts.append(
                f"task {name!r} cannot reserve {compiled.reserve_bytes[next_task]} bytes for "
                f"its outputs and workspace ({free} bytes free)"
            )
    if h2d_head >= 0:
        parts.append(
            f"the h2d queue ({h2d_queued} queued) is blocked at its head, the prefetch of "
            f"{ids[h2d_head]!r}, which needs {size[h2d_head]} bytes ({free} bytes free)"
        )
    objects = waiting if next_task >= 0 else ([h2d_head] if h2d_head >= 0 else [])
    return failure(
        compiled,
        FailureKind.DEADLOCK,
        "; ".join(parts),
        time_us,
        memory,
        task=next_task,
        objects=objects,
    )


def describe_missing(
    compiled: CompiledProgram,
    time_us: float,
    memory: MemoryState,
    task: int,
    missing: list[int],
    lost_by: Sequence[int],
) -> SimError:
    """The next task needs objects that nothing will bring into fast memory."""
    ids = compiled.obj_ids
    name = compiled.task_ids[task]
    lost = [o for o in missing if lost_by[o] >= 0]
    if lost:
        reasons = ", ".join(
            f"{ids[o]!r} (its only copy was dropped by the release in task "
            f"{compiled.task_ids[lost_by[o]]!r}, while it was dirty)"
            for o in lost
        )
        return failure(
            compiled,
            FailureKind.LOST,
            f"task {name!r} uses {reasons}",
            time_us,
            memory,
            task=task,
            objects=lost,
        )
    listed = ", ".join(repr(ids[o]) for o in missing)
    return failure(
        compiled,
        FailureKind.NOT_RESIDENT,
        f"task {name!r} needs {listed} in fast memory, but no prefetch of it is queued "
        "(nothing can bring it in before the task runs)",
        time_us,
        memory,
        task=task,
        objects=missing,
    )


def not_resident(
    c: CompiledProgram,
    verb: str,
    task: int,
    o: int,
    leaving: Sequence[bool],
    now: float,
    memory: MemoryState,
    reducing: int = -1,
) -> SimError:
    """A release or offload (``verb``) of an object that is not resident, or leaving, or
    that the running collective task ``reducing`` uses."""
    fast = memory.fast
    if reducing >= 0:
        state = f"the collective task {c.task_ids[reducing]!r} is still reducing it"
    elif leaving[o]:
        state = "its offload is still pending"
    else:
        state = "it is still arriving" if fast[o] == INCOMING else "it is not in fast memory"
    kind = (
        FailureKind.RELEASE_NOT_RESIDENT if verb == "release" else FailureKind.OFFLOAD_NOT_RESIDENT
    )
    where = f"task {c.task_ids[task]!r} cannot {verb} {c.obj_ids[o]!r}"
    return failure(c, kind, f"{where}: {state}", now, memory, task=task, objects=(o,))


def bad_prefetch(
    c: CompiledProgram,
    task: int,
    o: int,
    slow: Sequence[int],
    leaving: Sequence[bool],
    coming: Sequence[bool],
    cap: float,
    now: float,
    memory: MemoryState,
) -> SimError:
    """A prefetch that cannot be enqueued, checked in this order: already on its way or
    resident; no current slow copy (and no offload to make one); larger than the budget."""
    where = f"task {c.task_ids[task]!r} cannot prefetch {c.obj_ids[o]!r}"
    if coming[o]:
        kind, state = FailureKind.PREFETCH_RESIDENT, "a prefetch of it is already queued"
    elif memory.fast[o] and not leaving[o]:
        kind, state = FailureKind.PREFETCH_RESIDENT, "it is already resident"
    elif slow[o] != CURRENT and not leaving[o]:
        kind = FailureKind.PREFETCH_NO_SLOW_COPY
        state = "it has no slow copy" if slow[o] == ABSENT else "its slow copy is stale"
    else:
        kind = FailureKind.TRANSFER_TOO_LARGE
        state = f"it takes {c.size_bytes[o]} bytes, more than the fast budget {cap}"
    return failure(c, kind, f"{where}: {state}", now, memory, task=task, objects=(o,))


def final_locations(
    c: CompiledProgram,
    fast: Sequence[int],
    slow: Sequence[int],
    lost_by: Sequence[int],
    now: float,
    memory: MemoryState,
) -> SimError | None:
    """The failure when ``final_locations`` do not hold at the end, else None."""
    wrong_fast = [o for o in c.final_fast if fast[o] != RESIDENT]
    wrong_slow = [o for o in c.final_slow if slow[o] != CURRENT]
    if not wrong_fast and not wrong_slow:
        return None
    ids = c.obj_ids
    parts = [f"{ids[o]!r} should end in fast memory but is not resident" for o in wrong_fast]
    for o in wrong_slow:
        why = "has no slow copy" if slow[o] == ABSENT else "its slow copy is stale"
        parts.append(f"{ids[o]!r} should end in slow memory but {why}")
    for o in wrong_fast + wrong_slow:
        if lost_by[o] >= 0:
            parts.append(f"{ids[o]!r} was dropped dirty by task {c.task_ids[lost_by[o]]!r}")
    return failure(
        c,
        FailureKind.FINAL_LOCATION,
        "final locations do not hold: " + "; ".join(parts),
        now,
        memory,
        objects=wrong_fast + wrong_slow,
    )
