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

from benchmarks.harness.memory_trace import call_peak


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
    peak = call_peak(
        lambda: ce(hidden, weight, targets, args.chunk),
        keep=lambda filename: "dataflow_kernels_torch" in filename,
    )
    print("\n".join(peak.lines(top=len(peak.blocks))))


if __name__ == "__main__":
    main()
