# ruff: noqa: B023  (each benchmark closure runs inside its own loop iteration)
"""Probe, 2026-12-05 (issue 44 item 5, written without a device, not run yet): what does a padded vocabulary give?

Storing the vocabulary padded (``vocab_multiple``: GPT-2's 50,257 as 50,304), op by op and
step by step, stock and dataflow.

``python -m benchmarks.probes.padded_vocab`` on the device (about 5 minutes on an H200)
prints, for GPT-2 124M in bf16:

1. the head's cross-entropy (``chunked_cross_entropy``, the ``torch`` and ``triton``
   variants) at 8,192 and 32,768 rows over a weight of 50,257 rows against one stored
   as 50,304 with ``vocab=50257`` (the triton variant's per-call copy goes away);
2. stock ``torch.compile`` at batch 16 and 32, ``StockTricks(vocab_multiple=1)`` against
   the default 64 (the issue measured 544,000 against 571,000-573,000 tokens/s);
3. dataflow at 16 GiB, batch 16 x 4 rounds x 1024, ``vocab_multiple`` 1 against 64.

Each line: the median time and tokens/s of both, and their ratio. Write what it answers
into docs/throughput.md ("The rows") and this docstring.
"""

from __future__ import annotations

import statistics
import time

import torch

from benchmarks.harness.compare_dataflow import random_batches, row_run, train_config
from benchmarks.harness.measure import measure_trial
from benchmarks.harness.stock import StockTricks, build_stock, stock_settings
from dataflow.plugins import families, kernels

VOCAB, PADDED, DIM = 50257, 50304, 768


def ops() -> None:
    import triton.testing as tt

    def bench(f) -> float:
        return tt.do_bench(f, warmup=25, rep=200, return_mode="median")

    torch.manual_seed(0)
    for rows in (8192, 32768):
        h = torch.randn(rows, DIM, device="cuda", dtype=torch.bfloat16)
        t = torch.randint(0, VOCAB, (rows,), device="cuda")
        plain = torch.randn(VOCAB, DIM, device="cuda", dtype=torch.bfloat16) * 0.02
        padded = torch.cat((plain, plain.new_zeros(PADDED - VOCAB, DIM)))
        for name in ("torch", "triton"):
            ce = kernels().get(f"chunked_cross_entropy/{name}").load()
            a = bench(lambda: ce(h, plain, t, 8192, grad_scale=1 / rows))
            b = bench(lambda: ce(h, padded, t, 8192, grad_scale=1 / rows, vocab=VOCAB))
            print(f"ce {name} rows={rows}: {VOCAB} {a:.3f} ms, {PADDED} {b:.3f} ms, {a / b:.3f}x")


def stock() -> None:
    config = families().get("gpt2").load().config("gpt2_124m")
    for batch in (16, 32):
        found = {}
        for multiple in (1, 64):
            tricks = StockTricks(vocab_multiple=multiple, fused_ce="torch")
            with stock_settings(tricks):
                step = build_stock(config, batch, 1024, compile=True, dtype="bf16", tricks=tricks)
                found[multiple] = measure_trial(step, batch, 1024, 3, 10, "cuda")["tok_s"]
            torch._dynamo.reset()
            torch.cuda.empty_cache()
        ratio = found[64] / found[1]
        print(
            f"stock compile bf16 batch {batch}: {found[1]:,.0f} -> {found[64]:,.0f} tok/s, {ratio:.3f}x"
        )


def dataflow() -> None:
    family = families().get("gpt2").load()
    train = train_config("bf16", 16, 4, 1024, 8192)
    found = {}
    for multiple in (1, 64):
        run = row_run(
            family, "gpt2_124m", train, 16 * 2**30, device="cuda",
            resolver="torch-compiled", overrides={"vocab_multiple": multiple},
        )  # fmt: skip
        batches = random_batches(VOCAB, 16, 4, 1024, 0)
        for _ in range(3):
            run.step(batches)
        torch.cuda.synchronize()
        times = []
        for _ in range(10):
            began = time.perf_counter()
            run.step(batches)
            torch.cuda.synchronize()
            times.append(time.perf_counter() - began)
        found[multiple] = 16 * 4 * 1024 / statistics.median(times)
        run.close(keep_state=False)
        torch.cuda.empty_cache()
    print(
        f"dataflow bf16 16 GiB 16 x 4: {found[1]:,.0f} -> {found[64]:,.0f} tok/s, {found[64] / found[1]:.3f}x"
    )


def main() -> None:
    ops()
    stock()
    dataflow()


if __name__ == "__main__":
    main()
