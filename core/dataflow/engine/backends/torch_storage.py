"""Where a torch backend keeps object bytes: a slow pool and a fast store.

Objects are bytes to the engine: each lives in a uint8 slice; executables get typed views
built from the object's ``TensorMeta`` (a flat uint8 view when it has none).

- ``SlowPool``: one host allocation (page-locked on CUDA) with a fixed slice for every
  object that can ever have a slow copy, made once at load: no page-locking during a step.
- ``FastStore``: with a placement, one device allocation of the placement's arena size,
  each residency of an object a view at its planned offset; without one (the simple path,
  CPU only) each residency is its own allocation.
"""

from __future__ import annotations

import os
import weakref
from collections.abc import Callable, Iterable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy
import torch

from dataflow.schema import Obj, Program

#: Offsets into pools are rounded up to this, so every typed view is aligned.
ALIGN_BYTES = 256


def torch_dtype(name: str) -> torch.dtype:
    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise ValueError(f"torch has no dtype {name!r}")
    return dtype


def alias(buffer: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    """A contiguous ``dtype`` tensor of ``shape`` over the bytes of the uint8 ``buffer``.

    Not a view: it shares the storage but has its own autograd version counter. Views of
    one arena all share the arena's counter, so a transfer writing one object would look
    to autograd like an in-place change of every other (an executable that differentiates
    through its inputs would fail while a prefetch runs beside it).
    """
    itemsize = torch.empty((), dtype=dtype).element_size()
    offset = buffer.storage_offset()
    if offset % itemsize:
        raise ValueError(f"byte offset {offset} is not aligned to {dtype} ({itemsize} bytes)")
    strides = torch.empty(shape, device="meta").stride()
    out = torch.empty(0, dtype=dtype, device=buffer.device)
    return out.set_(buffer.untyped_storage(), offset // itemsize, shape, strides)


def typed_view(buffer: torch.Tensor, obj: Obj) -> torch.Tensor:
    """The typed tensor an executable sees for ``obj`` stored in the uint8 ``buffer``."""
    if obj.tensor is None:
        return alias(buffer, torch.uint8, (obj.size_bytes,))
    return alias(buffer, torch_dtype(obj.tensor.dtype), tuple(obj.tensor.shape))


def as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A flat uint8 view of a contiguous tensor's bytes."""
    return tensor.contiguous().view(-1).view(torch.uint8)


def host_copy(dst: torch.Tensor, src: torch.Tensor) -> None:
    """Copy ``src``'s bytes into ``dst`` (flat uint8 host tensors) on this thread alone.

    ``Tensor.copy_`` splits a host copy of more than 32K elements over torch's intra-op
    threads; between steps those threads have slept through a whole step, and waking
    them cost up to 7 ms a copy on the device machine (gpt2_124m at 8 GiB: 32 fed
    writes took 37-87 ms in 6 of 16 steps with 16 threads, 1.7-2.3 ms in every step with
    one; session 14, ``benchmarks/step_gaps.py --threads``). numpy copies on the caller's
    thread."""
    if src.device.type != "cpu":
        dst.copy_(src)
        return
    numpy.copyto(dst.numpy(), src.numpy())


#: A per-step host copy of at least this many bytes is split over ``HOST_COPY_THREADS``
#: threads (``host_copy_split``); a smaller one stays on the caller's thread, where one
#: thread copies at several GB/s and a split's hand-offs (tens of microseconds) would
#: cost more than they save. l3_1b's RL update feeds its hidden states as 128 objects of
#: 33.5 MB: a threshold of 64 MiB split none of them (session 33).
SPLIT_COPY_BYTES = 8 << 20
#: Threads of a split host copy (the caller's and its helpers'), at most one a core: the
#: feed of l3_1b's RL update (4.3 GB of hidden states into the page-locked slow pool) took
#: 766 / 377 / 235 / 187 ms with 1 / 2 / 4 / 8 threads on the H100 machine (16 cores;
#: session 33, ``benchmarks/probes/rl_timeline.py``), of a 2.9 s update.
HOST_COPY_THREADS = min(8, os.cpu_count() or 1)
#: the engine's copy threads, and how many it has (remade when the count changes)
_copy_pool: tuple[ThreadPoolExecutor, int] | None = None


def copy_parts(dst: torch.Tensor, src: torch.Tensor, part_bytes: int) -> list[Future]:
    """numpy copies of ``src`` into ``dst`` (flat uint8 host tensors of one size) in parts
    of ``part_bytes``, each submitted to the engine's ``HOST_COPY_THREADS`` copy threads
    (numpy lets go of the GIL while it copies). Those threads wait on a queue between
    steps, not in torch's intra-op pool, whose wake-up ``host_copy`` avoids."""
    global _copy_pool
    if dst.numel() != src.numel():
        raise ValueError(f"host copy of {src.numel()} bytes into {dst.numel()}")
    threads = HOST_COPY_THREADS
    if _copy_pool is None or _copy_pool[1] != threads:
        if _copy_pool is not None:
            _copy_pool[0].shutdown(wait=False)  # its threads end once idle
        _copy_pool = (ThreadPoolExecutor(threads, thread_name_prefix="dataflow-copy"), threads)
    pool = _copy_pool[0]
    target, source = dst.numpy(), src.numpy()
    return [
        pool.submit(numpy.copyto, target[at : at + part_bytes], source[at : at + part_bytes])
        for at in range(0, source.size, part_bytes)
    ]


def host_copy_split(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``host_copy`` of a large host source split into ``HOST_COPY_THREADS`` parts, one on
    this thread and the others on the engine's copy threads (``copy_parts``)."""
    threads = HOST_COPY_THREADS
    if src.device.type != "cpu" or threads < 2 or src.numel() < SPLIT_COPY_BYTES:
        host_copy(dst, src)
        return
    if dst.numel() != src.numel():
        raise ValueError(f"host copy of {src.numel()} bytes into {dst.numel()}")
    part = -(-src.numel() // threads)
    helped = copy_parts(dst[part:], src[part:], part)
    host_copy(dst[:part], src[:part])
    for job in helped:
        job.result()


def _aligned(size_bytes: int) -> int:
    return -(-size_bytes // ALIGN_BYTES) * ALIGN_BYTES


class SlowPool:
    def __init__(self, objects: Iterable[Obj], device: torch.device) -> None:
        self.offset: dict[str, int] = {}
        self.size: dict[str, int] = {}
        total = 0
        for obj in objects:
            self.offset[obj.id], self.size[obj.id] = total, obj.size_bytes
            total += _aligned(obj.size_bytes)
        self.arena = torch.empty(max(total, 1), dtype=torch.uint8)
        if device.type == "cuda":
            page_lock(self.arena)
            # unlocked when the pool goes; the finalizer holds the bytes until then
            weakref.finalize(self, _unlock, self.arena)
        self.total_bytes = total

    @staticmethod
    def total_of(objects: Iterable[Obj]) -> int:
        """The pool's size for ``objects``: each slice aligned."""
        return sum(_aligned(obj.size_bytes) for obj in objects)

    def __contains__(self, obj: str) -> bool:
        return obj in self.offset

    def view(self, obj: str) -> torch.Tensor:
        start = self.offset[obj]
        return self.arena[start : start + self.size[obj]]


class Staging:
    """A page-locked host buffer per object fed between steps, reused every step.

    ``send`` writes a host value to the device through the object's buffer (made and
    locked on first use, as the slow pool's: registered, not rounded up by the pinned
    allocator): into the buffer once the last copy out of it has ended, then out of it
    asynchronously on a stream."""

    def __init__(self) -> None:
        self.buffers: dict[str, torch.Tensor] = {}
        self.copied: dict[str, torch.cuda.Event] = {}  # each buffer's last copy out
        weakref.finalize(self, _unlock_each, self.buffers)  # unlocked when the staging goes

    def send(
        self, obj: str, data: torch.Tensor, target: torch.Tensor, stream: torch.cuda.Stream
    ) -> None:
        buffer = self.buffers.get(obj)
        if buffer is None:
            buffer = torch.empty(data.numel(), dtype=torch.uint8)
            page_lock(buffer)
            self.buffers[obj], self.copied[obj] = buffer, torch.cuda.Event()
        else:
            self.copied[obj].synchronize()
        host_copy(buffer, data)
        with torch.cuda.stream(stream):
            target.copy_(buffer, non_blocking=True)
        self.copied[obj].record(stream)


def page_lock(buffer: torch.Tensor) -> None:
    """Page-lock a host tensor's bytes for the device's copy engines, in place.

    Registered with ``cudaHostRegister`` rather than allocated with ``pin_memory=True``:
    torch's pinned allocator rounds every request up to a power of two, so an 80 GiB pool
    would lock 128 GiB (more than the device machine's host has; it fails as "CUDA error:
    out of memory"). Registered memory copies and captures into CUDA graphs as pinned."""
    size = buffer.numel() * buffer.element_size()
    cudart = torch.cuda.cudart()
    error = cudart.cudaHostRegister(buffer.data_ptr(), size, 0)
    if error != cudart.cudaError.success:
        raise MemoryError(
            f"could not page-lock the slow pool's {size} bytes of host memory "
            f"(cudaHostRegister: {error}); give a smaller slow budget or free host memory"
        )


def _unlock(buffer: torch.Tensor) -> None:
    torch.cuda.cudart().cudaHostUnregister(buffer.data_ptr())


def _unlock_each(buffers: dict[str, torch.Tensor]) -> None:
    for buffer in buffers.values():
        _unlock(buffer)


class FastStore:
    """Fast-memory buffers by object; ``offset_of(obj, occurrence)`` comes from a placement.

    Unplaced on CUDA, each buffer is the caching allocator's, taken on a stream of its own
    that runs nothing (``alloc_stream``). The allocator hands a freed block again to
    allocations on the stream it was taken on, trusting that stream's order alone: a
    task's temporaries go back to the compute stream's pool as soon as its launch returns,
    still in use until its kernels run, and a buffer taken from that pool for a copy on a
    transfer stream could be written while they run (seen on the H100: an in-order run's
    bytes clobbered). The engine frees a buffer only after every operation on it has
    ended, so a block of this stream's pool is free whenever it is handed out again."""

    def __init__(
        self,
        sizes: dict[str, int],
        device: torch.device,
        arena_bytes: int | None,
        offset_of: Callable[[str, int], int] | None,
    ) -> None:
        self.sizes, self.device = sizes, device
        self.offset_of = offset_of
        self.arena = (
            torch.empty(arena_bytes, dtype=torch.uint8, device=device)
            if offset_of is not None and arena_bytes
            else None
        )
        self.buffers: dict[str, torch.Tensor] = {}
        self.occurrences: dict[str, int] = {}
        unplaced_cuda = offset_of is None and device.type == "cuda"
        self.alloc_stream = torch.cuda.Stream(device=device) if unplaced_cuda else None

    def alloc(self, obj: str) -> torch.Tensor:
        occurrence = self.occurrences.get(obj, 0)
        self.occurrences[obj] = occurrence + 1
        size = self.sizes[obj]
        if self.alloc_stream is not None:
            with torch.cuda.stream(self.alloc_stream):
                buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        elif self.offset_of is None:
            buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        else:
            start = self.offset_of(obj, occurrence)
            buffer = self.arena[start : start + size]
        self.buffers[obj] = buffer
        return buffer

    def free(self, obj: str) -> None:
        del self.buffers[obj]

    def reset_occurrences(self) -> None:
        self.occurrences.clear()


def slow_pool_bytes(program: Program) -> int:
    """Bytes of the slow pool (pinned host memory on CUDA) the backend allocates at load."""
    slow_ids = program.ever_slow_ids()
    return SlowPool.total_of([obj for obj in program.objects if obj.id in slow_ids])
