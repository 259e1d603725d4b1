"""Probe, 2026-12-07 (session 40): what is alive at the bf16 chunked cross-entropy's CUDA peak?

Asked because `test_bfloat16_holds_one_chunk_of_logits_at_a_time` measured 2.2 MiB over
its bound on the H100 (session 39), and Qwen 3.5's head task measured a workspace of
6.37 GB against the float32 weight-gradient sum and one chunk of logits it should hold.

Answer (H100, torch 2.11, 2,048 x 256 tokens x dim, vocabulary 32,768, chunks of 256):
two chunks' bfloat16 d_logits were alive at the peak beside the float32 sum, its
product and the next chunk's float32 logits: the per-piece view ``part = d_logits[:,
cols]`` outlived ``del d_logits``, keeping each chunk's buffer into the next chunk's (the
Triton variant the same, with its 16-bit logits). Both now drop the view
(`results/ce_peak_h100_session40.txt`, from before the fix).

    python -m benchmarks.probes.ce_peak --variant torch

One warmed call under ``torch.cuda.memory._record_memory_history``; the trace's
allocations and frees are replayed to the moment the most bytes were alive, and each
block alive then is printed with its size and the kernel lines that allocated it.
"""

from __future__ import annotations

import argparse

import torch


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--variant", default="torch", choices=["torch", "triton"])
    parser.add_argument("--tokens", type=int, default=2048)
    parser.add_argument("--dim", type=int, default=256)
    parser.add_argument("--vocab", type=int, default=32768)
    parser.add_argument("--chunk", type=int, default=256)
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("ce_peak: needs a CUDA device")
    if args.variant == "triton":
        from dataflow_kernels_torch.triton_ce import chunked_cross_entropy_triton as ce
    else:
        from dataflow_kernels_torch.cross_entropy import chunked_cross_entropy as ce
    generator = torch.Generator(device="cuda").manual_seed(0)
    shape = (args.tokens, args.dim)
    hidden = torch.randn(shape, device="cuda", generator=generator).bfloat16()
    weight = torch.randn(args.vocab, args.dim, device="cuda", generator=generator).bfloat16()
    targets = torch.randint(0, args.vocab, (args.tokens,), device="cuda", generator=generator)
    ce(hidden, weight, targets, args.chunk)  # warm: cuBLAS keeps its workspace
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    before = torch.cuda.memory_allocated()
    torch.cuda.memory._record_memory_history(max_entries=100_000)
    outputs = ce(hidden, weight, targets, args.chunk)
    torch.cuda.synchronize()
    snapshot = torch.cuda.memory._snapshot()
    torch.cuda.memory._record_memory_history(enabled=None)
    del outputs
    print(
        f"allocator peak above the bytes in use before: {torch.cuda.max_memory_allocated() - before}"
    )
    alive: dict[int, dict] = {}
    now = most = 0
    at_most: list[dict] = []
    for event in snapshot["device_traces"][0]:
        if event["action"] == "alloc":
            alive[event["addr"]] = event
            now += event["size"]
            if now > most:
                most, at_most = now, list(alive.values())
        elif event["action"] == "free_requested" and event["addr"] in alive:
            now -= alive.pop(event["addr"])["size"]
    print(f"most bytes alive in the trace: {most}")
    for event in sorted(at_most, key=lambda e: -e["size"]):
        lines = [
            f"{frame['filename'].rsplit('/', 1)[-1]}:{frame['line']} {frame['name']}"
            for frame in event.get("frames", [])
            if "dataflow_kernels_torch" in frame["filename"]
        ]
        print(f"{event['size']:>14,}  {' <- '.join(lines[:3])}")


if __name__ == "__main__":
    main()
