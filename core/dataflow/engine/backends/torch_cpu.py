"""Running on the CPU: one worker thread for compute, one per transfer direction and one
for the collective link (a fleet's all-reduces: gloo, in chain order).

Each worker takes its operations in order (a FIFO, like a CUDA stream), times them with
the host clock and reports completions to the dispatcher through one queue. A copy runs
on its worker's thread alone (``host_copy``): ``Tensor.copy_`` would split it over a
team of torch's intra-op threads of that worker's own, which then compete with the
compute worker's for the same cores (gpt2_tiny at batch 32 in 8 MiB, 12 MB copied a
step: its steps took 0.58 s with ``copy_``, 0.17 s copying on one thread, on a loaded
2-core machine).
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Callable
from typing import Any

import torch

from dataflow.engine.backends.link_fit import fit_links
from dataflow.engine.backends.torch_storage import host_copy
from dataflow.engine.contract import Executable, LaunchContext
from dataflow.engine.dispatcher import Completion, OpFailed, OpKind

_KIND = {"d2h": OpKind.D2H, "h2d": OpKind.H2D}


class CpuRunner:
    compute_stream = None
    collective_stream = None
    #: each worker runs its queue in order, as a stream does (``Dispatcher``'s run_ahead)
    runs_in_order = True

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
        job: Callable[[], object] = lambda: host_copy(dst, src)  # noqa: E731
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


def measure_host_links(
    size_bytes: int = 8 * 2**20,
    repeats: int = 5,
    beside: Callable[[None], None] | None = None,
) -> Any:
    """The links of a CPU step, measured as ``CpuRunner`` copies: fast and slow memory are
    both host memory, and each direction is a worker thread's copy of ``size_bytes`` on
    that thread alone (``host_copy``), timed there.
    Each direction's bandwidth copying alone, the two directions' total copying at once
    (``duplex_bytes_per_us``) and each direction's latency (a 4 KiB copy's time); the
    median of ``repeats``.

    ``beside(None)`` runs some compute in place (a task of the program to be run): it is
    kept running on a thread of its own through every timed copy, as the compute worker
    runs a step's tasks while its copies go, on the same cores."""
    source = torch.ones(size_bytes, dtype=torch.uint8)  # both directions read it
    buffers = {d: (torch.zeros(size_bytes, dtype=torch.uint8), source) for d in ("h2d", "d2h")}
    busy = _Busy(beside) if beside is not None else None

    lanes = {d: _Lane() for d in buffers}  # one worker thread a direction, as the runner's

    def timed(directions: tuple[str, ...], nbytes: int) -> dict[str, float]:
        for d in directions:
            dst, src = buffers[d]
            lanes[d].put(lambda dst=dst, src=src: host_copy(dst[:nbytes], src[:nbytes]))
        return {d: lanes[d].took_us() for d in directions}

    try:
        if busy is not None:
            busy.start()
        return fit_links(timed, size_bytes, repeats)
    finally:
        if busy is not None:
            busy.stop()
        for lane in lanes.values():
            lane.close()


class _Lane:
    """A worker thread that runs the jobs put to it in order and times each."""

    def __init__(self) -> None:
        self.jobs: queue.Queue = queue.Queue()
        self.times: queue.Queue = queue.Queue()
        self.thread = threading.Thread(target=self._run, daemon=True, name="dataflow-copy")
        self.thread.start()

    def _run(self) -> None:
        while (job := self.jobs.get()) is not None:
            start = time.perf_counter()
            job()
            self.times.put((time.perf_counter() - start) * 1e6)

    def put(self, job: Callable[[], object]) -> None:
        self.jobs.put(job)

    def took_us(self) -> float:
        """The time of the oldest job whose time was not taken yet (waits for it)."""
        return self.times.get()

    def close(self) -> None:
        self.jobs.put(None)
        self.thread.join()


class _Busy:
    """Compute kept running on a thread of its own (``measure_host_links``' ``beside``)."""

    def __init__(self, launch: Callable[[None], None]) -> None:
        self.launch = launch
        self.halt = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True, name="dataflow-beside")

    def _run(self) -> None:
        while not self.halt.is_set():
            self.launch(None)

    def start(self) -> None:
        self.thread.start()

    def stop(self) -> None:
        self.halt.set()
        self.thread.join()
