"""The fast explicit ops only enqueue work on CUDA: each runs under
``torch.cuda.set_sync_debug_mode("error")``, which raises on any call that waits for the
device (``.item()``, a host copy of a device tensor, a data-dependent shape)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

pytestmark = pytest.mark.gpu


def assert_no_sync(run: Callable[[], object]) -> None:
    """Runs ``run()`` once to warm up (cuBLAS handles, Triton compiles), then again with
    any synchronizing call raising; the inputs are made before, on the host."""
    run()
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        run()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def bf16(randn, *shape):
    return randn(*shape, dtype=torch.bfloat16, device="cuda")


def fast_variants(manager, op):
    return [v.name for v in manager.kernels().for_op(op, device="cuda") if v.priority >= 0]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_and_norms(manager, kernel, randn, dtype) -> None:
    q, k, v, dout = (randn(2, 4, 100, 64, dtype=dtype, device="cuda") for _ in range(4))
    x, dy = (randn(300, 256, dtype=dtype, device="cuda") for _ in range(2))
    w, b = (randn(256, dtype=dtype, device="cuda") for _ in range(2))
    assert_no_sync(lambda: run_attention_and_norms(manager, kernel, q, k, v, dout, x, dy, w, b))


def run_attention_and_norms(manager, kernel, q, k, v, dout, x, dy, w, b) -> None:
    for name in fast_variants(manager, "attention_fwd"):  # each attention pair
        out, lse = kernel("attention_fwd", name)(q, k, v, causal=True)
        kernel("attention_bwd", name)(dout, q, k, v, out, lse, causal=True)
    for name in fast_variants(manager, "layer_norm_fwd"):
        _, mean, rstd = kernel("layer_norm_fwd", name)(x, w, b, 1e-5)
        kernel("layer_norm_bwd", name)(dy, x, mean, rstd, w, b)
        _, rstd = kernel("rms_norm_fwd", name)(x, w, 1e-6)
        kernel("rms_norm_bwd", name)(dy, x, rstd, w)
        kernel("gelu_bwd", name)(dy, x)


def test_swiglu(manager, kernel, randn) -> None:
    gate, up, dy = (bf16(randn, 300, 512) for _ in range(3))

    def run() -> None:
        for name in fast_variants(manager, "swiglu_fwd"):
            kernel("swiglu_fwd", name)(gate, up)
            kernel("swiglu_bwd", name)(dy, gate, up)

    assert_no_sync(run)


def test_cross_entropy(kernel, randn) -> None:
    hidden, weight = bf16(randn, 500, 64), bf16(randn, 3000, 64)
    targets = torch.randint(0, 3000, (500,), generator=randn.generator).to("cuda")
    ce = kernel("chunked_cross_entropy", "torch")
    assert_no_sync(lambda: ce(hidden, weight, targets, 128, grad_scale=0.01))


def test_adamw_multi(manager, kernel, randn) -> None:
    params = [bf16(randn, 10000), randn(5000, device="cuda")]
    grads = [torch.randn_like(p) for p in params]
    exp_avgs = [torch.zeros(p.shape, device="cuda") for p in params]
    exp_avg_sqs = [torch.zeros(p.shape, device="cuda") for p in params]

    def run() -> None:
        for name in fast_variants(manager, "adamw_multi"):
            kernel("adamw_multi", name)(
                params, grads, exp_avgs, exp_avg_sqs,
                step=3, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1,
            )  # fmt: skip

    assert_no_sync(run)
