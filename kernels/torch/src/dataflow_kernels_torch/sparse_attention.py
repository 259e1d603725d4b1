"""Sparse attention over selected keys (DeepSeek Sparse Attention, DSA): each query sees only
the keys an indexer chose for it, and causally.

- ``sparse_attention_fwd(q, k, v, indices, *, scale=None) -> (out, lse)``: q, k, v (batch,
  heads, seq, head_dim), one key/value head per query head; ``indices`` int (batch, seq,
  K), the keys query ``i`` may see, no index twice in a row. Query ``i`` attends to key
  ``j`` where ``j`` is among its indices and ``j <= i`` (an index past the query is not
  seen: the indexer's top-k of an early query holds masked positions). lse (batch,
  heads, seq), float32 (float64 for float64 inputs). Every query sees at least itself
  where the indexer keeps it; a query that sees nothing is an error of its caller.
- ``sparse_attention_bwd(dout, q, k, v, out, lse, indices, *, scale=None) -> (dq, dk,
  dv)``: from the forward's output and logsumexp; no forward runs again.
- ``sparse_attention_probs(q, k, lse, indices, *, scale=None) -> p`` (batch, seq, K)
  float32 (float64 for float64 inputs): the attention's probability of each selected key,
  averaged over the heads, 0 at an index the query does not see (each row sums to 1):
  the target distribution the indexer is trained towards.

``reference`` variants write the (seq, seq) scores out whole and mask every pair that is
not selected and causal with -inf: the truth. ``gather`` variants gather each query's K
keys and values, (batch, seq, K, heads, head_dim), so the scores are (seq, K): the one
that runs by default, validated against the reference (``tests/test_sparse_attention.py``).
Neither is a fused kernel: on a GPU at DeepSeek V3.2's 128 heads and K = 2,048 the gather
holds 128 x 2,048 x 192 values per query; a Triton or FlashMLA kernel goes here next.
Softmax and accumulation in float32 at least, outputs in the inputs' dtype.
"""

from __future__ import annotations

import math

import torch


def _acc(dtype: torch.dtype) -> torch.dtype:
    return torch.promote_types(dtype, torch.float32)


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1 / math.sqrt(q.shape[-1]) if scale is None else scale


def _check(q: torch.Tensor, k: torch.Tensor, indices: torch.Tensor) -> None:
    batch, heads, seq, _ = q.shape
    if k.shape[:3] != (batch, heads, seq):
        raise ValueError(
            f"sparse attention: q {tuple(q.shape)} and k {tuple(k.shape)} must share batch, "
            "heads and sequence"
        )
    if indices.dim() != 3 or indices.shape[:2] != (batch, seq):
        raise ValueError(
            f"sparse attention: indices {tuple(indices.shape)} must be (batch, seq, K) = "
            f"({batch}, {seq}, K)"
        )


def selected_keep(indices: torch.Tensor, seq: int) -> torch.Tensor:
    """(batch, seq, seq) bool: query ``i`` sees key ``j`` (selected and ``j <= i``)."""
    batch = indices.shape[0]
    keep = torch.zeros(batch, indices.shape[1], seq, dtype=torch.bool, device=indices.device)
    keep.scatter_(-1, indices.long(), True)
    causal = torch.ones(indices.shape[1], seq, dtype=torch.bool, device=indices.device).tril()
    return keep & causal


def _selected_valid(indices: torch.Tensor) -> torch.Tensor:
    """(batch, seq, K) bool: the selected index is at or before its query."""
    positions = torch.arange(indices.shape[1], device=indices.device)
    return indices.long() <= positions[None, :, None]


# -- reference: the whole (seq, seq) scores, masked --------------------------------------


def _dense_probs(q, k, lse, indices, scale) -> torch.Tensor:
    """(batch, heads, seq, seq) probabilities, 0 outside the selection."""
    acc = _acc(q.dtype)
    keep = selected_keep(indices, k.shape[2])[:, None]
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, -math.inf)
    return torch.exp(scores - lse.to(acc)[..., None])


def sparse_attention_fwd_reference(q, k, v, indices, *, scale=None):
    _check(q, k, indices)
    scale, acc = _scale(q, scale), _acc(q.dtype)
    keep = selected_keep(indices, k.shape[2])[:, None]
    scores = (q.to(acc) @ k.to(acc).transpose(-1, -2)) * scale
    scores = scores.masked_fill(~keep, -math.inf)
    lse = torch.logsumexp(scores, -1)
    out = torch.softmax(scores, -1) @ v.to(acc)
    return out.to(q.dtype), lse


def sparse_attention_bwd_reference(dout, q, k, v, out, lse, indices, *, scale=None):
    _check(q, k, indices)
    scale, acc = _scale(q, scale), _acc(q.dtype)
    p = _dense_probs(q, k, lse, indices, scale)
    dout_, out_ = dout.to(acc), out.to(acc)
    dv = p.transpose(-1, -2) @ dout_
    dp = dout_ @ v.to(acc).transpose(-1, -2)
    delta = (dout_ * out_).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = (ds @ k.to(acc)) * scale
    dk = (ds.transpose(-1, -2) @ q.to(acc)) * scale
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def sparse_attention_probs_reference(q, k, lse, indices, *, scale=None):
    _check(q, k, indices)
    p = _dense_probs(q, k, lse, indices, _scale(q, scale)).mean(1)
    return p.gather(-1, indices.long()) * _selected_valid(indices)


# -- gather: each query's K keys and values ----------------------------------------------


def _gathered(t: torch.Tensor, indices: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, d) -> (batch, seq, K, heads, d): each query's selected rows."""
    rows = t.transpose(1, 2)  # (batch, seq, heads, d)
    batch = torch.arange(t.shape[0], device=t.device)[:, None, None]
    return rows[batch, indices.long()]


def _gathered_scores(q, k_sel, indices, scale, acc) -> torch.Tensor:
    scores = torch.einsum("bhsd,bskhd->bhsk", q.to(acc), k_sel.to(acc)) * scale
    return scores.masked_fill(~_selected_valid(indices)[:, None], -math.inf)


def _scatter(d_sel: torch.Tensor, indices: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """The gradient of ``_gathered``: (batch, seq, K, heads, d) summed back into (batch,
    heads, seq, d)."""
    batch, heads, seq, width = like.shape
    out = d_sel.new_zeros(batch, seq, heads, width)
    rows = torch.arange(batch, device=like.device)[:, None, None].expand_as(indices)
    out.index_put_((rows, indices.long()), d_sel, accumulate=True)
    return out.transpose(1, 2)


def sparse_attention_fwd(q, k, v, indices, *, scale=None):
    _check(q, k, indices)
    scale, acc = _scale(q, scale), _acc(q.dtype)
    scores = _gathered_scores(q, _gathered(k, indices), indices, scale, acc)
    lse = torch.logsumexp(scores, -1)
    p = torch.exp(scores - lse[..., None])
    out = torch.einsum("bhsk,bskhd->bhsd", p, _gathered(v, indices).to(acc))
    return out.to(q.dtype), lse


def sparse_attention_bwd(dout, q, k, v, out, lse, indices, *, scale=None):
    _check(q, k, indices)
    scale, acc = _scale(q, scale), _acc(q.dtype)
    k_sel, v_sel = _gathered(k, indices).to(acc), _gathered(v, indices).to(acc)
    p = torch.exp(_gathered_scores(q, k_sel, indices, scale, acc) - lse.to(acc)[..., None])
    dout_ = dout.to(acc)
    dp = torch.einsum("bhsd,bskhd->bhsk", dout_, v_sel)
    delta = (dout_ * out.to(acc)).sum(-1, keepdim=True)
    ds = p * (dp - delta)
    dq = torch.einsum("bhsk,bskhd->bhsd", ds, k_sel) * scale
    dk_sel = torch.einsum("bhsk,bhsd->bskhd", ds, q.to(acc)) * scale
    dv_sel = torch.einsum("bhsk,bhsd->bskhd", p, dout_)
    dk, dv = _scatter(dk_sel, indices, k), _scatter(dv_sel, indices, v)
    return dq.to(q.dtype), dk.to(k.dtype), dv.to(v.dtype)


def sparse_attention_probs(q, k, lse, indices, *, scale=None):
    _check(q, k, indices)
    scale, acc = _scale(q, scale), _acc(q.dtype)
    scores = _gathered_scores(q, _gathered(k, indices), indices, scale, acc)
    return torch.exp(scores - lse.to(acc)[..., None]).mean(1)
