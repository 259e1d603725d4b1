"""layer_norm_fwd/_bwd and rms_norm_fwd/_bwd against plain autograd of the formulas in
float64 (mean, rstd and y from the definition; gradients by ``torch.autograd.grad`` for a
random upstream gradient), and the fast variant against the reference variant, by relative
error ``||got - want|| / ||want||``:

- CPU float64: 1e-10; CPU float32: 1e-5
- CUDA float32: 1e-4; CUDA bfloat16 and float16: 1e-2
"""

from __future__ import annotations

import pytest
import torch

VARIANTS = ["torch", "reference"]
SHAPES = [(3, 7), (2, 5, 33), (4, 768), (2, 3, 1000)]


def truth(kind, x, weight, bias, dy, eps):
    """(y, stats..., dx, dweight, dbias) in float64, by autograd of the formula."""
    leaves = [
        t.detach().double().requires_grad_() if t is not None else None for t in (x, weight, bias)
    ]
    x64, w64, b64 = leaves
    if kind == "layer_norm":
        mean = x64.mean(dim=-1)
        rstd = 1 / torch.sqrt(((x64 - mean.unsqueeze(-1)) ** 2).mean(dim=-1) + eps)
        y = (x64 - mean.unsqueeze(-1)) * rstd.unsqueeze(-1)
        stats = (mean, rstd)
    else:
        rstd = 1 / torch.sqrt((x64**2).mean(dim=-1) + eps)
        y = x64 * rstd.unsqueeze(-1)
        stats = (rstd,)
    if w64 is not None:
        y = y * w64
    if b64 is not None:
        y = y + b64
    differentiable = [t for t in leaves if t is not None]
    grads = iter(torch.autograd.grad(y, differentiable, dy.double()))
    return (
        y.detach(),
        [s.detach() for s in stats],
        [next(grads) if t is not None else None for t in leaves],
    )


def make(randn, shape, dtype, device, affine):
    x = randn(*shape, dtype=dtype, device=device, scale=2.0) + 0.5
    weight = randn(shape[-1], dtype=dtype, device=device) if affine else None
    bias = randn(shape[-1], dtype=dtype, device=device) if affine else None
    return x, weight, bias, randn(*shape, dtype=dtype, device=device)


def check(assert_rel_close, got_y, got_stats, got_grads, want, like, tol) -> None:
    want_y, want_stats, want_grads = want
    x = like[0]
    stats_dtype = torch.float64 if x.dtype == torch.float64 else torch.float32
    assert got_y.dtype == x.dtype
    assert_rel_close(got_y, want_y, tol, "y")
    for index, (got, expected) in enumerate(zip(got_stats, want_stats, strict=True)):
        assert got.dtype == stats_dtype and got.shape == x.shape[:-1]
        assert_rel_close(got, expected, tol, f"stat {index}")
    for label, got, expected, t in zip(
        ("dx", "dweight", "dbias"), got_grads, want_grads, like, strict=True
    ):
        if t is None:
            assert got is None, label
            continue
        assert got.dtype == t.dtype, label
        assert_rel_close(got, expected, tol, label)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_autograd(
    kernel, randn, assert_rel_close, device, dtype, tol, name, shape, affine
) -> None:
    x, weight, bias, dy = make(randn, shape, dtype, device, affine)
    want = truth("layer_norm", x, weight, bias, dy, 1e-5)
    y, mean, rstd = kernel("layer_norm_fwd", name)(x, weight, bias, 1e-5)
    grads = kernel("layer_norm_bwd", name)(dy, x, mean, rstd, weight, bias)
    check(assert_rel_close, y, (mean, rstd), grads, want, (x, weight, bias), tol)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm_matches_autograd(
    kernel, randn, assert_rel_close, device, dtype, tol, name, shape, affine, eps
) -> None:
    x, weight, _, dy = make(randn, shape, dtype, device, affine)
    want = truth("rms_norm", x, weight, None, dy, eps)
    y, rstd = kernel("rms_norm_fwd", name)(x, weight, eps)
    dx, dweight = kernel("rms_norm_bwd", name)(dy, x, rstd, weight)
    check(assert_rel_close, y, (rstd,), (dx, dweight, None), want, (x, weight, None), tol)


def test_fast_and_reference_statistics_are_interchangeable(
    kernel, randn, assert_rel_close, device, dtype, tol
) -> None:
    x, weight, bias, dy = make(randn, (6, 129), dtype, device, True)
    fast = kernel("layer_norm_fwd", "torch")(x, weight, bias, 1e-5)
    ref = kernel("layer_norm_fwd", "reference")(x, weight, bias, 1e-5)
    for label, got, want in zip(("y", "mean", "rstd"), fast, ref, strict=True):
        assert_rel_close(got, want, tol, label)
    want = kernel("layer_norm_bwd", "reference")(dy, x, *ref[1:], weight, bias)
    got = kernel("layer_norm_bwd", "torch")(dy, x, *ref[1:], weight, bias)
    for label, g, w in zip(("dx", "dweight", "dbias"), got, want, strict=True):
        assert_rel_close(g, w, tol, label)
    fast_rstd = kernel("rms_norm_fwd", "torch")(x, weight, 1e-6)[1]
    want = kernel("rms_norm_bwd", "reference")(dy, x, fast_rstd, weight)
    got = kernel("rms_norm_bwd", "torch")(
        dy, x, kernel("rms_norm_fwd", "reference")(x, weight, 1e-6)[1], weight
    )
    for label, g, w in zip(("dx", "dweight"), got, want, strict=True):
        assert_rel_close(g, w, tol, label)


@pytest.mark.parametrize("name", VARIANTS)
def test_bad_shapes_are_named(kernel, randn, name) -> None:
    x, weight, bias, dy = make(randn, (3, 8), torch.float32, "cpu", True)
    with pytest.raises(ValueError, match=r"weight \(8,\)"):
        kernel("layer_norm_fwd", name)(x, weight[:4], bias, 1e-5)
    _, mean, rstd = kernel("layer_norm_fwd", name)(x, weight, bias, 1e-5)
    with pytest.raises(ValueError, match=r"statistics of shape x.shape\[:-1\] = \(3,\)"):
        kernel("layer_norm_bwd", name)(dy, x, mean[:2], rstd, weight, bias)
    _, rstd = kernel("rms_norm_fwd", name)(x, weight, 1e-5)
    with pytest.raises(ValueError, match=r"dy shaped like x \(3, 8\)"):
        kernel("rms_norm_bwd", name)(dy[:2], x, rstd, weight)
