"""Running on CUDA: one compute stream, one stream per transfer direction and one for the
collective link (a fleet's all-reduces; NCCL enqueues them there).

Each operation is bracketed by two CUDA events on its stream; the dispatcher learns of a
completion by polling the end events (the host never blocks the device), and the times
come from the events themselves, relative to an origin event recorded at the run's start.
Copies between the fast arena and the pinned slow pool run on the copy engines.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable

import torch

from dataflow.engine.backends.link_fit import fit_links
from dataflow.engine.contract import Executable, LaunchContext
from dataflow.engine.dispatcher import Completion, OpFailed, OpKind

_KIND = {"d2h": OpKind.D2H, "h2d": OpKind.H2D}
#: The copy ``measure_links`` times on a CPU, at most: a host memcpy reaches its rate well
#: below 64 MiB, and the CPU profile should be quick.
CPU_COPY_BYTES = 8 * 2**20


class CudaRunner:
    #: push an NVTX range named by the task id around each task's launch (for Nsight
    #: Systems); off by default, switched on by profiling (``dataflow train --profile``)
    nvtx_ranges = False
    #: a stream runs its operations in launch order (``Dispatcher``'s run_ahead)
    runs_in_order = True

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self.streams = {kind: torch.cuda.Stream(device=device) for kind in OpKind}
        self.compute_stream = self.streams[OpKind.TASK]
        self.collective_stream = self.streams[OpKind.COLLECTIVE]
        self.origin = torch.cuda.Event(enable_timing=True)
        self.in_flight: list[tuple[OpKind, int, torch.cuda.Event, torch.cuda.Event]] = []
        self._free_events: list[torch.cuda.Event] = []  # reused: creating one costs host time
        self._current: torch.cuda.Stream | None = None
        self._previous = torch.cuda.current_stream(device)
        self._origin_pending = True
        #: host microseconds spent inside each task's launch (enqueueing its kernels)
        self.launch_host_us: list[float] = []

    def close(self) -> None:
        torch.cuda.synchronize(self.device)
        torch.cuda.set_stream(self._previous)
        self._current = None

    def forget_stream(self) -> None:
        """The current stream was changed behind this runner's back (a graph capture):
        set it again before the next operation."""
        self._current = None

    def start_run(self) -> None:
        torch.cuda.synchronize(self.device)
        self._origin_pending = True
        self.launch_host_us = []

    def _mark_origin(self) -> None:
        # Time 0 is the first operation of the step, as in the simulator; the host's set-up
        # before it is not part of the step's timeline.
        if self._origin_pending:
            self.origin.record(self.compute_stream)
            self._origin_pending = False

    def _event(self) -> torch.cuda.Event:
        return (
            self._free_events.pop() if self._free_events else torch.cuda.Event(enable_timing=True)
        )

    def _use(self, stream: torch.cuda.Stream) -> None:
        # Switching the current stream directly is cheaper than a context manager per op;
        # every launch happens on the dispatcher's thread, and close() restores the old one.
        if stream is not self._current:
            torch.cuda.set_stream(stream)
            self._current = stream

    def submit_task(
        self, index: int, task_id: str, executable: Executable, ctx: LaunchContext
    ) -> None:
        began = time.perf_counter()
        self._mark_origin()
        kind = OpKind.of(ctx.task)
        stream = self.streams[kind]
        start, end = self._event(), self._event()
        self._use(stream)
        if self.nvtx_ranges:
            torch.cuda.nvtx.range_push(task_id)
        start.record(stream)
        try:
            executable.launch(ctx)
        except Exception as exc:  # reported by the dispatcher with the memory state
            raise OpFailed(kind, index, f"task {task_id!r}", exc) from exc
        finally:
            if self.nvtx_ranges:
                torch.cuda.nvtx.range_pop()
        end.record(stream)
        self.in_flight.append((kind, index, start, end))
        self.launch_host_us.append((time.perf_counter() - began) * 1e6)

    def submit_copy(
        self, serial: int, obj: str, direction: str, dst: torch.Tensor, src: torch.Tensor
    ) -> None:
        self._mark_origin()
        kind = _KIND[direction]
        stream = self.streams[kind]
        start, end = self._event(), self._event()
        self._use(stream)
        start.record(stream)
        dst.copy_(src, non_blocking=True)
        end.record(stream)
        self.in_flight.append((kind, serial, start, end))

    def wait(self) -> list[Completion]:
        while True:
            done = [entry for entry in self.in_flight if entry[3].query()]
            if done:
                break
        finished = {id(entry) for entry in done}
        self.in_flight = [entry for entry in self.in_flight if id(entry) not in finished]
        origin = self.origin
        completions = []
        for kind, ref, start, end in done:
            completions.append(
                Completion(
                    kind, ref, origin.elapsed_time(start) * 1e3, origin.elapsed_time(end) * 1e3
                )
            )
            self._free_events += (start, end)
        return sorted(completions, key=lambda c: (c.end_us, c.kind))


#: Streams per priority in torch's CUDA stream pool (kStreamsPerPool in
#: c10/cuda/CUDAStream.cpp): ``torch.cuda.Stream()`` hands them out round-robin.
STREAM_POOL_SIZE = 32

#: What the caching allocator may count beyond the arena's and the largest task
#: workspace's own sizes (c10/cuda/CUDACachingAllocator.cpp). Blocks come in multiples of
#: 512 bytes (kMinBlockSize): seen as a 256-byte breach of a budget planned to the byte.
#: And a block of the large pool (over 1 MiB) is split off a cached or new segment only
#: when more than kSmallSize (1 MiB) would be left (``should_split``); otherwise the whole
#: block is handed out, and ``memory_allocated`` counts the whole block: up to 1 MiB more
#: than asked, for the arena and again for a workspace that lands in such a block. The
#: 1,409,536-byte breach of gpt2_124m's 2 GiB budget at batch 8 x 64 (session 9, with 512
#: here) is within that; not yet run again with it.
ALLOCATOR_ROUND_BYTES = 2 * (2**20 + 512)


def runtime_reserve_bytes(device: str | torch.device = "cuda") -> int:
    """Device memory the run takes beside the planned arena: what the CUDA libraries keep
    once a stream has run matrix products, what the engine itself keeps (the per-step
    values buffer) and takes while it captures a step into a CUDA graph, plus the
    allocator's rounding of the arena and of the largest workspace
    (``ALLOCATOR_ROUND_BYTES``).

    cuBLAS gives every (handle, stream) pair a workspace from the framework allocator the
    first time a product runs there, and keeps it. The engine's compute stream gets one
    too, so a plan must leave this much of the budget free: plan at
    ``budget - runtime_reserve_bytes()``. Measured, not assumed: a fresh stream runs
    float32 and bfloat16 products, then captures one into a CUDA graph beside a values
    buffer, and the growth of the allocator's peak is returned.
    """
    from dataflow.engine.backends.torch_graph import DeviceValues

    device = torch.device(device)
    torch.cuda.synchronize(device)
    before = torch.cuda.memory_allocated(device)
    torch.cuda.reset_peak_memory_stats(device)
    kept = []
    # torch hands streams out of a pool of 32 per priority, and cuBLAS keeps a workspace
    # per (handle, stream): a stream the process used before may already have one. Take
    # pool streams until one grows the allocation (the engine's own streams may be such
    # new ones), or the pool has come round (then every stream, the engine's too, has one).
    for _ in range(STREAM_POOL_SIZE + 1):
        stream = torch.cuda.Stream(device=device)
        grown_before = torch.cuda.memory_allocated(device)
        with torch.cuda.stream(stream):
            for dtype in (torch.float32, torch.bfloat16):
                a = torch.ones(256, 256, device=device, dtype=dtype)
                out = torch.empty_like(a)
                torch.matmul(a, a, out=out)
                kept.append((a, out))
        torch.cuda.synchronize(device)
        inputs_here = sum(
            a.untyped_storage().nbytes() + out.untyped_storage().nbytes() for a, out in kept[-2:]
        )
        if torch.cuda.memory_allocated(device) - grown_before > inputs_here:
            break
    torch.cuda.synchronize(device)
    values = DeviceValues(("lr", "step", "update"), device)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for a, out in kept:
            torch.matmul(a, a, out=out)
    torch.cuda.synchronize(device)
    inputs = sum(a.untyped_storage().nbytes() + out.untyped_storage().nbytes() for a, out in kept)
    grown = torch.cuda.max_memory_allocated(device) - before - inputs
    del graph, values, kept
    return max(0, grown) + ALLOCATOR_ROUND_BYTES


class _Busy:
    """Compute kept running on a stream of its own (``measure_links``' ``beside``)."""

    def __init__(self, device: torch.device, launch: Callable[[torch.cuda.Stream], None]):
        self.stream = torch.cuda.Stream(device=device)
        self.launch = launch
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        for _ in range(2):  # the second launch is timed: the first initialises
            torch.cuda.synchronize(device)
            start.record(self.stream)
            launch(self.stream)
            end.record(self.stream)
        torch.cuda.synchronize(device)
        self.launch_us = max(start.elapsed_time(end) * 1e3, 1.0)

    def start(self, for_us: float) -> None:
        """Enqueue launches enough to keep the device computing for ``for_us``."""
        for _ in range(max(1, math.ceil(for_us / self.launch_us))):
            self.launch(self.stream)


def measure_links(
    device: str | torch.device = "cuda",
    size_bytes: int = 64 * 2**20,
    repeats: int = 5,
    beside: Callable[[torch.cuda.Stream], None] | None = None,
):
    """The links between the device and pinned host memory, measured (on the CPU, copies
    between two host buffers: ``torch_cpu.measure_host_links``): each direction's
    bandwidth copying alone, the two directions' total copying at once
    (``duplex_bytes_per_us``: the simulator shares it while both are busy, as in a
    streaming step where write-backs and prefetches overlap), and each direction's latency
    (a small copy's time).

    Each direction copies ``size_bytes`` between a pinned host buffer and the device on
    its own stream, alone and then both started together; the median of ``repeats`` is
    kept. The duplex total is both copies' bytes over the longer of the two, less its
    latency.

    ``beside(stream)`` enqueues some compute on ``stream`` (a task of the program to be
    run); it is kept running through every timed copy, since a step's copies run beside
    its kernels and slower than alone: in gpt2_124m's step at 1 GiB the 1-32 MB copies
    ran at 46-47 GB/s each way beside kernels, 53-55 GB/s in the few with nothing beside
    them, where a lone 64 MiB copy measures 55 GB/s
    (``benchmarks/results/trace_vs_sim_gpt2_1GiB_fills.json``, ``copy_rates``).
    """

    device = torch.device(device)
    if device.type == "cpu":  # fast and slow memory are both the host's
        from dataflow.engine.backends.torch_cpu import measure_host_links

        return measure_host_links(min(size_bytes, CPU_COPY_BYTES), repeats, beside)
    host_in = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    host_out = torch.empty(size_bytes, dtype=torch.uint8, pin_memory=True)
    dev_in = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    dev_out = torch.empty(size_bytes, dtype=torch.uint8, device=device)
    streams = {"h2d": torch.cuda.Stream(device=device), "d2h": torch.cuda.Stream(device=device)}
    copies = {"h2d": (dev_in, host_in), "d2h": (host_out, dev_out)}

    busy = _Busy(device, beside) if beside is not None else None

    def timed(directions: tuple[str, ...], nbytes: int) -> dict[str, float]:
        events = {}
        torch.cuda.synchronize(device)
        if busy is not None:
            busy.start(2 * nbytes / 40e3 + 500)  # outlasts both copies at 40 GB/s
        for d in directions:
            start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            dst, src = copies[d]
            with torch.cuda.stream(streams[d]):
                start.record(streams[d])
                dst[:nbytes].copy_(src[:nbytes], non_blocking=True)
                end.record(streams[d])
            events[d] = (start, end)
        torch.cuda.synchronize(device)
        return {d: s.elapsed_time(e) * 1e3 for d, (s, e) in events.items()}

    links = fit_links(timed, size_bytes, repeats)
    del host_in, host_out, dev_in, dev_out
    return links
