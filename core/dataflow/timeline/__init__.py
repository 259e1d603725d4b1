"""Timelines of runs, predicted or measured, and their Chrome trace-event export.

Pure Python; knows nothing of the simulator or the engine, which convert their results
to a ``Timeline``.
"""

from dataflow.timeline.chrome import (
    TRACKS,
    chrome_trace,
    write_chrome_trace,
    write_trace_document,
)
from dataflow.timeline.records import DIRECTIONS, Counter, TaskSpan, Timeline, TransferSpan

__all__ = [
    "DIRECTIONS",
    "TRACKS",
    "Counter",
    "TaskSpan",
    "Timeline",
    "TransferSpan",
    "chrome_trace",
    "write_chrome_trace",
    "write_trace_document",
]
