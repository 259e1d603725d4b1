# ruff: noqa: B023  (each benchmark closure runs inside its own loop iteration)
"""Probe, 2026-12-06 (issue 49): do varlen kernels beat the bias on segments?

Answer (H100, session 32): by 14-23x. Forward and backward, varlen against the mask path:
batch 2 x 4096 3.29 ms against 46.6 ms (peak 789 against 1,763 MiB above the inputs),
batch 1 x 8192 4.00 against 91.9 ms (684 against 1,923 MiB); batch 4 x 1024 mask 6.80 ms
(its varlen line was cut from the output). The two agree: out 1.1-1.8e-3, lse 5e-8, dq
2.7e-3, dk and dv 3.3e-3 relative. The mask path's backward runs in float32
(``attention.MASKED_BWD_DTYPE``, session 31's NaN mend), part of its cost.

How much flash's varlen kernels save over the memory-efficient kernel's per-row bias for
attention with segments, in time and memory.

The torch pair's forward and backward with packed segments (documents of random lengths,
each row's tail padded), bfloat16, 32 query heads on 8 key/value heads, head_dim 128:
once as it runs eagerly (the varlen path, ``attention_varlen``) and once with the varlen
layout refused (the mask path, what a captured step graph runs), each checked against
the other, timed (median ms, CUDA events) and with its peak memory above the inputs:
``python -m benchmarks.probes.segments_attention`` on the device.
"""

from __future__ import annotations

import torch
from dataflow_kernels_torch import attention

from benchmarks.harness.measure import cuda_median_ms


def _segments(batch: int, seq: int, generator: torch.Generator) -> torch.Tensor:
    """Documents of 64 to seq / 2 tokens packed into each row, the rest padding."""
    ids = torch.full((batch, seq), -1, dtype=torch.int64)
    for row in range(batch):
        at, doc = 0, 0
        while True:
            length = int(torch.randint(64, seq // 2, (), generator=generator))
            if at + length > seq - 16:
                break
            ids[row, at : at + length] = doc
            at, doc = at + length, doc + 1
    return ids.cuda()


def _timed(run, repeats: int = 20) -> tuple[float, int]:
    """(median ms, the allocator's peak above what was allocated before) of ``run``."""
    run()
    torch.cuda.synchronize()
    base = torch.cuda.memory_allocated()
    torch.cuda.reset_peak_memory_stats()
    ms = cuda_median_ms(run, warmup=0, repeats=repeats)
    return ms, torch.cuda.max_memory_allocated() - base


def main() -> None:
    generator = torch.Generator().manual_seed(0)
    heads, kv_heads, head_dim = 32, 8, 128
    varlen = attention._flash_varlen
    for batch, seq in ((4, 1024), (2, 4096), (1, 8192)):
        q, dout = (
            torch.randn(batch, heads, seq, head_dim, generator=generator).bfloat16().cuda()
            for _ in range(2)
        )
        k, v = (
            torch.randn(batch, kv_heads, seq, head_dim, generator=generator).bfloat16().cuda()
            for _ in range(2)
        )
        segments = _segments(batch, seq, generator)

        def run():
            out, lse = attention.attention_fwd(q, k, v, causal=True, segments=segments)
            grads = attention.attention_bwd(dout, q, k, v, out, lse, causal=True, segments=segments)
            return out, lse, *grads

        results = {}
        for path in ("varlen", "mask"):
            attention._flash_varlen = varlen if path == "varlen" else lambda *args: None
            try:
                results[path] = run()
                ms, peak = _timed(run)
            finally:
                attention._flash_varlen = varlen
            print(
                f"batch {batch} seq {seq} {path}: {ms:.3f} ms fwd+bwd, "
                f"peak {peak / 2**20:.0f} MiB above the inputs"
            )
        for label, a, b in zip(
            ("out", "lse", "dq", "dk", "dv"), results["varlen"], results["mask"], strict=True
        ):
            error = float((a.double() - b.double()).norm() / b.double().norm())
            print(f"  {label}: relative difference {error:.2e}")


if __name__ == "__main__":
    main()
