"""Probe, 2026-12-04 (session 16): do cuBLASLt's and cuDNN's memset nodes stall a captured step?

Answer: yes: beside busy copy engines 264 us of compute gaps beside 24 memsets, 22 us once
they are fill kernels (results/memset_nodes.json; docs/throughput.md, session 16); the
engine has rewritten them since (``dataflow.engine.backends.graph_memsets``).

Do the small memsets cuBLASLt and cuDNN ask for stall a captured step, and does
turning them into kernel nodes (``dataflow.engine.backends.graph_memsets``) help?

A chain of GPT-2-shaped forward blocks (bias GEMMs, cuDNN attention, GELU) at
``--tokens`` tokens a block is captured into one CUDA graph twice: as captured (memset
nodes) and rewritten (fill-kernel nodes). Each graph is replayed alone and while both copy
directions stream pinned host memory on streams of their own, as in a planned step. Per
variant: the median replay time (event-timed, after settling), and from one profiled
replay the kernels' busy time, the gaps, and the gaps next to memsets. The two graphs'
outputs must be bit-identical.

    python -m benchmarks.probes.memset_nodes --out $OUT/memset_nodes.json
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import torch
import torch.nn.functional as F
from torch.nn.attention import SDPBackend, sdpa_kernel

from dataflow.engine.backends.graph_memsets import memsets_to_kernels


def blocks(x: torch.Tensor, weights: list[tuple], heads: int) -> torch.Tensor:
    batch, seq, width = x.shape
    for w_qkv, b_qkv, w_proj, b_proj, w_fc, b_fc, w_out, b_out in weights:
        qkv = F.linear(x, w_qkv, b_qkv).view(batch, seq, 3, heads, width // heads)
        q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        with sdpa_kernel(SDPBackend.CUDNN_ATTENTION):
            att = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        x = x + F.linear(att.transpose(1, 2).reshape(batch, seq, width), w_proj, b_proj)
        x = x + F.linear(F.gelu(F.linear(x, w_fc, b_fc), approximate="tanh"), w_out, b_out)
    return x


def capture(fn, rewrite: bool) -> tuple[torch.cuda.CUDAGraph, torch.Tensor, int]:
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        fn()  # warm: cuBLAS/cuDNN plans made outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph(keep_graph=True)
    with torch.cuda.graph(graph, stream=stream):
        out = fn()
    replaced = memsets_to_kernels(graph.raw_cuda_graph()) if rewrite else 0
    graph.instantiate()
    graph.replay()
    torch.cuda.synchronize()
    return graph, out, replaced


class Copies:
    """Both copy directions kept busy with ``chunk``-byte pinned copies on their own
    streams, enough to outlast ``ms`` milliseconds at ``gbps``."""

    def __init__(self, chunk: int, slots: int) -> None:
        self.host = [torch.empty(chunk, dtype=torch.uint8, pin_memory=True) for _ in range(slots)]
        self.dev = [torch.empty(chunk, dtype=torch.uint8, device="cuda") for _ in range(slots)]
        self.h2d, self.d2h = torch.cuda.Stream(), torch.cuda.Stream()
        self.chunk = chunk

    def start(self, ms: float, gbps: float = 55.0) -> None:
        n = max(2, int(ms * 1e-3 * gbps * 1e9 / self.chunk) + 2)
        half = len(self.host) // 2
        for i in range(n):
            with torch.cuda.stream(self.h2d):
                self.dev[i % half].copy_(self.host[i % half], non_blocking=True)
            with torch.cuda.stream(self.d2h):
                self.host[half + i % half].copy_(self.dev[half + i % half], non_blocking=True)


def timed(graph: torch.cuda.CUDAGraph, repeats: int, copies: Copies | None, ms: float) -> float:
    end_settle = time.perf_counter() + 0.2
    while time.perf_counter() < end_settle:
        graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        if copies is not None:
            copies.start(ms)
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        end.synchronize()
        times.append(start.elapsed_time(end) * 1e3)
        torch.cuda.synchronize()
    return statistics.median(times)


def traced(graph: torch.cuda.CUDAGraph, copies: Copies | None, ms: float) -> dict:
    from torch.profiler import ProfilerActivity, profile

    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        if copies is not None:
            copies.start(ms)
        graph.replay()
        torch.cuda.synchronize()
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / "t.json"
        prof.export_chrome_trace(str(path))
        events = json.loads(path.read_text()).get("traceEvents", [])
    compute = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X"
            and e.get("cat") in ("kernel", "gpu_memset")
            and not e["name"].startswith("Memcpy")
        ),
        key=lambda e: e["ts"],
    )
    copies_seen = sum(e.get("cat") == "gpu_memcpy" for e in events if e.get("ph") == "X")
    near = other = 0.0
    for before, after in zip(compute, compute[1:], strict=False):
        gap = max(0.0, after["ts"] - before["ts"] - before["dur"])
        if "gpu_memset" in (before["cat"], after["cat"]) or "df_fill" in (
            before["name"] + after["name"]
        ):
            near += gap
        else:
            other += gap
    span = compute[-1]["ts"] + compute[-1]["dur"] - compute[0]["ts"]
    return {
        "kernels": sum(e["cat"] == "kernel" for e in compute),
        "memsets": sum(e["cat"] == "gpu_memset" for e in compute),
        "fills": sum("df_fill" in e["name"] for e in compute),
        "copies": copies_seen,
        "span_us": round(span, 1),
        "busy_us": round(sum(e["dur"] for e in compute), 1),
        "gap_next_to_memset_or_fill_us": round(near, 1),
        "other_gap_us": round(other, 1),
    }


def main(argv: list[str] | None = None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=int, default=4096, help="tokens a block (batch x 1024)")
    p.add_argument("--layers", type=int, default=12)
    p.add_argument("--width", type=int, default=768)
    p.add_argument("--heads", type=int, default=12)
    p.add_argument("--repeats", type=int, default=30)
    p.add_argument("--out", type=Path, default=None)
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        sys.exit("memset_nodes.py: needs a CUDA device")
    torch.manual_seed(0)
    d, bf = args.width, torch.bfloat16

    def param(*shape):
        return (torch.randn(*shape, device="cuda") * 0.02).to(bf)

    weights = [
        (
            param(3 * d, d),
            param(3 * d),
            param(d, d),
            param(d),
            param(4 * d, d),
            param(4 * d),
            param(d, 4 * d),
            param(d),
        )
        for _ in range(args.layers)
    ]
    x = torch.randn(args.tokens // 1024, 1024, d, device="cuda").to(bf)

    def fn():
        return blocks(x, weights, args.heads)

    copies = Copies(8 << 20, 16)
    report = {"args": {k: str(v) for k, v in vars(args).items()}, "variants": {}}
    outputs = {}
    for rewrite in (False, True):
        graph, out, replaced = capture(fn, rewrite)
        alone = timed(graph, args.repeats, None, 0)
        busy = timed(graph, args.repeats, copies, alone * 1e-3 * 1.5)
        name = "fill_kernels" if rewrite else "memset_nodes"
        report["variants"][name] = {
            "replaced": replaced,
            "alone_us": round(alone, 1),
            "with_copies_us": round(busy, 1),
            "trace_alone": traced(graph, None, 0),
            "trace_with_copies": traced(graph, copies, alone * 1e-3 * 1.5),
        }
        outputs[name] = out.clone()
        print(name, json.dumps(report["variants"][name]), flush=True)
        del graph
    report["bit_identical"] = bool(torch.equal(outputs["memset_nodes"], outputs["fill_kernels"]))
    print("bit_identical", report["bit_identical"])
    if args.out:
        args.out.write_text(json.dumps(report, indent=1) + "\n")
    return report


if __name__ == "__main__":
    main()
