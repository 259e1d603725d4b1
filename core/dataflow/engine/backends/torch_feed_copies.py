"""Fed values copied into the slow pool while the step runs.

A value fed for a step (``Engine.run``'s ``feed``) whose object starts in slow memory is
host bytes bound for its page-locked slow slice. Copied there before the step, the device
waits for all of them: l3_1b's RL update feeds 4.3 GB of hidden states, 187-766 ms of a
2.9 s update on the H100 machine (session 33). The step reads a slice only when it
prefetches the object, so ``FeedCopies`` starts the copies as the step starts, in the
order the step first prefetches their objects, on threads of the engine's own (numpy lets
go of the GIL while it copies), and the backend waits for an object's copy only where its
slice is read: its transfer, a ``fetch``, or the step's end.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future, ThreadPoolExecutor

import numpy
import torch

from dataflow.engine.backends import torch_storage
from dataflow.schema import Program

#: the threads copying fed values, and how many it has (remade when the count changes)
_pool: tuple[ThreadPoolExecutor, int] | None = None


def first_fetch(program: Program) -> dict[str, int]:
    """Each object's first prefetch: -1 for the prologue's, else the index of the task
    whose end fetches it (objects never prefetched are absent)."""
    first: dict[str, int] = dict.fromkeys(program.prologue.prefetches, -1)
    for index, task in enumerate(program.tasks):
        for obj in task.prefetches:
            first.setdefault(obj, index)
    return first


def _copy_pool() -> ThreadPoolExecutor:
    global _pool
    threads = torch_storage.HOST_COPY_THREADS
    if _pool is None or _pool[1] != threads:
        if _pool is not None:
            _pool[0].shutdown(wait=False)  # its threads end once idle
        _pool = (ThreadPoolExecutor(threads, thread_name_prefix="dataflow-feed"), threads)
    return _pool[0]


class FeedCopies:
    """The fed values of one step bound for slow slices: ``add`` keeps one, ``start``
    starts them all (those the step fetches first, first; each split into parts of at
    least ``SPLIT_COPY_BYTES`` over the copy threads), ``wait`` returns once one object's
    bytes are in its slice, ``wait_all`` once every one's are. The sources must stay as
    they are until then (the engine waits for all of them before a step returns)."""

    def __init__(self, first: Mapping[str, int]) -> None:
        self.first = dict(first)
        self.queued: dict[str, tuple[torch.Tensor, torch.Tensor]] = {}
        self.arriving: dict[str, list[Future]] = {}

    def add(self, obj: str, dst: torch.Tensor, src: torch.Tensor) -> None:
        if dst.numel() != src.numel():
            raise ValueError(f"host copy of {src.numel()} bytes into {dst.numel()}")
        self.wait(obj)  # an earlier value still arriving there (never, between steps)
        self.queued[obj] = (dst, src)

    def start(self) -> None:
        if not self.queued:
            return
        pool = _copy_pool()
        threads = torch_storage.HOST_COPY_THREADS
        never = len(self.first) + 1
        for obj in sorted(self.queued, key=lambda o: self.first.get(o, never)):
            dst, src = self.queued[obj]
            target, source = dst.numpy(), src.numpy()
            part = max(torch_storage.SPLIT_COPY_BYTES, -(-source.size // threads))
            self.arriving[obj] = [
                pool.submit(numpy.copyto, target[at : at + part], source[at : at + part])
                for at in range(0, source.size, part)
            ]
        self.queued.clear()

    def wait(self, obj: str) -> None:
        if obj in self.queued:
            self.start()
        for job in self.arriving.pop(obj, ()):
            job.result()

    def wait_all(self) -> None:
        self.start()
        for obj in list(self.arriving):
            self.wait(obj)
