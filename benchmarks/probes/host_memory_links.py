"""Probe, 2026-12-04 (session 16): do registered or huge-page host buffers copy slower than pinned?

Answer: no: every kind copies at 53-55 GB/s a direction alone and 47-51 both ways, 1-2 %
slower beside a matmul, so the step's slower copies came from its own kernels
(results/host_memory_links*.jsonl; docs/throughput.md, session 16).

How fast do copies run between the device and each kind of page-locked host memory?

In the profiled gpt2_124m step at 1 GiB (session 16, ``trace_vs_sim.py``) the 1-32 MB
copies to and from the slow pool ran at 46-47 GB/s each way, where ``measure_links`` (one
64 MiB buffer from torch's pinned allocator) gave 55.5 GB/s. The slow pool is pageable
memory page-locked with ``cudaHostRegister`` (``torch_storage.page_lock``), over 16 GB.
This times ``--chunk``-byte copies walking through a host region of each kind:

* ``pinned``: ``torch.empty(pin_memory=True)`` (cudaHostAlloc), as ``measure_links``;
* ``registered``: ``torch.empty`` then ``cudaHostRegister``, as the slow pool;
* ``registered_huge``: an anonymous mmap advised ``MADV_HUGEPAGE``, touched, then
  registered;

each direction alone and both at once, with the device idle and with a bf16 matmul loop
running beside the copies (as compute runs beside a step's transfers). One JSON line per
case on stdout and in ``--out``.

    python -m benchmarks.probes.host_memory_links --out $OUT/host_memory_links.jsonl
"""

from __future__ import annotations

import argparse
import json
import mmap
import time
from pathlib import Path

import torch

MiB = 2**20


def region(kind: str, size: int) -> tuple[torch.Tensor, object]:
    """A host region of ``size`` bytes of ``kind``, and what keeps it alive."""
    if kind == "pinned":
        t = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        return t, None
    if kind == "registered":
        t = torch.empty(size, dtype=torch.uint8)
        keep = None
    else:
        keep = mmap.mmap(-1, size, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        keep.madvise(mmap.MADV_HUGEPAGE)
        t = torch.frombuffer(keep, dtype=torch.uint8)
    t.fill_(1)  # touch every page before it is locked
    cudart = torch.cuda.cudart()
    assert cudart.cudaHostRegister(t.data_ptr(), size, 0) == cudart.cudaError.success
    return t, keep


def release(kind: str, t: torch.Tensor) -> None:
    if kind != "pinned":
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())


def rate(
    host: torch.Tensor, dev: torch.Tensor, chunk: int, ways: str, copies: int, graph=False
) -> dict:
    """GB/s of each direction over ``copies`` copies of ``chunk`` bytes at spread offsets;
    with ``graph``, the copies are captured into one CUDA graph first and replayed, as a
    captured step's are."""
    if graph:
        g, side = torch.cuda.CUDAGraph(), torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.graph(g, stream=side):
            fork = torch.cuda.Event()
            fork.record(side)
            found = _enqueue(host, dev, chunk, ways, copies, fork)
            for _, end in found.values():
                side.wait_event(end)
        torch.cuda.synchronize()
        g.replay()
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        g.replay()
        end.record()
        torch.cuda.synchronize()
        gb_s = copies * chunk / (start.elapsed_time(end) * 1e-3) / 1e9
        return {way: round(gb_s, 2) for way in ways.split("+")} | {"graph": True}
    torch.cuda.synchronize()
    events = _enqueue(host, dev, chunk, ways, copies, None)
    torch.cuda.synchronize()
    return {
        way: round(copies * chunk / (s.elapsed_time(e) * 1e-3) / 1e9, 2)
        for way, (s, e) in events.items()
    }


def _enqueue(host, dev, chunk, ways, copies, fork) -> dict:
    slots = host.numel() // chunk
    streams = {"h2d": torch.cuda.Stream(), "d2h": torch.cuda.Stream()}
    events = {}
    for way in ways.split("+"):
        timing = fork is None  # events recorded under capture only order the streams
        start, end = torch.cuda.Event(enable_timing=timing), torch.cuda.Event(enable_timing=timing)
        with torch.cuda.stream(streams[way]):
            if fork is not None:
                streams[way].wait_event(fork)
            start.record()
            for i in range(copies):
                at = ((i * 7919 + (way == "d2h") * slots // 2) % slots) * chunk
                h, d = host[at : at + chunk], dev[(i % 4) * chunk : (i % 4 + 1) * chunk]
                if way == "h2d":
                    d.copy_(h, non_blocking=True)
                else:
                    h.copy_(d, non_blocking=True)
            end.record()
        events[way] = (start, end)
    return events


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--region-gib", type=float, default=16.0)
    p.add_argument("--chunks-mib", default="6,14,32")
    p.add_argument("--copies", type=int, default=60)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args()
    thp = Path("/sys/kernel/mm/transparent_hugepage/enabled")
    print(json.dumps({"thp": thp.read_text().strip() if thp.exists() else None}), flush=True)
    dev = torch.empty(4 * 32 * MiB, dtype=torch.uint8, device="cuda")
    a = torch.randn(8192, 8192, device="cuda", dtype=torch.bfloat16)
    load_stream = torch.cuda.Stream()
    lines = []
    for kind, size in (
        ("pinned", 256 * MiB),
        ("registered", int(args.region_gib * 2**30)),
        ("registered_huge", int(args.region_gib * 2**30)),
    ):
        began = time.perf_counter()
        host, keep = region(kind, size)
        made_s = time.perf_counter() - began
        for chunk_mib in map(int, args.chunks_mib.split(",")):
            for load in ("idle", "matmul", "graph"):
                for ways in ("h2d", "d2h", "h2d+d2h"):
                    if load == "matmul":  # ~0.4 s of matmuls beside the copies
                        with torch.cuda.stream(load_stream):
                            for _ in range(300):
                                torch.mm(a, a)
                    found = rate(
                        host, dev, chunk_mib * MiB, ways, args.copies, graph=load == "graph"
                    )
                    line = {
                        "kind": kind,
                        "region_bytes": size,
                        "made_s": round(made_s, 2),
                        "chunk_mib": chunk_mib,
                        "load": load,
                        "ways": ways,
                        "gb_s": found,
                    }
                    print(json.dumps(line), flush=True)
                    lines.append(line)
                    torch.cuda.synchronize()
        release(kind, host)
        del host, keep
    if args.out:
        args.out.write_text("".join(json.dumps(line) + "\n" for line in lines))


if __name__ == "__main__":
    main()
