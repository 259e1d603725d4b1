"""The neutral Timeline and its Chrome trace-event writer (several runs side by side)."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from dataflow.timeline import (
    Counter,
    TaskSpan,
    Timeline,
    TransferSpan,
    chrome_trace,
    write_chrome_trace,
)


def _timeline(name: str, shift_us: float = 0.0) -> Timeline:
    return Timeline(
        name=name,
        tasks=[
            TaskSpan("t0", 0.0 + shift_us, 5.0 + shift_us, kind="fwd", args={"inputs": {"a": 8}}),
            TaskSpan("t1", 9.0 + shift_us, 12.0 + shift_us, kind="bwd"),
        ],
        transfers=[
            TransferSpan("W", "h2d", 64, 5.0, 9.0, enqueue_us=5.0, enqueued_by="t0"),
            TransferSpan("y", "d2h", 32, 12.0, 14.0),
        ],
        counters=[Counter("fast memory", [(0.0, 8), (5.0, 72), (14.0, 40)], limit=128)],
        metadata={"source": "test"},
    )


def test_one_process_per_timeline_with_three_tracks_and_counters() -> None:
    document = chrome_trace(_timeline("predicted"), _timeline("measured", shift_us=1.0))
    events = document["traceEvents"]
    processes = {e["pid"]: e["args"]["name"] for e in events if e["name"] == "process_name"}
    assert processes == {1: "predicted", 2: "measured"}
    for pid in (1, 2):
        threads = {
            e["args"]["name"]: e["tid"]
            for e in events
            if e["name"] == "thread_name" and e["pid"] == pid
        }
        assert threads == {"compute": 1, "h2d": 2, "d2h": 3}
        spans = [(e["tid"], e["name"]) for e in events if e["ph"] == "X" and e["pid"] == pid]
        assert spans == [(1, "t0"), (1, "t1"), (2, "W"), (3, "y")]
        counter = [
            (e["ts"], e["args"]["bytes"]) for e in events if e["ph"] == "C" and e["pid"] == pid
        ]
        assert counter == [(0.0, 8), (5.0, 72), (14.0, 40)]
    measured_t0 = next(e for e in events if e["pid"] == 2 and e["name"] == "t0")
    assert (measured_t0["ts"], measured_t0["dur"]) == (1.0, 5.0)
    transfer = next(e for e in events if e["pid"] == 1 and e["name"] == "W")
    assert transfer["args"] == {
        "object": "W",
        "size_bytes": 64,
        "enqueued_by": "t0",
        "enqueue_us": 5.0,
        "wait_us": 0.0,
    }
    untimed = next(e for e in events if e["pid"] == 1 and e["name"] == "y")
    assert untimed["args"] == {"object": "y", "size_bytes": 32}
    assert document["otherData"]["timelines"][0]["limits"] == {"fast memory": 128}


def test_write_produces_json_that_loads(tmp_path: Path) -> None:
    path = write_chrome_trace(tmp_path / "deep" / "trace.json", _timeline("only"))
    loaded = json.loads(path.read_text())
    assert loaded["traceEvents"] and loaded["displayTimeUnit"] == "ms"


def test_records_are_frozen_and_check_direction() -> None:
    span = TaskSpan("t", 1.0, 3.0)
    assert span.duration_us == 2.0
    with pytest.raises(AttributeError):
        span.start_us = 0.0  # type: ignore[misc]
    with pytest.raises(ValueError):
        TransferSpan("x", "sideways", 1, 0.0, 1.0)
    timeline = _timeline("t")
    assert timeline.end_us == 14.0
    assert [t.obj_id for t in timeline.transfers_on("d2h")] == ["y"]
    assert timeline.counters[0].peak == 72


def test_timeline_and_sim_import_neither_torch_nor_each_other_wrongly() -> None:
    code = (
        "import sys, dataflow.timeline; assert 'dataflow.sim' not in sys.modules; "
        "import dataflow.sim; "
        "assert not [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]"
    )
    subprocess.run([sys.executable, "-c", code], check=True)
