"""A strict check of trace-event JSON (the format Perfetto and chrome://tracing open).

``trace_event_problems(document)`` returns one line per fault, empty when the document is
sound: it survives a JSON round trip; every event has the keys its phase needs (``X``:
``ts``, ``dur`` >= 0, ``tid``; ``C``: numeric args; ``i``: a scope; ``s``/``t``/``f``: an
``id``; ``M``: a known name and args); numbers are finite; the slices of each track start
in time order and do not overlap; each counter's points are in time order; and every flow
id has one start and one finish, its events in time order, each inside a slice of its
own track. Perfetto's ``trace_processor`` downloads a binary to run, so the project's
tests check traces with this instead.
"""

from __future__ import annotations

import json
import math
from collections import defaultdict
from typing import Any

#: keys every event of a phase must have (beyond ``ph``)
REQUIRED = {
    "X": ("name", "ts", "dur", "pid", "tid"),
    "C": ("name", "ts", "pid", "args"),
    "i": ("name", "ts", "pid", "tid", "s"),
    "s": ("name", "ts", "pid", "tid", "id", "cat"),
    "t": ("name", "ts", "pid", "tid", "id", "cat"),
    "f": ("name", "ts", "pid", "tid", "id", "cat"),
    "M": ("name", "pid", "args"),
}
METADATA = ("process_name", "process_sort_index", "thread_name", "thread_sort_index")
#: slack for floating-point time arithmetic (microseconds)
EPS_US = 1e-6


def _number(value: Any) -> bool:
    return isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value)


def trace_event_problems(document: Any) -> list[str]:
    """Every fault of ``document`` (module docstring), one line each."""
    try:
        if json.loads(json.dumps(document, allow_nan=False)) != document:
            return ["the document changes in a JSON round trip"]
    except (TypeError, ValueError) as exc:
        return [f"not JSON: {exc}"]
    events = document.get("traceEvents") if isinstance(document, dict) else None
    if not isinstance(events, list):
        return ["no traceEvents list"]
    problems: list[str] = []
    slices: dict[tuple[Any, Any], list[dict]] = defaultdict(list)
    counters: dict[tuple[Any, Any], list[float]] = defaultdict(list)
    flows: dict[Any, list[dict]] = defaultdict(list)
    for index, event in enumerate(events):
        where = f"event {index}"
        phase = event.get("ph") if isinstance(event, dict) else None
        if phase not in REQUIRED:
            problems.append(f"{where}: unknown phase {phase!r}")
            continue
        missing = [key for key in REQUIRED[phase] if key not in event]
        if missing:
            problems.append(f"{where} ({phase}): missing {', '.join(missing)}")
            continue
        if "ts" in event and not _number(event["ts"]):
            problems.append(f"{where} ({phase}): ts {event['ts']!r} is not a finite number")
            continue
        if phase == "X":
            if not _number(event["dur"]) or event["dur"] < 0:
                problems.append(f"{where} (X): dur {event['dur']!r} is not a number >= 0")
                continue
            slices[(event["pid"], event["tid"])].append(event)
        elif phase == "C":
            args = event["args"]
            if not isinstance(args, dict) or not args or not all(map(_number, args.values())):
                problems.append(f"{where} (C {event['name']!r}): args {args!r} are not numbers")
                continue
            counters[(event["pid"], event["name"])].append(event["ts"])
        elif phase == "i" and event["s"] not in ("t", "p", "g"):
            problems.append(f"{where} (i): scope {event['s']!r} is not t, p or g")
        elif phase in "stf":
            flows[event["id"]].append(event)
        elif phase == "M" and event["name"] not in METADATA:
            problems.append(f"{where} (M): unknown metadata {event['name']!r}")
    problems += _slice_order(slices)
    for (pid, name), times in counters.items():
        if any(b < a for a, b in zip(times, times[1:], strict=False)):
            problems.append(f"counter {name!r} of pid {pid}: points out of time order")
    problems += _flow_problems(flows, slices)
    return problems


def _slice_order(slices: dict[tuple[Any, Any], list[dict]]) -> list[str]:
    problems = []
    for (pid, tid), track in slices.items():
        for before, after in zip(track, track[1:], strict=False):
            if after["ts"] < before["ts"]:
                problems.append(f"track {pid}/{tid}: {after['name']!r} starts before the one ahead")
            elif after["ts"] < before["ts"] + before["dur"] - EPS_US:
                problems.append(
                    f"track {pid}/{tid}: {after['name']!r} starts inside {before['name']!r}"
                )
    return problems


def _flow_problems(flows: dict[Any, list[dict]], slices: dict) -> list[str]:
    problems = []
    for flow_id, steps in flows.items():
        phases = [step["ph"] for step in steps]
        if phases.count("s") != 1 or phases.count("f") != 1 or phases[0] != "s":
            problems.append(f"flow {flow_id}: phases {phases} (one s first, one f)")
            continue
        if phases[-1] != "f":
            problems.append(f"flow {flow_id}: the finish is not last")
        times = [step["ts"] for step in steps]
        if any(b < a for a, b in zip(times, times[1:], strict=False)):
            problems.append(f"flow {flow_id}: steps out of time order")
        for step in steps:
            track = slices.get((step["pid"], step["tid"]), [])
            inside = any(
                s["ts"] - EPS_US <= step["ts"] <= s["ts"] + s["dur"] + EPS_US for s in track
            )
            if not inside:
                problems.append(
                    f"flow {flow_id}: its {step['ph']} at {step['ts']} is in no slice of "
                    f"track {step['pid']}/{step['tid']}"
                )
    return problems
