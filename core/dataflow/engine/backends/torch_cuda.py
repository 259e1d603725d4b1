"""Running on CUDA: one compute stream and one stream per transfer direction.

Each operation is bracketed by two CUDA events on its stream; the dispatcher learns of a
completion by polling the end events (the host never blocks the device), and the times
come from the events themselves, relative to an origin event recorded at the run's start.
Copies between the fast arena and the pinned slow pool run on the copy engines.
"""

from __future__ import annotations

import time

import torch

from dataflow.engine.contract import Executable, LaunchContext
from dataflow.engine.dispatcher import Completion, OpKind

_KIND = {"d2h": OpKind.D2H, "h2d": OpKind.H2D}


class CudaRunner:
    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = {kind: torch.cuda.Stream(device=device) for kind in OpKind}
        self.compute_stream = self.streams[OpKind.TASK]
        self.origin = torch.cuda.Event(enable_timing=True)
        self.in_flight: list[tuple[OpKind, int, torch.cuda.Event, torch.cuda.Event]] = []
        #: host seconds spent inside each task's launch (enqueueing its kernels)
        self.launch_host_us: list[float] = []

    def close(self) -> None:
        torch.cuda.synchronize(self.device)

    def start_run(self) -> None:
        torch.cuda.synchronize(self.device)
        self.origin.record(self.compute_stream)
        self.launch_host_us = []

    def _submit(self, kind: OpKind, ref: int, enqueue) -> None:
        stream = self.streams[kind]
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        with torch.cuda.stream(stream):
            start.record(stream)
            enqueue()
            end.record(stream)
        self.in_flight.append((kind, ref, start, end))

    def submit_task(
        self, index: int, task_id: str, executable: Executable, ctx: LaunchContext
    ) -> None:
        began = time.perf_counter()
        self._submit(OpKind.TASK, index, lambda: executable.launch(ctx))
        self.launch_host_us.append((time.perf_counter() - began) * 1e6)

    def submit_copy(
        self, serial: int, obj: str, direction: str, dst: torch.Tensor, src: torch.Tensor
    ) -> None:
        self._submit(_KIND[direction], serial, lambda: dst.copy_(src, non_blocking=True))

    def wait(self) -> list[Completion]:
        while True:
            done = [entry for entry in self.in_flight if entry[3].query()]
            if done:
                break
        finished = {id(entry) for entry in done}
        self.in_flight = [entry for entry in self.in_flight if id(entry) not in finished]
        origin = self.origin
        completions = [
            Completion(kind, ref, origin.elapsed_time(start) * 1e3, origin.elapsed_time(end) * 1e3)
            for kind, ref, start, end in done
        ]
        return sorted(completions, key=lambda c: (c.end_us, c.kind))
