"""Whole-step CUDA graphs: capture one step of a placed program, replay it every step.

Once a program is planned and placed, every step launches the same operations on the same
addresses, so the step is captured once into a CUDA graph and replayed: the host then
enqueues one graph per step instead of every task and copy, and dispatch costs the device
nothing.

Capture drives the ordinary dispatcher with ``GraphCapture`` as the backend's runner. Its
clock is the virtual backend's (each task takes its ``cost_us``, each transfer its link
time), so the dispatcher decides exactly what the simulator decides, in the same order.
Every operation it launches is enqueued, under capture, on its stream (compute, h2d,
d2h), after waiting through an event for the last operation each *other* stream had
completed before this one was launched in that timeline. Whatever an operation depends on
(the prefetch of an input, the write-back of bytes it reuses, the task whose end enqueued
it) completed before it was launched there, and each stream runs its operations in order,
so the graph's edges hold every dependency of the plan, and nothing waits for the host.

Per-step values (learning rate, update count) must not be frozen into the graph: the
engine hands them to executables as 0-d float32 device tensors it refreshes before each
replay (``DeviceValues``). An executable is captured only if it says it can be
(``capturable = True``: it only enqueues device work, never synchronises, and reads
per-step values as device tensors); otherwise the engine keeps dispatching dynamically and
says why in one line (``Engine.graph_note``).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Mapping, Sequence
from numbers import Real
from typing import Any

import torch

from dataflow.engine.backends.virtual import VirtualBackend
from dataflow.engine.contract import Executable, LaunchContext
from dataflow.engine.dispatcher import Completion, OpFailed, OpKind
from dataflow.schema import Program

_KIND = {"d2h": OpKind.D2H, "h2d": OpKind.H2D}


def not_capturable(program: Program, executables: Sequence[Executable]) -> str | None:
    """Why the program's step cannot be captured (None when it can)."""
    for task, executable in zip(program.tasks, executables, strict=True):
        if not getattr(executable, "capturable", False):
            return (
                f"task {task.id!r} ({task.compute_key}): its executable "
                f"{type(executable).__name__} does not declare capturable = True"
            )
    return None


class DeviceValues:
    """Per-step numeric values as 0-d float32 tensors on the device, refreshed in place
    from one pinned host buffer (one copy per step, on the compute stream)."""

    def __init__(self, names: Sequence[str], device: torch.device) -> None:
        self.names = tuple(names)
        self.host = torch.zeros(max(1, len(self.names)), dtype=torch.float32, pin_memory=True)
        # no fill: each ``update`` writes every entry before anything reads one (a fill
        # here would run on the current stream, unordered with ``update``'s copy)
        self.device_buffer = torch.empty_like(self.host, device=device)
        self.tensors = {name: self.device_buffer[i] for i, name in enumerate(self.names)}

    @staticmethod
    def unsupported(values: Mapping[str, Any]) -> str | None:
        for name, value in values.items():
            if not isinstance(value, Real):
                return f"value {name!r} is a {type(value).__name__}, not a number"
        return None

    def update(self, values: Mapping[str, Any], stream: torch.cuda.Stream) -> dict[str, Any]:
        """Write ``values`` (the same names as at capture) and return the mapping of
        device tensors the executables read. The host buffer is rewritten: the engine has
        waited for the last step to end before this."""
        if set(values) != set(self.names):
            raise ValueError(
                f"the captured step reads values {sorted(self.names)}; this step has "
                f"{sorted(values)}"
            )
        for i, name in enumerate(self.names):
            self.host[i] = float(values[name])
        # after whatever the current stream still has queued: the copy runs on
        # ``stream``, which does not otherwise wait for it. Before, the new buffer's zero
        # fill on the default stream could land after the copy when that stream was
        # still busy (the load's copies): the first update then read update 0 and lr 0,
        # AdamW's bias corrections 0 and every weight NaN after the first step; the
        # likely cause of session 45's NaN in the compiled resolver's gpu tests under
        # pytest-xdist (eight processes on one GPU), not yet confirmed on the device
        stream.wait_stream(torch.cuda.current_stream(stream.device))
        with torch.cuda.stream(stream):
            self.device_buffer.copy_(self.host, non_blocking=True)
        return dict(self.tensors)


class GraphCapture:
    """The runner of a torch backend while one step is captured (module doc)."""

    #: its clock is the virtual backend's: it launches at each end, as the simulator does
    runs_in_order = False

    def __init__(self, program: Program, streams: Mapping[OpKind, torch.cuda.Stream]) -> None:
        self.streams = dict(streams)
        self.compute_stream = self.streams[OpKind.TASK]
        self.collective_stream = self.streams[OpKind.COLLECTIVE]
        self.clock = VirtualBackend(program)
        self.launch_host_us: list[float] = []
        self._ends: dict[tuple[OpKind, int], torch.cuda.Event] = {}
        #: per stream: the last event each other stream completed (in the virtual
        #: timeline) that it has already waited for
        self._last_done: dict[OpKind, torch.cuda.Event | None] = {kind: None for kind in OpKind}
        self._waited: dict[OpKind, set[int]] = {kind: set() for kind in OpKind}
        self._fork: torch.cuda.Event | None = None

    def now_us(self) -> float:
        return self.clock.now_us()

    def start_run(self) -> None:
        self.launch_host_us = []

    def fork(self) -> None:
        """Called first inside the capture: the copy streams join it from the compute
        stream."""
        self._fork = torch.cuda.Event()
        self._fork.record(self.compute_stream)
        for kind, stream in self.streams.items():
            if kind is not OpKind.TASK:
                stream.wait_event(self._fork)

    def join(self) -> None:
        """Called last inside the capture: the compute stream waits for the copy streams'
        last operations, so the graph ends when everything in it has."""
        for kind, stream in self.streams.items():
            if kind is not OpKind.TASK:  # every forked stream rejoins, busy or not
                joined = torch.cuda.Event()
                joined.record(stream)
                self.compute_stream.wait_event(joined)
        torch.cuda.set_stream(self.compute_stream)

    def _before(self, kind: OpKind) -> torch.cuda.Stream:
        stream = self.streams[kind]
        for other, event in self._last_done.items():
            if other is kind or event is None or id(event) in self._waited[kind]:
                continue
            stream.wait_event(event)
            self._waited[kind].add(id(event))
        torch.cuda.set_stream(stream)
        return stream

    def _after(self, kind: OpKind, ref: int, stream: torch.cuda.Stream) -> None:
        end = torch.cuda.Event()
        end.record(stream)
        self._ends[(kind, ref)] = end

    def submit_task(
        self, index: int, task_id: str, executable: Executable, ctx: LaunchContext
    ) -> None:
        began = time.perf_counter()
        kind = OpKind.of(ctx.task)
        stream = self._before(kind)
        try:
            executable.launch(ctx)
        except Exception as exc:
            raise OpFailed(kind, index, f"task {task_id!r}", exc) from exc
        self._after(kind, index, stream)
        self.clock.launch_task(index)
        self.launch_host_us.append((time.perf_counter() - began) * 1e6)

    def submit_copy(
        self, serial: int, obj: str, direction: str, dst: torch.Tensor, src: torch.Tensor
    ) -> None:
        kind = _KIND[direction]
        stream = self._before(kind)
        dst.copy_(src, non_blocking=True)
        self._after(kind, serial, stream)
        self.clock.launch_transfer(serial, obj, direction)

    def wait(self) -> list[Completion]:
        completions = self.clock.wait()
        for completion in completions:
            self._last_done[completion.kind] = self._ends[(completion.kind, completion.ref)]
        return completions

    def close(self) -> None:
        pass


def stream_activity(run_one: Any, keep: Any = None) -> dict[str, float]:
    """What the device did while ``run_one()`` ran (one replayed step), from a
    torch.profiler trace of it (``trace_activity``); with ``keep`` (a path), the trace is
    also written there, gzipped (Perfetto and chrome://tracing open it)."""
    import gzip
    import json
    import shutil
    import tempfile
    from pathlib import Path

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        run_one()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "trace.json"
        prof.export_chrome_trace(str(path))
        if keep is not None:
            Path(keep).parent.mkdir(parents=True, exist_ok=True)
            with path.open("rb") as src, gzip.open(keep, "wb") as dst:
                shutil.copyfileobj(src, dst)
        return trace_activity(json.loads(path.read_text()).get("traceEvents", []))


def trace_activity(events: Sequence[Mapping[str, Any]]) -> dict[str, float]:
    """The device's activity in torch.profiler trace events (``cat`` ``kernel`` and
    ``gpu_memcpy``, ``ts``/``dur`` in microseconds): per stream kind the microseconds it
    was busy (the union of its intervals), and the span from the first activity's start to
    the last one's end. ``compute`` is the kernels and the device-to-device copies,
    ``kernel`` the kernels alone; copies to and from the host are split by direction
    (``h2d``, ``d2h``, also with their ``_bytes``)."""
    spans: dict[str, list[tuple[float, float]]] = {"kernel": [], "dtod": [], "h2d": [], "d2h": []}
    moved = {"h2d": 0, "d2h": 0}
    for event in events:
        if event.get("ph") != "X" or "dur" not in event:
            continue
        category, name = event.get("cat", ""), event.get("name", "")
        start, end = float(event["ts"]), float(event["ts"]) + float(event["dur"])
        if category == "kernel":
            spans["kernel"].append((start, end))
        elif category == "gpu_memcpy":
            kind = "h2d" if "HtoD" in name else "d2h" if "DtoH" in name else "dtod"
            spans[kind].append((start, end))
            if kind in moved:
                moved[kind] += int(event.get("args", {}).get("bytes", 0))
    everything = [span for intervals in spans.values() for span in intervals]
    result = {
        "span_us": max(e for _, e in everything) - min(s for s, _ in everything)
        if everything
        else 0.0,
        "compute_busy_us": union_us(spans["kernel"] + spans["dtod"]),
        "kernel_busy_us": union_us(spans["kernel"]),
        "h2d_busy_us": union_us(spans["h2d"]),
        "d2h_busy_us": union_us(spans["d2h"]),
    }
    result.update({f"{kind}_bytes": float(count) for kind, count in moved.items()})
    return result


def union_us(intervals: Iterable[tuple[float, float]]) -> float:
    """Total length of the union of ``(start, end)`` intervals."""
    total, reach = 0.0, float("-inf")
    for start, end in sorted(intervals):
        if end <= reach:
            continue
        total += end - max(start, reach)
        reach = end
    return total
