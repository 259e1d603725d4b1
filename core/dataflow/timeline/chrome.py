"""Chrome trace-event JSON, which Perfetto (ui.perfetto.dev) and chrome://tracing open.

Each timeline becomes one process (pid 1, 2, ... in the order given) with three threads,
``compute``, ``h2d`` and ``d2h``, holding complete ("X") events, and one counter track
per ``Counter`` ("C" events). Several timelines in one file show side by side: predicted
above measured, say. Times stay in microseconds, the unit of the format's ``ts``.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from dataflow.timeline.records import TaskSpan, Timeline, TransferSpan

#: thread id of each track inside a timeline's process
TRACKS = {"compute": 1, "h2d": 2, "d2h": 3}


def chrome_trace(*timelines: Timeline) -> dict[str, Any]:
    """The trace-event document for ``timelines``, one process each."""
    events: list[dict[str, Any]] = []
    for pid, timeline in enumerate(timelines, start=1):
        events += _process_events(pid, timeline)
    return {
        "traceEvents": events,
        "displayTimeUnit": "ms",
        "otherData": {
            "generator": "dataflow.timeline",
            "timelines": [
                {
                    "pid": pid,
                    "name": timeline.name,
                    "limits": {c.name: c.limit for c in timeline.counters if c.limit is not None},
                    **timeline.metadata,
                }
                for pid, timeline in enumerate(timelines, start=1)
            ],
        },
    }


def write_chrome_trace(path: str | Path, *timelines: Timeline) -> Path:
    """Write ``chrome_trace(*timelines)`` to ``path`` (compact JSON); return the path."""
    return write_trace_document(path, chrome_trace(*timelines))


def write_trace_document(path: str | Path, document: dict[str, Any]) -> Path:
    """Write a document made by ``chrome_trace`` to ``path`` (compact JSON)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(document, separators=(",", ":")))
    return path


def process_header(pid: int, name: str, tracks: dict[str, int]) -> list[dict[str, Any]]:
    """The metadata events naming a process and its threads (``tracks``: name -> tid), in
    that order on screen."""
    events = [
        _meta(pid, 0, "process_name", {"name": name}),
        _meta(pid, 0, "process_sort_index", {"sort_index": pid}),
    ]
    for track, tid in tracks.items():
        events.append(_meta(pid, tid, "thread_name", {"name": track}))
        events.append(_meta(pid, tid, "thread_sort_index", {"sort_index": tid}))
    return events


def slice_event(
    span: TaskSpan | TransferSpan, pid: int, tid: int, args: dict[str, Any]
) -> dict[str, Any]:
    """The complete ("X") event of a task (named by its id, of its kind) or a transfer
    (named by its object, of its link)."""
    if isinstance(span, TaskSpan):
        name, category = span.task_id, span.kind or "task"
    else:
        name, category = span.obj_id, span.direction
    return {
        "name": name,
        "cat": category,
        "ph": "X",
        "ts": span.start_us,
        "dur": span.duration_us,
        "pid": pid,
        "tid": tid,
        "args": args,
    }


def _process_events(pid: int, timeline: Timeline) -> list[dict[str, Any]]:
    events = process_header(pid, timeline.name, TRACKS)
    for span in timeline.tasks:
        args = {"task": span.task_id, "kind": span.kind, **span.args}
        events.append(slice_event(span, pid, TRACKS["compute"], args))
    for span in timeline.transfers:
        args: dict[str, Any] = {"object": span.obj_id, "size_bytes": span.size_bytes}
        if span.enqueued_by is not None:
            args["enqueued_by"] = span.enqueued_by
        if span.enqueue_us is not None:
            args["enqueue_us"] = span.enqueue_us
            args["wait_us"] = span.start_us - span.enqueue_us
        events.append(slice_event(span, pid, TRACKS[span.direction], args))
    for counter in timeline.counters:
        for time_us, value in counter.points:
            events.append(
                {
                    "name": counter.name,
                    "ph": "C",
                    "ts": time_us,
                    "pid": pid,
                    "args": {counter.unit: value},
                }
            )
    return events


def _meta(pid: int, tid: int, name: str, args: dict[str, Any]) -> dict[str, Any]:
    return {"name": name, "ph": "M", "pid": pid, "tid": tid, "args": args}
