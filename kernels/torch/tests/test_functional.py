"""The differentiable ops against float64 references written here: outputs and gradients.

Each test draws fresh inputs, runs the variant in the tested dtype, and compares its output
and its ``torch.autograd.grad`` gradients (for a random upstream gradient) with the same
formula evaluated in float64. Tolerances (``torch.testing.assert_close``):

- float32: rtol 1e-5, atol 1e-5
- bfloat16: rtol 2e-2, atol 2e-2 * max(1, largest |value| of the reference tensor):
  bfloat16 keeps 8 significant bits, so a sum of terms keeps the rounding error of its
  largest terms even where it cancels to a small value (a norm's weight gradient)
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
DTYPES = [torch.float32, torch.bfloat16]
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-5},
    torch.bfloat16: {"rtol": 2e-2, "atol": 2e-2},
}


def tolerance_for(dtype: torch.dtype, expected: torch.Tensor) -> dict[str, float]:
    """``TOLERANCE[dtype]``, with bfloat16's atol scaled by the reference's magnitude."""
    tolerance = dict(TOLERANCE[dtype])
    if dtype == torch.bfloat16:
        tolerance["atol"] *= max(1.0, float(expected.detach().abs().max()))
    return tolerance


def check_against_reference(
    kernel: Callable[..., torch.Tensor],
    reference: Callable[..., torch.Tensor],
    inputs: Sequence[torch.Tensor | None],
    upstream: torch.Tensor,
    **kwargs: object,
) -> None:
    """Output and gradients of ``kernel(*inputs)`` equal ``reference`` in float64."""
    tested = [t.detach().requires_grad_() if t is not None else None for t in inputs]
    exact = [t.detach().double().requires_grad_() if t is not None else None for t in inputs]
    out = kernel(*tested, **kwargs)
    want = reference(*exact, **kwargs)
    assert out.dtype == inputs[0].dtype and out.shape == want.shape
    dtype = inputs[0].dtype
    torch.testing.assert_close(out.double(), want, **tolerance_for(dtype, want))
    differentiable = [t for t in tested if t is not None]
    grads = torch.autograd.grad(out, differentiable, upstream)
    want_grads = torch.autograd.grad(want, [t for t in exact if t is not None], upstream.double())
    for index, (got, expected) in enumerate(zip(grads, want_grads, strict=True)):
        assert got.dtype == differentiable[index].dtype
        torch.testing.assert_close(
            got.double(),
            expected,
            **tolerance_for(dtype, expected),
            msg=lambda m, i=index: f"grad {i}: {m}",
        )


# -- references, float64, from the definitions ----------------------------------------------


def attention_reference(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *, causal: bool
) -> torch.Tensor:
    scores = q @ k.transpose(-2, -1) / math.sqrt(q.shape[-1])
    if causal:
        seq = q.shape[-2]
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        scores = scores.masked_fill(future, -math.inf)
    return torch.softmax(scores, dim=-1) @ v


def layer_norm_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor, eps: float
) -> torch.Tensor:
    mean = x.mean(dim=-1, keepdim=True)
    var = ((x - mean) ** 2).mean(dim=-1, keepdim=True)
    return (x - mean) / torch.sqrt(var + eps) * weight + bias


def rms_norm_reference(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x / torch.sqrt((x**2).mean(dim=-1, keepdim=True) + eps) * weight


def gelu_reference(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * (1 + torch.tanh(math.sqrt(2 / math.pi) * (x + 0.044715 * x**3)))


def silu_reference(x: torch.Tensor) -> torch.Tensor:
    return x / (1 + torch.exp(-x))


def linear_reference(
    x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None
) -> torch.Tensor:
    out = torch.einsum("...i,oi->...o", x, weight)
    return out if bias is None else out + bias


# -- tests ------------------------------------------------------------------------------------


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", ["torch", "torch-math"])
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize("shape", [(1, 1, 1, 8), (2, 3, 17, 24), (3, 2, 40, 64), (1, 4, 5, 16)])
def test_attention(kernel, randn, device, dtype, name, causal, shape) -> None:
    q, k, v, upstream = (randn(*shape, dtype=dtype, device=device) for _ in range(4))
    check_against_reference(
        kernel("attention", name), attention_reference, [q, k, v], upstream, causal=causal
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 33), (4, 768)])
def test_layer_norm(kernel, randn, device, dtype, shape) -> None:
    x = randn(*shape, dtype=dtype, device=device, scale=3.0) + 0.5
    weight = randn(shape[-1], dtype=dtype, device=device)
    bias = randn(shape[-1], dtype=dtype, device=device)
    upstream = randn(*shape, dtype=dtype, device=device)
    if shape[-1] == 1:  # one feature: the output is the bias; only its gradient is defined
        out = kernel("layer_norm", "torch")(x, weight, bias, 1e-5)
        torch.testing.assert_close(out, bias.expand_as(out))
        return
    check_against_reference(
        lambda *t: kernel("layer_norm", "torch")(*t, 1e-5),
        lambda *t: layer_norm_reference(*t, 1e-5),
        [x, weight, bias],
        upstream,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape", [(1, 1), (3, 7), (2, 5, 33), (4, 768)])
@pytest.mark.parametrize("eps", [1e-6, 1e-5])
def test_rms_norm(kernel, randn, device, dtype, shape, eps) -> None:
    x = randn(*shape, dtype=dtype, device=device, scale=2.0)
    weight = randn(shape[-1], dtype=dtype, device=device)
    upstream = randn(*shape, dtype=dtype, device=device)
    check_against_reference(
        lambda *t: kernel("rms_norm", "torch")(*t, eps),
        lambda *t: rms_norm_reference(*t, eps),
        [x, weight],
        upstream,
    )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("op", ["gelu", "silu"])
@pytest.mark.parametrize("shape", [(1,), (7, 13), (2, 3, 129)])
def test_activations(kernel, randn, device, dtype, op, shape) -> None:
    reference = {"gelu": gelu_reference, "silu": silu_reference}[op]
    x = randn(*shape, dtype=dtype, device=device, scale=3.0)
    upstream = randn(*shape, dtype=dtype, device=device)
    check_against_reference(kernel(op, "torch"), reference, [x], upstream)


def test_gelu_is_the_tanh_approximation(kernel) -> None:
    """At x = 1 the tanh form and the exact (erf) form differ in the 4th decimal."""
    x = torch.tensor([1.0], dtype=torch.float64)
    tanh_form = gelu_reference(x)
    erf_form = 0.5 * x * (1 + torch.erf(x / math.sqrt(2)))
    assert abs(float(tanh_form - erf_form)) > 1e-5
    torch.testing.assert_close(kernel("gelu", "torch")(x), tanh_form, rtol=1e-12, atol=1e-12)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("bias", [True, False])
@pytest.mark.parametrize("shape", [((1, 1), 1), ((5, 17), 9), ((2, 7, 32), 48)])
def test_linear(kernel, randn, device, dtype, bias, shape) -> None:
    x_shape, out_features = shape
    x = randn(*x_shape, dtype=dtype, device=device)
    weight = randn(out_features, x_shape[-1], dtype=dtype, device=device)
    b = randn(out_features, dtype=dtype, device=device) if bias else None
    upstream = randn(*x_shape[:-1], out_features, dtype=dtype, device=device)
    check_against_reference(kernel("linear", "torch"), linear_reference, [x, weight, b], upstream)


def test_linear_bias_defaults_to_none(kernel, randn) -> None:
    x, weight = randn(3, 4), randn(2, 4)
    torch.testing.assert_close(kernel("linear", "torch")(x, weight), x @ weight.T)


@pytest.mark.parametrize("name", ["torch", "torch-math"])
def test_attention_causal_is_keyword_only(kernel, randn, name) -> None:
    q = randn(1, 1, 3, 8)
    with pytest.raises(TypeError):
        kernel("attention", name)(q, q, q, True)
