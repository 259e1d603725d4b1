"""attention_fwd / attention_bwd with ``segments`` (padded and packed batches) against
plain autograd of a masked softmax in float64.

The truth, written here from the definition: query ``i`` of row ``b`` sees key ``j`` only
where ``segments[b, i] == segments[b, j] >= 0`` (and causally, and in the window or the
mask where given); a padded query (id -1) sees nothing, so its output, its lse and every
gradient through it are zero. Every variant's (out, lse) and its backward (dq, dk, dv from
its own out and lse) are compared with it by relative error (conftest.PRECISIONS: CPU
float64 1e-10, CPU float32 1e-5, CUDA float32 1e-4, CUDA 16-bit 1e-2); on CUDA the
``gpu`` runs of these tests check the memory-efficient kernel's per-row bias.
"""

from __future__ import annotations

import math

import pytest
import torch

#: the pairs and the cuDNN pair (which hands segments to the torch pair)
VARIANTS = ["torch", "reference", "cudnn"]


def truth(q, k, v, dout, segments, *, causal, window=None, mask=None):
    """(out, lse, dq, dk, dv) in float64: a masked softmax, gradients by autograd."""
    q64, k64, v64 = (t.detach().double().requires_grad_() for t in (q, k, v))
    owner = torch.arange(q.shape[1], device=q.device) // (q.shape[1] // k.shape[1])
    scores = q64 @ k64[:, owner].transpose(-2, -1) / math.sqrt(q.shape[-1])
    seq = q.shape[-2]
    index = torch.arange(seq, device=q.device)
    keep = (segments[:, :, None] == segments[:, None, :]) & (segments[:, :, None] >= 0)
    if causal:
        keep &= index[None, :, None] >= index[None, None, :]
    if window is not None:
        keep &= index[None, :, None] - index[None, None, :] < window
    if mask is not None:
        keep &= mask
    scores = scores.masked_fill(~keep[:, None], -math.inf)
    seen = keep.any(-1)[:, None, :]  # a padded query sees nothing: lse 0, out 0
    lse = torch.where(seen, torch.logsumexp(scores, dim=-1), 0.0)
    probs = torch.softmax(scores, dim=-1).nan_to_num(0.0)
    out = probs @ v64[:, owner]
    grads = torch.autograd.grad(out, (q64, k64, v64), dout.double())
    return (out.detach(), lse.detach(), *grads)


def ids(rows: list[list[tuple[int, int]]], seq: int, device) -> torch.Tensor:
    """Segment ids from (id, length) runs per row, the rest of each row padding."""
    out = torch.full((len(rows), seq), -1, dtype=torch.int64)
    for row, runs in enumerate(rows):
        at = 0
        for sequence, length in runs:
            out[row, at : at + length] = sequence
            at += length
    return out.to(device)


#: (batch, heads, kv_heads, seq, head_dim), the runs of each row: packed documents,
#: right and left padding (a run of -1), one sequence alone
CASES = [
    ((2, 4, 2, 17, 16), [[(0, 5), (1, 7), (2, 5)], [(3, 10)]]),
    ((2, 3, 3, 24, 32), [[(-1, 4), (0, 20)], [(7, 9), (8, 9), (-1, 6)]]),
    ((1, 2, 1, 33, 64), [[(0, 1), (1, 31)]]),
]


def _run(kernel, name, q, k, v, dout, segments, **cuts):
    out, lse = kernel("attention_fwd", name)(q, k, v, segments=segments, **cuts)
    grads = kernel("attention_bwd", name)(dout, q, k, v, out, lse, segments=segments, **cuts)
    return out, lse, *grads


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize(("shape", "runs"), CASES, ids=lambda c: str(c)[:24])
@pytest.mark.parametrize("cut", ["causal", "window 4", "not causal", "mask"])
def test_segments_match_a_masked_softmax(
    kernel, randn, assert_rel_close, device, dtype, tol, name, shape, runs, cut
) -> None:
    batch, heads, kv_heads, seq, head_dim = shape
    q, dout = (randn(batch, heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    k, v = (randn(batch, kv_heads, seq, head_dim, dtype=dtype, device=device) for _ in range(2))
    segments = ids(runs, seq, device)
    cuts: dict = {"causal": cut != "not causal"}
    if cut == "window 4":
        cuts["window"] = 4
    if cut == "mask":  # every third key left out, each query keeping itself
        index = torch.arange(seq, device=device)
        cuts["mask"] = (index[None, :] % 3 != 0) | (index[:, None] == index[None, :])
    want = truth(q, k, v, dout, segments, **cuts)
    got = _run(kernel, name, q, k, v, dout, segments, **cuts)
    for label, g, w, like in zip(
        ("out", "lse", "dq", "dk", "dv"), got, want, (q, q[..., 0], q, k, v), strict=True
    ):
        assert g.shape == like.shape, label
        assert_rel_close(g, w, tol, label)
    padded = segments < 0
    assert not got[0][padded[:, None, :, None].expand_as(got[0])].any()  # exact zeros
    assert not got[2][padded[:, None, :, None].expand_as(got[2])].any()


@pytest.mark.parametrize("name", VARIANTS)
def test_one_sequence_per_row_is_plain_causal_attention(kernel, randn, name) -> None:
    """Segments of one id per row change nothing (the same kernels' bits aside)."""
    q, k, v, dout = (randn(2, 2, 13, 8, dtype=torch.float64) for _ in range(4))
    plain = _run(kernel, name, q, k, v, dout, None, causal=True)
    one = _run(kernel, name, q, k, v, dout, torch.zeros(2, 13, dtype=torch.int64), causal=True)
    for a, b in zip(plain, one, strict=True):
        torch.testing.assert_close(a, b, atol=1e-12, rtol=1e-12)


@pytest.mark.parametrize("name", VARIANTS)
def test_segments_are_an_int_tensor_of_the_batch(kernel, randn, name) -> None:
    q = randn(2, 2, 9, 8)
    for bad in (
        torch.zeros(2, 9),  # float
        torch.zeros(2, 8, dtype=torch.int64),  # the wrong length
        torch.zeros(9, dtype=torch.int64),  # no batch
        [[0] * 9] * 2,  # not a tensor
    ):
        with pytest.raises(ValueError, match=r"segments are a \(2, 9\) int32/int64 tensor"):
            kernel("attention_fwd", name)(q, q, q, causal=True, segments=bad)
