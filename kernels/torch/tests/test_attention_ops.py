"""attention_fwd / attention_bwd against plain autograd of the attention formula in float64.

The truth: scores, causal mask, logsumexp and softmax written here from the definition,
evaluated in float64 on the tested inputs, and its gradients by ``torch.autograd.grad``
for a random upstream gradient. Every variant's forward (out, lse) and backward (dq, dk,
dv from the variant's own out and lse) is compared with it, and the fast variant with the
reference variant, by relative error ``||got - want|| / ||want||`` (conftest.PRECISIONS):

- CPU float64: 1e-10; CPU float32: 1e-5
- CUDA float32: 1e-4; CUDA bfloat16 and float16: 1e-2 (outputs rounded to 16 bits)

A sliding ``window`` (query ``i`` sees keys ``i - window < j <= i``) is held to the same
truth with that mask: the CPU kernel with its additive mask, flash's own window on CUDA in
16 bits (the ``gpu`` tests), the reference formulas elsewhere. So is a ``mask`` (any
pattern of pairs): the CPU kernel's additive mask, the memory-efficient kernel's bias on
CUDA (the ``gpu`` tests), the reference formulas elsewhere.
"""

from __future__ import annotations

import math

import pytest
import torch

VARIANTS = ["torch", "reference"]
#: cuDNN's pair: on CUDA in 16 bits its own kernels, elsewhere the torch pair
ALL_VARIANTS = [*VARIANTS, "cudnn"]
#: (batch, heads, seq, head_dim): one token, sequence lengths that are not multiples of 32
#: (the efficient kernel pads its lse to 32), GPT-2's head_dim.
SHAPES = [(1, 1, 1, 8), (2, 3, 17, 24), (3, 2, 40, 64), (1, 4, 33, 16), (2, 2, 64, 64)]


def autograd_truth(q, k, v, dout, *, causal, scale=None, window=None, mask=None):
    """(out, lse, dq, dk, dv) in float64 from the formula, gradients by autograd. With
    fewer key/value heads than query heads, query head h reads key/value head
    h // (heads // kv_heads) (autograd sums each key/value head's gradient over them)."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    factor = 1 / math.sqrt(q.shape[-1]) if scale is None else scale
    owner = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // k.shape[1])
    keys, values = k64[:, owner], v64[:, owner]
    scores = q64 @ keys.transpose(-2, -1) * factor
    if causal:
        seq = q.shape[-2]
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu(1)
        if window is not None:  # and the keys window or more tokens back
            future |= torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril(-window)
        scores = scores.masked_fill(future, -math.inf)
    if mask is not None:  # and the pairs the mask leaves out
        scores = scores.masked_fill(~mask, -math.inf)
    lse = torch.logsumexp(scores, dim=-1)
    out = torch.softmax(scores, dim=-1) @ values
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return (out.detach(), lse.detach(), *grads)


def inputs(randn, shape, dtype, device):
    return [randn(*shape, dtype=dtype, device=device) for _ in range(4)]


#: (batch, heads, kv_heads, seq, head_dim) with fewer key/value heads than query heads:
#: grouped-query attention, one key/value head (multi-query), Llama 3's head_dim
GROUPED = [(2, 4, 2, 17, 24), (1, 8, 2, 40, 64), (2, 6, 1, 33, 16), (1, 4, 1, 64, 128)]


@pytest.mark.parametrize("name", ALL_VARIANTS)
@pytest.mark.parametrize("causal", [True, False])
@pytest.mark.parametrize(
    "shape", [(b, h, h, s, d) for b, h, s, d in SHAPES] + GROUPED, ids=lambda shape: str(shape)
)
def test_forward_and_backward_match_autograd(
    kernel, randn, assert_rel_close, device, dtype, tol, name, causal, shape
) -> None:
    """With grouped key/value heads, dk and dv are like k and v, each the sum over its
    group of query heads (the contract, docs/kernel_registry.md)."""
    batch, heads, kv_heads, seq, head_dim = shape
    q, dout = (randn(batch, heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    k, v = (randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    want = autograd_truth(q, k, v, dout, causal=causal)
    out, lse = kernel("attention_fwd", name)(q, k, v, causal=causal)
    stats = torch.float64 if dtype == torch.float64 else torch.float32
    assert out.shape == q.shape and out.dtype == dtype
    assert lse.dtype == stats and lse.shape == q.shape[:3] and lse.is_contiguous()
    assert_rel_close(out, want[0], tol, "out")
    assert_rel_close(lse, want[1], tol, "lse")
    grads = kernel("attention_bwd", name)(dout, q, k, v, out, lse, causal=causal)
    for label, got, expected, like in zip(
        ("dq", "dk", "dv"), grads, want[2:], (q, k, v), strict=True
    ):
        assert got.shape == like.shape and got.dtype == like.dtype, label
        assert_rel_close(got, expected, tol, label)


@pytest.mark.parametrize("name", ALL_VARIANTS)
@pytest.mark.parametrize("window", [2, 5, 16, 40, 64])
@pytest.mark.parametrize(
    "shape", [(2, 3, 3, 40, 32), (1, 4, 2, 33, 64), (2, 2, 1, 17, 16)], ids=lambda s: str(s)
)
def test_a_sliding_window_matches_autograd(
    kernel, randn, assert_rel_close, device, dtype, tol, name, window, shape
) -> None:
    """Windows narrower than the sequence (two tokens, a few, most of it) and at or past it
    (plain causal attention), grouped key/value heads included. (A window of one token is
    left out: its out is v and its dq exactly zero, which a relative error cannot hold.)"""
    batch, heads, kv_heads, seq, head_dim = shape
    q, dout = (randn(batch, heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    k, v = (randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    want = autograd_truth(q, k, v, dout, causal=True, window=window)
    out, lse = kernel("attention_fwd", name)(q, k, v, causal=True, window=window)
    assert out.shape == q.shape and out.dtype == dtype and lse.is_contiguous()
    assert_rel_close(out, want[0], tol, "out")
    assert_rel_close(lse, want[1], tol, "lse")
    grads = kernel("attention_bwd", name)(dout, q, k, v, out, lse, causal=True, window=window)
    for label, got, expected, like in zip(
        ("dq", "dk", "dv"), grads, want[2:], (q, k, v), strict=True
    ):
        assert got.shape == like.shape and got.dtype == like.dtype, label
        assert_rel_close(got, expected, tol, label)


def chunked(seq: int, chunk: int, device) -> torch.Tensor:
    """Llama 4's chunked attention as a mask: query i sees the keys of its own chunk."""
    position = torch.arange(seq, device=device)
    return position[:, None] // chunk == position[None, :] // chunk


def scattered(seq: int, device, generator) -> torch.Tensor:
    """A random pattern of pairs, each query keeping its own position."""
    keep = torch.rand(seq, seq, generator=generator) < 0.4
    return (keep | torch.eye(seq, dtype=torch.bool)).to(device)


@pytest.mark.parametrize("name", ALL_VARIANTS)
@pytest.mark.parametrize(
    ("pattern", "causal", "window"),
    [("chunks of 8", True, None), ("chunks of 5", True, 3), ("scattered", True, None),
     ("scattered", False, None), ("chunks of 16", False, None)],
)  # fmt: skip
@pytest.mark.parametrize(
    "shape", [(2, 3, 3, 40, 32), (1, 4, 2, 33, 64), (2, 2, 1, 17, 16)], ids=lambda s: str(s)
)
def test_a_mask_matches_autograd(
    kernel, randn, assert_rel_close, device, dtype, tol, name, pattern, causal, window, shape
) -> None:
    """A mask alone (not causal), with causal attention, and with a window too: every
    variant against the formula with the same pairs left out, grouped heads included."""
    batch, heads, kv_heads, seq, head_dim = shape
    q, dout = (randn(batch, heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    k, v = (randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    if pattern == "scattered":
        mask = scattered(seq, device, randn.generator)
    else:
        mask = chunked(seq, int(pattern.split()[-1]), device)
    cut = {"window": window} if window is not None else {}
    want = autograd_truth(q, k, v, dout, causal=causal, mask=mask, **cut)
    out, lse = kernel("attention_fwd", name)(q, k, v, causal=causal, mask=mask, **cut)
    assert out.shape == q.shape and out.dtype == dtype and lse.is_contiguous()
    assert_rel_close(out, want[0], tol, "out")
    assert_rel_close(lse, want[1], tol, "lse")
    grads = kernel("attention_bwd", name)(dout, q, k, v, out, lse, causal=causal, mask=mask, **cut)
    for label, got, expected, like in zip(
        ("dq", "dk", "dv"), grads, want[2:], (q, k, v), strict=True
    ):
        assert got.shape == like.shape and got.dtype == like.dtype, label
        assert_rel_close(got, expected, tol, label)


@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_a_mask_is_a_bool_tensor_of_the_sequence(kernel, randn, name) -> None:
    q = randn(1, 2, 9, 8)
    for mask in (torch.ones(9, 9), torch.ones(8, 9, dtype=torch.bool), [[True] * 9] * 9):
        with pytest.raises(ValueError, match=r"a mask is a \(9, 9\) bool tensor on cpu, got"):
            kernel("attention_fwd", name)(q, q, q, causal=True, mask=mask)


@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_a_window_is_causal_and_positive(kernel, randn, name) -> None:
    q = randn(1, 2, 9, 8)
    for window, causal in ((0, True), (4, False)):
        with pytest.raises(ValueError, match=r"a sliding window is a causal window of at least"):
            kernel("attention_fwd", name)(q, q, q, causal=causal, window=window)


@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_key_value_heads_that_do_not_divide_the_query_heads_are_refused(
    kernel, randn, name
) -> None:
    q = randn(1, 6, 9, 8)
    k = v = randn(1, 4, 9, 8)
    with pytest.raises(
        ValueError, match=r"kv_heads dividing heads, got q \(1, 6, 9, 8\), k \(1, 4"
    ):
        kernel("attention_fwd", name)(q, k, v, causal=True)


@pytest.mark.parametrize("causal", [True, False])
def test_fast_matches_reference_and_their_lse_is_interchangeable(
    kernel, randn, assert_rel_close, device, dtype, tol, causal
) -> None:
    """Each backward takes the other variant's forward outputs (lse is the contract)."""
    q, k, v, dout = inputs(randn, (2, 3, 45, 32), dtype, device)
    fast_fwd, ref_fwd = (kernel("attention_fwd", n) for n in VARIANTS)
    fast_bwd, ref_bwd = (kernel("attention_bwd", n) for n in VARIANTS)
    fast, ref = fast_fwd(q, k, v, causal=causal), ref_fwd(q, k, v, causal=causal)
    for label, got, want in zip(("out", "lse"), fast, ref, strict=True):
        assert_rel_close(got, want, tol, label)
    want = ref_bwd(dout, q, k, v, *ref, causal=causal)
    for got in (
        fast_bwd(dout, q, k, v, *ref, causal=causal),
        ref_bwd(dout, q, k, v, *fast, causal=causal),
    ):
        for label, g, w in zip(("dq", "dk", "dv"), got, want, strict=True):
            assert_rel_close(g, w, tol, label)


@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_explicit_scale(kernel, randn, assert_rel_close, device, dtype, tol, name) -> None:
    q, k, v, dout = inputs(randn, (1, 2, 19, 16), dtype, device)
    want = autograd_truth(q, k, v, dout, causal=True, scale=0.3)
    out, lse = kernel("attention_fwd", name)(q, k, v, causal=True, scale=0.3)
    assert_rel_close(out, want[0], tol, "out")
    assert_rel_close(lse, want[1], tol, "lse")
    grads = kernel("attention_bwd", name)(dout, q, k, v, out, lse, causal=True, scale=0.3)
    for label, got, expected in zip(("dq", "dk", "dv"), grads, want[2:], strict=True):
        assert_rel_close(got, expected, tol, label)


@pytest.mark.parametrize("name", ALL_VARIANTS)
def test_non_contiguous_heads_view(kernel, randn, assert_rel_close, name) -> None:
    """q, k, v as the (batch, seq, 3, heads, dim) split of one projection, transposed."""
    qkv = randn(2, 21, 3, 4, 16, dtype=torch.float64)
    q, k, v = (qkv[:, :, i].transpose(1, 2) for i in range(3))
    dout = randn(2, 4, 21, 16, dtype=torch.float64)
    want = autograd_truth(q, k, v, dout, causal=True)
    out, lse = kernel("attention_fwd", name)(q, k, v, causal=True)
    grads = kernel("attention_bwd", name)(dout, q, k, v, out, lse, causal=True)
    for label, got, expected in zip(
        ("out", "dq", "dk", "dv"), (out, *grads), (want[0], *want[2:]), strict=True
    ):
        assert_rel_close(got, expected, 1e-10, label)


@pytest.mark.parametrize("name", VARIANTS)
def test_inputs_that_require_grad_build_no_graph(kernel, randn, name) -> None:
    q, k, v, dout = (t.requires_grad_() for t in inputs(randn, (1, 2, 9, 8), torch.float32, "cpu"))
    out, lse = kernel("attention_fwd", name)(q, k, v, causal=True)
    grads = kernel("attention_bwd", name)(dout, q, k, v, out, lse, causal=True)
    assert not any(t.requires_grad for t in (out, lse, *grads))


@pytest.mark.parametrize("name", VARIANTS)
def test_bad_shapes_are_named(kernel, randn, name) -> None:
    q = randn(1, 2, 5, 8)
    with pytest.raises(ValueError, match=r"k, v \(batch, kv_heads, seq, head_dim\)"):
        kernel("attention_fwd", name)(q, randn(1, 1, 5, 8), q, causal=True)  # k unlike v
    out, lse = kernel("attention_fwd", name)(q, q, q, causal=True)
    with pytest.raises(ValueError, match=r"lse \(batch, heads, seq\) = \(1, 2, 5\)"):
        kernel("attention_bwd", name)(q, q, q, q, out, lse[..., :4], causal=True)
    with pytest.raises(TypeError):
        kernel("attention_fwd", name)(q, q, q, True)


def test_backend_choice_on_cpu() -> None:
    from dataflow_kernels_torch.attention import backend

    assert backend(torch.zeros(1, 1, 2, 8)) == "cpu"
    assert backend(torch.zeros(1, 1, 2, 8, dtype=torch.float64)) == "cpu"
