# ruff: noqa: B023  (each benchmark closure runs inside its own loop iteration)
"""Probe, 2026-12-01 (session 3): are the triton cross-entropy and the cudnn attention faster?

Answer (H200, results/probe_ce_attention_h200.txt): the head's cross-entropy 3.5 ms
against torch's 19.8 at 8,192 rows (5.5x); cuDNN attention 0.198 ms forward and backward
against flash's 0.318 on contiguous q, k, v at batch 8. Inside GPT-2's eager tasks that
session cuDNN was slower (results/gpt2_task_speed.md); session 10 measured it faster in
compiled, replayed tasks, and it is preferred since (docs/kernel_registry.md).

The head's cross-entropy and the attention pair, variant against variant, on the device
(needs CUDA and triton): ``python -m benchmarks.probes.ce_attention``.
"""

import torch

from dataflow.plugins import kernels


def main() -> None:
    import triton.testing as tt

    reg = kernels()

    def load(op, name):
        return reg.get(f"{op}/{name}").load()

    def bench(f):
        return tt.do_bench(f, warmup=25, rep=200, return_mode="median")

    torch.manual_seed(0)
    for rows in (8192, 32768):
        h = torch.randn(rows, 768, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(50257, 768, device="cuda", dtype=torch.bfloat16) * 0.02
        t = torch.randint(0, 50257, (rows,), device="cuda")
        for name in ("torch", "triton"):
            ce = load("chunked_cross_entropy", name)
            took = bench(lambda: ce(h, w, t, 8192, grad_scale=1 / rows))
            print(f"ce rows={rows} {name}: {took:.3f} ms")
        a = load("chunked_cross_entropy", "torch")(h, w, t, 8192)
        b = load("chunked_cross_entropy", "triton")(h, w, t, 8192)
        print(
            "  rel diff loss",
            ((a[0] - b[0]).abs() / a[0].abs()).item(),
            "dh",
            ((a[1].float() - b[1].float()).norm() / a[1].float().norm()).item(),
            "dw",
            ((a[2].float() - b[2].float()).norm() / a[2].float().norm()).item(),
        )
    for batch in (8, 32):
        q, k, v, do = (
            torch.randn(batch, 12, 1024, 64, device="cuda", dtype=torch.bfloat16) for _ in range(4)
        )
        for name in ("torch", "cudnn"):
            fwd, bwd = load("attention_fwd", name), load("attention_bwd", name)

            def step():
                out, lse = fwd(q, k, v, causal=True)
                bwd(do, q, k, v, out, lse, causal=True)

            forward = bench(lambda: fwd(q, k, v, causal=True))
            print(
                f"attention batch={batch} {name}: fwd {forward:.3f} ms, fwd+bwd {bench(step):.3f} ms"
            )


if __name__ == "__main__":
    main()
