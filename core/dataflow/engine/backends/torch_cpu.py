"""Running on the CPU: one worker thread for compute, one per transfer direction and one
for the collective link (a fleet's all-reduces: gloo, in chain order).

Each worker takes its operations in order (a FIFO, like a CUDA stream), times them with
the host clock and reports completions to the dispatcher through one queue.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable

import torch

from dataflow.engine.contract import Executable, LaunchContext
from dataflow.engine.dispatcher import Completion, OpFailed, OpKind

_KIND = {"d2h": OpKind.D2H, "h2d": OpKind.H2D}


class CpuRunner:
    compute_stream = None
    collective_stream = None

    def __init__(self) -> None:
        self.done: queue.Queue = queue.Queue()
        #: host microseconds spent handing each task to the compute worker
        self.launch_host_us: list[float] = []
        self.origin = time.perf_counter()
        self.lanes = {kind: queue.Queue() for kind in OpKind}
        self.workers = [
            threading.Thread(
                target=self._work, args=(lane,), daemon=True, name=f"dataflow-{kind.name.lower()}"
            )
            for kind, lane in self.lanes.items()
        ]
        for worker in self.workers:
            worker.start()

    def start_run(self) -> None:
        self.origin = time.perf_counter()
        self.launch_host_us = []

    def _now_us(self) -> float:
        return (time.perf_counter() - self.origin) * 1e6

    def close(self) -> None:
        """Stop the worker threads (each finishes what it has queued first) and wait for
        them: a worker still inside torch when the interpreter exits aborts the process."""
        for lane in self.lanes.values():
            lane.put(None)
        for worker in self.workers:
            if worker is not threading.current_thread():
                worker.join()

    def _work(self, lane: queue.Queue) -> None:
        while True:
            item = lane.get()
            if item is None:
                return
            kind, ref, what, job = item
            start = self._now_us()
            try:
                job()
            except Exception as exc:  # reported to the dispatcher's thread, which raises
                self.done.put((kind, ref, what, exc))
                continue
            self.done.put(Completion(kind, ref, start, self._now_us()))

    def submit_task(
        self, index: int, task_id: str, executable: Executable, ctx: LaunchContext
    ) -> None:
        began = time.perf_counter()
        kind = OpKind.of(ctx.task)
        self.lanes[kind].put((kind, index, f"task {task_id!r}", lambda: executable.launch(ctx)))
        self.launch_host_us.append((time.perf_counter() - began) * 1e6)

    def submit_copy(
        self, serial: int, obj: str, direction: str, dst: torch.Tensor, src: torch.Tensor
    ) -> None:
        job: Callable[[], object] = lambda: dst.copy_(src)  # noqa: E731
        self.lanes[_KIND[direction]].put((_KIND[direction], serial, f"{direction} of {obj!r}", job))

    def wait(self) -> list[Completion]:
        got = [self.done.get()]
        while True:
            try:
                got.append(self.done.get_nowait())
            except queue.Empty:
                break
        for item in got:
            if not isinstance(item, Completion):
                raise OpFailed(*item)
        return sorted(got, key=lambda c: (c.end_us, c.kind))
