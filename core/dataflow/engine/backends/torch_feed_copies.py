"""Fed values copied into the slow pool while the step runs.

A value fed for a step (``Engine.run``'s ``feed``) whose object starts in slow memory is
host bytes bound for its page-locked slow slice. Copied there before the step, the device
waits for all of them: l3_1b's RL update feeds 4.3 GB of hidden states, 187-766 ms of a
2.9 s update on the H100 machine (session 33). The step reads a slice only when it
prefetches the object, so ``FeedCopies`` starts the copies as the step starts, in the
order the step first prefetches their objects, on the engine's copy threads
(``torch_storage.copy_parts``), and the backend waits for an object's copy only where its
slice is read: its transfer, a ``fetch``, or the step's end.
"""

from __future__ import annotations

from collections.abc import Mapping
from concurrent.futures import Future

import torch

from dataflow.engine.backends import torch_storage
from dataflow.schema import Program


def first_fetch(program: Program) -> dict[str, int]:
    """Each object's first prefetch: -1 for the prologue's, else the index of the task
    whose end fetches it (objects never prefetched are absent)."""
    first: dict[str, int] = dict.fromkeys(program.prologue.prefetches, -1)
    for index, task in enumerate(program.tasks):
        for obj in task.prefetches:
            first.setdefault(obj, index)
    return first


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
        if dst.numel() != src.numel():  # said now, not when the step starts the copy
            raise ValueError(f"host copy of {src.numel()} bytes into {dst.numel()}")
        self.wait(obj)  # an earlier value still arriving there (never, between steps)
        self.queued[obj] = (dst, src)

    def start(self) -> None:
        if not self.queued:
            return
        threads = torch_storage.HOST_COPY_THREADS
        never = len(self.first) + 1
        for obj in sorted(self.queued, key=lambda o: self.first.get(o, never)):
            dst, src = self.queued[obj]
            part = max(torch_storage.SPLIT_COPY_BYTES, -(-src.numel() // threads))
            self.arriving[obj] = torch_storage.copy_parts(dst, src, part)
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
