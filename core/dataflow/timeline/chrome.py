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

from dataflow.timeline.records import Timeline

#: thread id of each track inside a timeline's process
TRACKS = {"compute": 1, "h2d": 2, "d2h": 3, "collective": 4}


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


def _process_events(pid: int, timeline: Timeline) -> list[dict[str, Any]]:
    events: list[dict[str, Any]] = [
        _meta(pid, 0, "process_name", {"name": timeline.name}),
        _meta(pid, 0, "process_sort_index", {"sort_index": pid}),
    ]
    used = {"compute", "h2d", "d2h"} | {span.track for span in timeline.tasks}
    for name, tid in TRACKS.items():
        if name not in used:
            continue  # the collective track only where a fleet's all-reduces ran
        events.append(_meta(pid, tid, "thread_name", {"name": name}))
        events.append(_meta(pid, tid, "thread_sort_index", {"sort_index": tid}))
    for span in timeline.tasks:
        events.append(
            {
                "name": span.task_id,
                "cat": span.kind or "task",
                "ph": "X",
                "ts": span.start_us,
                "dur": span.duration_us,
                "pid": pid,
                "tid": TRACKS[span.track],
                "args": {"task": span.task_id, "kind": span.kind, **span.args},
            }
        )
    for span in timeline.transfers:
        args: dict[str, Any] = {"object": span.obj_id, "size_bytes": span.size_bytes}
        if span.enqueued_by is not None:
            args["enqueued_by"] = span.enqueued_by
        if span.enqueue_us is not None:
            args["enqueue_us"] = span.enqueue_us
            args["wait_us"] = span.start_us - span.enqueue_us
        events.append(
            {
                "name": span.obj_id,
                "cat": span.direction,
                "ph": "X",
                "ts": span.start_us,
                "dur": span.duration_us,
                "pid": pid,
                "tid": TRACKS[span.direction],
                "args": args,
            }
        )
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
