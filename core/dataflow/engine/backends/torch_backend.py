"""The torch backend: real tensors, on ``cpu`` (worker threads) or ``cuda`` (streams).

The dispatcher decides what runs when; this class owns the bytes: the slow pool, the fast
store, typed views, and the placement's region rule (a residency may begin only once
every earlier residency that overlaps it in the arena has ended). How work is executed
and timed is the runner's business (``torch_cpu.CpuRunner``, ``torch_cuda.CudaRunner``).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from dataflow.engine.backends.torch_feed_copies import FeedCopies, first_fetch
from dataflow.engine.backends.torch_storage import (
    FastStore,
    SlowPool,
    Staging,
    as_bytes,
    host_copy,
    host_copy_split,
    typed_view,
)
from dataflow.engine.contract import Executable, LaunchContext, RunValues
from dataflow.engine.dispatcher import Completion, OpKind
from dataflow.schema import Location, Program


class TorchBackend:
    """One loaded program's storage plus a runner; reused across steps.

    ``defer_feeds`` (on CUDA): a per-step value fed into a slow slice is copied there while
    the step runs (``torch_feed_copies``), waited for where the slice is read; off, before it."""

    def __init__(
        self,
        program: Program,
        executables: list[Executable],
        device: torch.device,
        runner: Any,
        *,
        arena_bytes: int | None = None,
        offset_of: Callable[[str, int], int] | None = None,
        predecessors: Mapping[tuple[str, int], tuple[tuple[str, int], ...]] | None = None,
        workspace_offsets: Mapping[str, int] | None = None,
    ) -> None:
        self.program, self.executables, self.device = program, executables, device
        self.runner = runner
        self.name = f"torch-{device.type}"
        self.objs = program.objects_by_id
        slow_ids = program.ever_slow_ids()
        self.backed = program.backed_ids
        self.slow = SlowPool([obj for obj in program.objects if obj.id in slow_ids], device)
        sizes = {obj.id: obj.size_bytes for obj in program.objects}
        self.fast = FastStore(sizes, device, arena_bytes, offset_of)
        self.predecessors = predecessors or {}
        self.views: dict[str, torch.Tensor] = {}  # typed views of the resident objects
        self.workspace_offsets = workspace_offsets
        self.ended: set[tuple[str, int]] = set()
        self.values: Mapping[str, Any] = {}
        self.origin = time.perf_counter()
        self.feeds = FeedCopies(first_fetch(program))
        self.defer_feeds = device.type == "cuda"
        self.staging = Staging()  # page-locked host copies of the values fed per step

    # -- data in and out ---------------------------------------------------------------
    def put_initial(
        self, obj: str, tensor: torch.Tensor, *, per_step: bool = False, fast_only: bool = False
    ) -> None:
        """Place the start value of an object that exists at start, where it starts: a
        backed one (``Program.backed_ids``) in both memories, unless ``fast_only`` (its
        slow copy holds the value already: a step left it current).

        ``per_step``: the value of a later step (``Engine.run``'s feed and carried values),
        written between steps while the device is idle. Host bytes are copied by numpy,
        on this thread (``host_copy``: torch's intra-op threads, asleep through a step, took
        up to 87 ms a step to wake for them), a large value split over the engine's own
        copy threads (``host_copy_split``). On CUDA a fast-starting object is written
        asynchronously on the compute stream, which orders the step after it: a host value
        through a page-locked staging copy of its own, a device value once the current
        stream's work on it is done."""
        data = as_bytes(tensor.detach())
        if data.numel() != self.objs[obj].size_bytes:
            raise ValueError(
                f"initial value of {obj!r} has {data.numel()} bytes, the program "
                f"declares {self.objs[obj].size_bytes}"
            )
        backed = obj in self.backed
        if self.objs[obj].location is not Location.FAST or (backed and not fast_only):
            if per_step and self.defer_feeds and data.device.type == "cpu":
                self.feeds.add(obj, self.slow.view(obj), data)  # started with the step
            elif per_step:
                self.feeds.wait(obj)
                host_copy_split(self.slow.view(obj), data)
            else:
                self.slow.view(obj).copy_(data)
            if not backed:
                return
        if obj not in self.fast.buffers:
            self.alloc_fast(obj)
        target = self.fast.buffers[obj]
        if not per_step:
            target.copy_(data)
        elif self.device.type != "cuda":
            host_copy(target, data)
        elif data.device.type != "cuda":
            self.staging.send(obj, data, target, self.runner.compute_stream)
        else:
            stream = self.runner.compute_stream
            stream.wait_stream(torch.cuda.current_stream(self.device))
            data.record_stream(stream)  # its memory is not reused before the copy is done
            with torch.cuda.stream(stream):
                target.copy_(data, non_blocking=True)

    def reset_fast(self, keep: tuple[str, ...] | list[str] = ()) -> None:
        """Forget every fast residency but those of ``keep`` (between steps, before the
        start values go back): each kept object stays where it is, as its first
        residency of the next step (``at_start_address`` said it is there)."""
        kept = {obj: self.fast.buffers[obj] for obj in keep}
        self.fast.buffers.clear()
        self.fast.reset_occurrences()
        self.views.clear()
        self.ended.clear()
        for obj, buffer in kept.items():
            self.fast.buffers[obj] = buffer
            self.fast.occurrences[obj] = 1
            self.views[obj] = typed_view(buffer, self.objs[obj])

    def snapshot(self) -> tuple[dict, dict, dict, set]:
        """The bookkeeping of which residency is where (not the bytes), for ``restore``."""
        fast = self.fast
        return dict(fast.buffers), dict(fast.occurrences), dict(self.views), set(self.ended)

    def restore(self, snapshot: tuple[dict, dict, dict, set]) -> None:
        buffers, occurrences, views, ended = snapshot
        self.fast.buffers, self.fast.occurrences = dict(buffers), dict(occurrences)
        self.views, self.ended = dict(views), set(ended)

    def at_start_address(self, obj: str) -> bool:
        """Whether ``obj``'s fast copy lies where its first residency of a step does (always
        so without a placement: each residency is its own allocation)."""
        buffer = self.fast.buffers.get(obj)
        if buffer is None:
            return False
        if self.fast.offset_of is None:
            return True
        return buffer.storage_offset() == self.fast.arena.storage_offset() + self.fast.offset_of(
            obj, 0
        )

    def fast_value(self, obj: str) -> torch.Tensor | None:
        buffer = self.fast.buffers.get(obj)
        return None if buffer is None else typed_view(buffer, self.objs[obj])

    def slow_value(self, obj: str) -> torch.Tensor | None:
        if obj not in self.slow:
            return None
        self.feeds.wait(obj)
        return typed_view(self.slow.view(obj), self.objs[obj])

    def settle(self) -> None:
        """Wait for every fed value still being copied into the slow pool (a step's end;
        before a CUDA graph, whose copies read the pool without asking)."""
        self.feeds.wait_all()

    # -- the dispatcher's interface ----------------------------------------------------
    def start_run(self, values: Mapping[str, Any]) -> None:
        self.values = values
        self.origin = time.perf_counter()
        self.runner.start_run()
        self.feeds.start()

    @property
    def runs_in_order(self) -> bool:
        """Whether the runner's lanes run operations in launch order (the dispatcher may
        then launch a task behind the running one); a graph capture's do not: it decides
        on the virtual clock, as the simulator does."""
        return self.runner.runs_in_order

    def now_us(self) -> float:
        clock = getattr(self.runner, "now_us", None)  # a capture runs on a virtual clock
        if clock is not None:
            return clock()
        return (time.perf_counter() - self.origin) * 1e6

    def can_alloc_fast(self, obj: str) -> bool:
        key = (obj, self.fast.occurrences.get(obj, 0))
        return all(before in self.ended for before in self.predecessors.get(key, ()))

    def can_start_task(self, index: int) -> bool:
        key = (f"workspace:{self.program.tasks[index].id}", 0)
        return all(before in self.ended for before in self.predecessors.get(key, ()))

    def alloc_fast(self, obj: str) -> None:
        self.views[obj] = typed_view(self.fast.alloc(obj), self.objs[obj])

    def free_fast(self, obj: str) -> None:
        self.ended.add((obj, self.fast.occurrences[obj] - 1))
        self.fast.free(obj)
        del self.views[obj]

    def launch_task(self, index: int) -> None:
        task = self.program.tasks[index]
        view = self._view
        stream = self.runner.collective_stream if task.collective else self.runner.compute_stream
        ctx = LaunchContext(
            task=task,
            device=self.device.type,
            stream=stream,
            inputs=tuple(view(obj) for obj in task.inputs),
            mutates=tuple(view(obj) for obj in task.mutates),
            outputs=tuple(view(obj) for obj in task.outputs),
            values=RunValues(self.values, task.id),
            workspace=self._workspace(task, stream),
        )
        self.runner.submit_task(index, task.id, self.executables[index], ctx)

    def launch_transfer(self, serial: int, obj: str, direction: str) -> None:
        self.feeds.wait(obj)  # a fed value still on its way into the slice
        fast, slow = self.fast.buffers[obj], self.slow.view(obj)
        dst, src = (fast, slow) if direction == "h2d" else (slow, fast)
        self.runner.submit_copy(serial, obj, direction, dst, src)

    def wait(self) -> list[Completion]:
        completions = self.runner.wait()
        for completion in completions:
            if completion.kind in (OpKind.TASK, OpKind.COLLECTIVE):  # its workspace ends too
                self.ended.add((f"workspace:{self.program.tasks[completion.ref].id}", 0))
        return completions

    def _workspace(self, task, stream: Any) -> torch.Tensor | None:
        size = task.workspace_bytes
        if not size:
            return None
        if self.workspace_offsets is not None:  # planned into the arena
            start = self.workspace_offsets[task.id]
            return self.fast.arena[start : start + size]
        if self.fast.arena is not None:  # placed beside the arena: kernels allocate it
            return None
        if self.device.type != "cuda":  # the simple path
            return torch.empty(size, dtype=torch.uint8, device=self.device)
        # taken on the task's own ``stream``, whose order alone keeps the block from being
        # handed out again before the task has run (it is freed once the launch returns)
        with torch.cuda.stream(stream):
            return torch.empty(size, dtype=torch.uint8, device=self.device)

    def _view(self, obj: str) -> torch.Tensor:
        return self.views[obj]
