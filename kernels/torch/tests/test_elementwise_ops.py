"""gelu_bwd and swiglu_fwd/_bwd against plain autograd of the formulas in float64, and the
fast variants against the reference variants, by relative error ``||got - want|| /
||want||``: CPU float64 1e-10, CPU float32 1e-5, CUDA float32 1e-4, CUDA bfloat16 and
float16 1e-2. On CUDA the Triton variants, where registered, are checked the same way.
"""

from __future__ import annotations

import math

import pytest
import torch

SHAPES = [(17,), (7, 13), (2, 3, 129), (4, 3072)]


def variants(manager, op, device):
    return [v.name for v in manager.kernels().for_op(op, device=device)]


def gelu_tanh(x):
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


@pytest.mark.parametrize("shape", SHAPES)
def test_gelu_bwd_matches_autograd(
    manager, kernel, randn, assert_rel_close, device, dtype, tol, shape
) -> None:
    x = randn(*shape, dtype=dtype, device=device, scale=3.0)
    dy = randn(*shape, dtype=dtype, device=device)
    x64 = x.detach().double().requires_grad_()
    (want,) = torch.autograd.grad(gelu_tanh(x64), x64, dy.double())
    for name in variants(manager, "gelu_bwd", device):
        got = kernel("gelu_bwd", name)(dy, x)
        assert got.dtype == dtype
        assert_rel_close(got, want, tol, f"gelu_bwd/{name}")


@pytest.mark.parametrize("shape", SHAPES)
def test_swiglu_matches_autograd(
    manager, kernel, randn, assert_rel_close, device, dtype, tol, shape
) -> None:
    gate = randn(*shape, dtype=dtype, device=device, scale=3.0)
    up, dy = (randn(*shape, dtype=dtype, device=device) for _ in range(2))
    g64, u64 = (t.detach().double().requires_grad_() for t in (gate, up))
    out64 = torch.nn.functional.silu(g64) * u64
    want_dgate, want_dup = torch.autograd.grad(out64, (g64, u64), dy.double())
    for name in variants(manager, "swiglu_fwd", device):
        out = kernel("swiglu_fwd", name)(gate, up)
        assert out.dtype == dtype
        assert_rel_close(out, out64.detach(), tol, f"swiglu_fwd/{name}")
    for name in variants(manager, "swiglu_bwd", device):
        dgate, dup = kernel("swiglu_bwd", name)(dy, gate, up)
        assert dgate.dtype == dup.dtype == dtype
        assert_rel_close(dgate, want_dgate, tol, f"swiglu_bwd/{name} dgate")
        assert_rel_close(dup, want_dup, tol, f"swiglu_bwd/{name} dup")


@pytest.mark.parametrize("op", ["swiglu_fwd", "swiglu_bwd", "gelu_bwd"])
def test_mismatched_inputs_are_named(manager, kernel, randn, op) -> None:
    a, b = randn(3, 4), randn(4, 3)
    args = (a, b) if op != "swiglu_bwd" else (a, a, b)
    for name in variants(manager, op, "cpu"):
        with pytest.raises(ValueError, match=r"shaped and typed like"):
            kernel(op, name)(*args)
