"""The sparse attention ops (``sparse_attention.py``): the reference against plain autograd
of a softmax masked to the selection and causality, and the ``torch`` (gather) variants
against the reference, float64 and float32; a selection holding positions past its query
(an early query's top-k) sees only its causal part, and a whole selection is causal
attention."""

from __future__ import annotations

import math

import pytest
import torch
from dataflow_kernels_torch import sparse_attention as sa

F64 = {"rtol": 1e-10, "atol": 1e-10}
F32 = {"rtol": 2e-5, "atol": 2e-6}


def problem(dtype, batch=2, heads=3, seq=11, k=4, dim=8, seed=0):
    """Random q, k, v, dout and each query's ``k`` distinct keys, chosen at random among
    every position (so early queries hold positions past themselves)."""
    g = torch.Generator().manual_seed(seed)
    q, key, v, dout = (
        torch.randn(batch, heads, seq, dim, generator=g, dtype=dtype) for _ in "1234"
    )
    scores = torch.rand(batch, seq, seq, generator=g)
    scores = scores + torch.eye(seq) * 10  # every query keeps itself
    indices = scores.topk(k, dim=-1).indices.to(torch.int32)
    return q, key, v, dout, indices


def autograd_truth(q, k, v, dout, indices, scale):
    """(out, lse, dq, dk, dv, head-mean probabilities at the indices) by autograd."""
    q, k, v = (t.detach().clone().requires_grad_() for t in (q, k, v))
    seq = q.shape[2]
    keep = torch.zeros(q.shape[0], seq, seq, dtype=torch.bool)
    for b in range(q.shape[0]):
        for i in range(seq):
            for j in indices[b, i].tolist():
                keep[b, i, j] = j <= i
    scores = (q @ k.transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep[:, None], -math.inf)
    probs = torch.softmax(scores, -1)
    out = probs @ v
    out.backward(dout)
    mean = probs.mean(1).detach().gather(-1, indices.long())
    return out.detach(), torch.logsumexp(scores, -1).detach(), q.grad, k.grad, v.grad, mean


@pytest.mark.parametrize(
    "variant", [("reference", "_reference"), ("torch", "")], ids=["reference", "torch"]
)
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
def test_the_variants_match_autograd(variant, dtype):
    suffix = variant[1]
    fwd = getattr(sa, f"sparse_attention_fwd{suffix}")
    bwd = getattr(sa, f"sparse_attention_bwd{suffix}")
    probs = getattr(sa, f"sparse_attention_probs{suffix}")
    q, k, v, dout, indices = problem(dtype)
    scale = 0.3
    out, lse, dq, dk, dv, mean = autograd_truth(q, k, v, dout, indices, scale)
    tol = F64 if dtype == torch.float64 else F32
    got_out, got_lse = fwd(q, k, v, indices, scale=scale)
    torch.testing.assert_close(got_out, out, **tol)
    torch.testing.assert_close(got_lse, lse, **tol)
    grads = bwd(dout, q, k, v, got_out, got_lse, indices, scale=scale)
    for got, want in zip(grads, (dq, dk, dv), strict=True):
        torch.testing.assert_close(got, want, **tol)
    p = probs(q, k, got_lse, indices, scale=scale)
    torch.testing.assert_close(p, mean.to(p.dtype), **tol)
    torch.testing.assert_close(p.sum(-1), torch.ones_like(p.sum(-1)), **tol)


def test_every_position_selected_is_causal_attention():
    q, k, v, dout, _ = problem(torch.float64, seq=7)
    everything = torch.arange(7).flip(0).expand(2, 7, 7).to(torch.int32)
    out, lse = sa.sparse_attention_fwd(q, k, v, everything, scale=0.5)
    causal = torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True, scale=0.5)
    torch.testing.assert_close(out, causal, **F64)


def test_a_selection_of_the_wrong_shape_is_an_error_naming_it():
    q, k, v, _, indices = problem(torch.float32)
    with pytest.raises(ValueError, match=r"indices \(2, 10, 4\) must be \(batch, seq, K\)"):
        sa.sparse_attention_fwd(q, k, v, indices[:, :10])
