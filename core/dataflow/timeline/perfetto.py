"""One Perfetto trace of a prediction and a measurement (trace-event JSON).

``perfetto_trace(predicted, measured)`` puts each timeline in a process of its own (pid 1
predicted, pid 2 measured) with a thread per track: ``compute``, then one per transfer
link, ``h2d`` and ``d2h`` always and any other link a timeline has (a ``collective`` link,
say) after them. On those threads:

- every task and transfer is a complete ("X") slice whose args hold its bytes, its
  predicted and measured microseconds and their difference (``diff_us``, measured minus
  predicted), wherever the other timeline has the same task (or the same transfer: the
  same object, direction and occurrence);
- flow arrows ("s"/"t"/"f", bound to the enclosing slices) run from the task that wrote
  an object, to its transfer, to the task that next reads it;
- each ``Instant`` (a stall: what compute waited for) is an instant ("i") event;
- every counter is a counter track ("C"), and a counter with a limit (fast memory and
  the budget) gets a second, flat track of that limit beside it.

Times are microseconds, the format's unit. ui.perfetto.dev opens the file as it is.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from dataflow.timeline.chrome import process_header, slice_event
from dataflow.timeline.records import DIRECTIONS, TaskSpan, Timeline, TransferSpan

COMPUTE = "compute"
#: the label of each process, in order: pid 1, pid 2
PROCESSES = ("predicted", "measured")


def tracks_of(*timelines: Timeline | None) -> list[str]:
    """The thread names: compute, h2d, d2h, then any other link of the timelines, sorted."""
    others = sorted(
        {span.direction for t in timelines if t is not None for span in t.transfers}
        - set(DIRECTIONS)
    )
    return [COMPUTE, *DIRECTIONS, *others]


def perfetto_trace(predicted: Timeline, measured: Timeline | None = None) -> dict[str, Any]:
    """The trace-event document of ``predicted`` and, when given, ``measured`` (module
    docstring)."""
    tracks = tracks_of(predicted, measured)
    tids = {name: tid for tid, name in enumerate(tracks, start=1)}
    runs = [predicted] if measured is None else [predicted, measured]
    task_us = [_task_durations(t) for t in runs]
    transfer_us = [_transfer_durations(t) for t in runs]
    events: list[dict[str, Any]] = []
    flow_ids = iter(range(1, 1 << 62))
    for index, timeline in enumerate(runs):
        pid = index + 1
        events += process_header(pid, f"{PROCESSES[index]}: {timeline.name}", tids)
        sliced = _task_slices(timeline, pid, tids[COMPUTE], task_us, PROCESSES[index])
        sliced += _transfer_slices(timeline, pid, tids, transfer_us, PROCESSES[index])
        sliced += _instants(timeline, pid, tids)
        sliced += _flows(timeline, pid, tids, flow_ids)
        sliced.sort(key=lambda e: (e["ts"], _PHASE_ORDER[e["ph"]], e["tid"]))
        events += sliced
        events += _counters(timeline, pid)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "dataflow.timeline.perfetto",
            "processes": {
                PROCESSES[i]: {"pid": i + 1, "name": t.name, **t.metadata}
                for i, t in enumerate(runs)
            },
        },
    }


#: within one instant of one track: the slice first, then what binds to it
_PHASE_ORDER = {"X": 0, "i": 1, "s": 2, "t": 3, "f": 4}


def _task_durations(timeline: Timeline) -> dict[str, float]:
    return {span.task_id: span.duration_us for span in timeline.tasks}


def _transfer_key(span: TransferSpan, seen: dict[tuple[str, str], int]) -> tuple[str, str, int]:
    pair = (span.obj_id, span.direction)
    seen[pair] = seen.get(pair, -1) + 1
    return (*pair, seen[pair])


def _transfer_durations(timeline: Timeline) -> dict[tuple[str, str, int], float]:
    seen: dict[tuple[str, str], int] = {}
    ordered = sorted(timeline.transfers, key=lambda s: s.start_us)
    return {_transfer_key(span, seen): span.duration_us for span in ordered}


def _compared(key: Any, durations: list[dict], here: str) -> dict[str, Any]:
    """``predicted_us``, ``measured_us`` and ``diff_us`` of ``key`` where known."""
    args: dict[str, Any] = {}
    for label, known in zip(PROCESSES, durations, strict=False):
        if key in known:
            args[f"{label}_us"] = known[key]
    if "predicted_us" in args and "measured_us" in args:
        args["diff_us"] = args["measured_us"] - args["predicted_us"]
    args["timeline"] = here
    return args


def task_bytes(span: TaskSpan) -> int:
    """The bytes a task names (inputs, mutates, outputs), from its args."""
    return sum(
        int(size or 0)
        for field in ("inputs", "mutates", "outputs")
        for size in dict(span.args.get(field) or {}).values()
    )


def _task_slices(
    timeline: Timeline, pid: int, tid: int, durations: list[dict], here: str
) -> list[dict[str, Any]]:
    events = []
    for span in timeline.tasks:
        args = {
            "task": span.task_id,
            "kind": span.kind,
            "bytes": task_bytes(span),
            **_compared(span.task_id, durations, here),
        }
        args |= {k: v for k, v in span.args.items() if k not in args}
        events.append(slice_event(span, pid, tid, args))
    return events


def _transfer_slices(
    timeline: Timeline, pid: int, tids: dict[str, int], durations: list[dict], here: str
) -> list[dict[str, Any]]:
    events = []
    seen: dict[tuple[str, str], int] = {}
    for span in sorted(timeline.transfers, key=lambda s: s.start_us):
        args: dict[str, Any] = {
            "object": span.obj_id,
            "bytes": span.size_bytes,
            **_compared(_transfer_key(span, seen), durations, here),
        }
        if span.enqueued_by is not None:
            args["enqueued_by"] = span.enqueued_by
        if span.enqueue_us is not None:
            args["wait_us"] = span.start_us - span.enqueue_us
        if span.duration_us > 0:
            args["gb_per_s"] = span.size_bytes / span.duration_us / 1e3
        events.append(slice_event(span, pid, tids[span.direction], args))
    return events


def _instants(timeline: Timeline, pid: int, tids: dict[str, int]) -> list[dict[str, Any]]:
    return [
        {
            "name": instant.name,
            "cat": "stall",
            "ph": "i",
            "s": "t",
            "ts": instant.time_us,
            "pid": pid,
            "tid": tids.get(instant.track, tids[COMPUTE]),
            "args": dict(instant.args),
        }
        for instant in timeline.instants
    ]


def _uses(span: TaskSpan, fields: Iterable[str]) -> set[str]:
    return {obj for field in fields for obj in dict(span.args.get(field) or {})}


def flow_chains(timeline: Timeline) -> list[tuple[TaskSpan | None, TransferSpan, TaskSpan | None]]:
    """For every transfer: the task that last wrote its object before it started (else
    the task whose directive enqueued it), the transfer, and for a copy into fast memory
    the first task from its start on that reads or changes the object (None where there
    is none). Needs the tasks' ``inputs``/``mutates``/``outputs`` args."""
    tasks = sorted(timeline.tasks, key=lambda s: s.start_us)
    by_id = {span.task_id: span for span in tasks}
    chains = []
    for transfer in timeline.transfers:
        obj = transfer.obj_id
        writers = [
            span
            for span in tasks
            if span.end_us <= transfer.start_us and obj in _uses(span, ("outputs", "mutates"))
        ]
        source = writers[-1] if writers else by_id.get(transfer.enqueued_by or "")
        sink = None
        if transfer.direction == "h2d":
            sink = next(
                (
                    span
                    for span in tasks
                    if span.start_us >= transfer.start_us
                    and obj in _uses(span, ("inputs", "mutates"))
                ),
                None,
            )
        chains.append((source, transfer, sink))
    return chains


def _flows(
    timeline: Timeline, pid: int, tids: dict[str, int], ids: Iterable[int]
) -> list[dict[str, Any]]:
    events = []
    ids = iter(ids)
    for source, transfer, sink in flow_chains(timeline):
        ends = [
            (span, tids[COMPUTE] if isinstance(span, TaskSpan) else tids[transfer.direction])
            for span in (source, transfer, sink)
            if span is not None
        ]
        if len(ends) < 2:
            continue
        flow_id, ts = next(ids), float("-inf")
        for position, (span, tid) in enumerate(ends):
            # inside its slice, and never before the arrow's previous end
            ts = min(max((span.start_us + span.end_us) / 2, ts), span.end_us)
            phase = "s" if position == 0 else "f" if position == len(ends) - 1 else "t"
            event = {
                "name": transfer.obj_id,
                "cat": "flow",
                "ph": phase,
                "id": flow_id,
                "ts": ts,
                "pid": pid,
                "tid": tid,
            }
            if phase != "s":
                event["bp"] = "e"
            events.append(event)
    return events


def _counters(timeline: Timeline, pid: int) -> list[dict[str, Any]]:
    events = []
    end_us = timeline.end_us
    for counter in timeline.counters:
        for time_us, value in counter.points:
            events.append(_counter(counter.name, time_us, pid, counter.unit, value))
        if counter.limit is not None:
            for time_us in (0.0, end_us):
                events.append(
                    _counter(f"{counter.name} budget", time_us, pid, counter.unit, counter.limit)
                )
    return events


def _counter(name: str, time_us: float, pid: int, unit: str, value: float) -> dict[str, Any]:
    return {"name": name, "ph": "C", "ts": time_us, "pid": pid, "args": {unit: value}}
