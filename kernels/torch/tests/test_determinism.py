"""Variants flagged ``deterministic=True`` give the same bits twice on CUDA.

Each case runs the variant (forward and, for differentiable ops, ``torch.autograd.grad``)
twice on the same inputs, at sizes where a kernel that accumulates with atomics would show
it, and compares every output bitwise. ``attention/torch`` is flagged False and is not
checked (plugin.py says why). CPU runs are not checked: the flags are about CUDA kernels.
"""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch


def twice(run: Callable[[], tuple[torch.Tensor, ...]]) -> None:
    first = [t.clone() for t in run()]
    second = run()
    for index, (a, b) in enumerate(zip(first, second, strict=True)):
        assert torch.equal(a, b), f"output {index} differs between two runs"


def with_grads(kernel, inputs, upstream, **kwargs) -> Callable[[], tuple[torch.Tensor, ...]]:
    def run() -> tuple[torch.Tensor, ...]:
        leaves = [t.detach().requires_grad_() for t in inputs]
        out = kernel(*leaves, **kwargs)
        return (out, *torch.autograd.grad(out, leaves, upstream))

    return run


def test_every_deterministic_variant_is_covered(manager) -> None:
    flagged = {v.key for v in manager.kernels() if v.deterministic}
    assert flagged == set(CASES)


def attention_math(kernel, randn):
    q, k, v, up = (randn(4, 8, 1024, 64, dtype=torch.bfloat16, device="cuda") for _ in range(4))
    return with_grads(kernel("attention", "torch-math"), [q, k, v], up, causal=True)


def layer_norm(kernel, randn):
    x, up = (randn(8192, 1024, device="cuda") for _ in range(2))
    w, b = randn(1024, device="cuda"), randn(1024, device="cuda")
    return with_grads(lambda *t: kernel("layer_norm", "torch")(*t, 1e-5), [x, w, b], up)


def rms_norm(kernel, randn):
    x, up = (randn(8192, 1024, dtype=torch.bfloat16, device="cuda") for _ in range(2))
    w = randn(1024, dtype=torch.bfloat16, device="cuda")
    return with_grads(lambda *t: kernel("rms_norm", "torch")(*t, 1e-6), [x, w], up)


def elementwise(op):
    def case(kernel, randn):
        x, up = (randn(1 << 20, device="cuda") for _ in range(2))
        return with_grads(kernel(op, "torch"), [x], up)

    return case


def linear(kernel, randn):
    x, up = randn(4096, 1024, device="cuda"), randn(4096, 768, device="cuda")
    w, b = randn(768, 1024, device="cuda"), randn(768, device="cuda")
    return with_grads(kernel("linear", "torch"), [x, w, b], up)


def cross_entropy(kernel, randn):
    hidden = randn(4096, 256, dtype=torch.bfloat16, device="cuda")
    weight = randn(8192, 256, dtype=torch.bfloat16, device="cuda")
    targets = torch.randint(0, 8192, (4096,), generator=randn.generator).to("cuda")
    targets[::7] = -100
    ce = kernel("chunked_cross_entropy", "torch")
    return lambda: ce(hidden, weight, targets, 1000)


def adamw(name):
    def case(kernel, randn):
        param = randn(1 << 20, device="cuda")
        state = (randn(1 << 20, device="cuda", scale=0.1), randn(1 << 20, device="cuda") ** 2)
        grad = randn(1 << 20, device="cuda")

        def run() -> tuple[torch.Tensor, ...]:
            p, m, v = param.clone(), *(t.clone() for t in state)
            kernel("adamw", name)(
                p, grad, m, v, step=7, lr=1e-3, beta1=0.9, beta2=0.95, eps=1e-8, weight_decay=0.1
            )
            return p, m, v

        return run

    return case


CASES = {
    "attention/torch-math": attention_math,
    "layer_norm/torch": layer_norm,
    "rms_norm/torch": rms_norm,
    "gelu/torch": elementwise("gelu"),
    "silu/torch": elementwise("silu"),
    "linear/torch": linear,
    "chunked_cross_entropy/torch": cross_entropy,
    "adamw/torch": adamw("torch"),
    "adamw/torch-reference": adamw("torch-reference"),
}


@pytest.mark.gpu
@pytest.mark.parametrize("key", sorted(CASES))
def test_two_runs_give_the_same_bits(kernel, randn, key) -> None:
    twice(CASES[key](kernel, randn))
