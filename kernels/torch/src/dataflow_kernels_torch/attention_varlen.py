"""Attention with ``segments`` on flash attention's variable-length kernels: the fast CUDA
path of ``attention.attention_fwd`` / ``attention_bwd`` for padded and packed batches
(the ``attention`` module doc says when it is taken).

The varlen kernels (``aten._flash_attention_forward`` / ``_flash_attention_backward`` with
cumulative sequence lengths) take the batch's tokens flattened row by row, (batch * seq,
heads, head_dim), and ``cu_seqlens`` (n + 1,) int32: sequence ``i`` is tokens
``cu_seqlens[i] .. cu_seqlens[i + 1] - 1``, and no token sees a token of another sequence.
``varlen_layout`` makes them from a segments tensor: every maximal run of one id inside a
row is one sequence, its padding runs (-1) too, each attending among itself as the mask
path's padding does (the callers zero what padded queries make). Sequences never span
rows (a run ends at its row's end). The mask semantics join the separated runs of one id
in a row (a query sees the keys of both); the varlen kernels cannot, so such segments get
no layout and take the mask path. ``kit.Segments`` does not rule them out.

The kernels' logsumexp is (heads, batch * seq) float32, unpadded: flash attention 2.4+'s
``mha_varlen_fwd`` (PyTorch's ``aten/src/ATen/native/transformers/cuda/flash_attn/
flash_api.cpp``: ``softmax_lse = at::empty({num_heads, total_q})``, ``unpadded_lse``; the
meta kernel of ``_flash_attention_forward`` in ``torch/_meta_registrations.py`` gives the
same shape); the contract's (batch, heads, seq) is its transpose (``lse_of_varlen``,
``lse_to_varlen``). Grouped key/value heads pass as they are: the kernels take
``kv_heads`` dividing ``heads`` and the backward returns dk, dv summed per group.

``varlen_layout`` reads the count and the longest of the runs on the host: one wait for
the device per call, so the callers never take this path while a CUDA graph is captured
or torch.compile traces.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

_aten = torch.ops.aten


class VarlenLayout(NamedTuple):
    """The sequences of a batch's flattened tokens (module doc)."""

    #: (n + 1,) int32 on the segments' device: sequence ``i`` is tokens ``cu_seqlens[i] ..
    #: cu_seqlens[i + 1] - 1`` of the batch flattened row by row
    cu_seqlens: torch.Tensor
    #: the longest sequence's length
    max_len: int


def varlen_layout(segments: torch.Tensor) -> VarlenLayout | None:
    """The runs of equal ids of a (batch, seq) segments tensor as sequences (module doc);
    None where some id >= 0 has two separated runs in one row. Waits for the device once."""
    batch, seq = segments.shape
    device = segments.device
    starts = torch.ones(batch, seq, dtype=torch.bool, device=device)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    flat_starts = starts.reshape(-1)
    run = flat_starts.cumsum(0) - 1  # each token's sequence, nondecreasing
    # the first token of sequence i, for every i a batch could hold (batch * seq past
    # the last one): no count on the host yet, and no atomics
    bounds = torch.searchsorted(run, torch.arange(batch * seq + 1, device=device))
    # a row's ids are contiguous where it has as many runs of ids >= 0 as distinct ids >= 0
    ordered = segments.sort(dim=1).values
    distinct = ((ordered[:, 1:] != ordered[:, :-1]) & (ordered[:, 1:] >= 0)).sum(1)
    distinct += ordered[:, 0] >= 0
    runs = (starts & (segments >= 0)).sum(1)
    split = (runs != distinct).any()
    longest = (bounds[1:] - bounds[:-1]).max()
    count, max_len, split = torch.stack((flat_starts.sum(), longest, split.long())).tolist()
    if split:
        return None
    return VarlenLayout(bounds[: count + 1].to(torch.int32), max_len)


def tokens_of(t: torch.Tensor) -> torch.Tensor:
    """(batch, heads, seq, dim) -> (batch * seq, heads, dim), the varlen kernels' layout
    (a copy unless ``t`` is a transposed view of that layout)."""
    batch, heads, seq, dim = t.shape
    return t.transpose(1, 2).reshape(batch * seq, heads, dim)


def heads_of(t: torch.Tensor, batch: int) -> torch.Tensor:
    """The inverse of ``tokens_of``: a (batch, heads, seq, dim) view."""
    total, heads, dim = t.shape
    return t.view(batch, total // batch, heads, dim).transpose(1, 2)


def lse_of_varlen(lse: torch.Tensor, batch: int) -> torch.Tensor:
    """The varlen kernels' (heads, batch * seq) lse as the contract's (batch, heads, seq),
    contiguous."""
    heads, total = lse.shape
    return lse.view(heads, batch, total // batch).transpose(0, 1).contiguous()


def lse_to_varlen(lse: torch.Tensor) -> torch.Tensor:
    """The contract's (batch, heads, seq) lse as the varlen kernels' (heads, batch * seq)
    float32, contiguous."""
    batch, heads, seq = lse.shape
    return lse.float().transpose(0, 1).reshape(heads, batch * seq).contiguous()


def _windows(window: int | None) -> dict[str, int]:
    """The kernels' window keywords: query ``i`` sees keys ``i - window < j <= i``."""
    return {} if window is None else {"window_size_left": window - 1, "window_size_right": 0}


def varlen_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: int | None,
    layout: VarlenLayout,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out like q, lse (batch, heads, seq) float32) of the sequences of ``layout``;
    padded queries' rows are their padding run's attention (the caller zeroes them)."""
    batch = q.shape[0]
    cu, max_len = layout
    with torch.no_grad():
        out, lse, *_ = _aten._flash_attention_forward(
            tokens_of(q), tokens_of(k), tokens_of(v), cu, cu, max_len, max_len, 0.0, causal,
            False, scale=scale, **_windows(window),
        )  # fmt: skip
    return heads_of(out, batch), lse_of_varlen(lse, batch)


def varlen_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: int | None,
    layout: VarlenLayout,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv) like q, k, v (dk, dv each key/value head's sum over its group)."""
    batch = q.shape[0]
    cu, max_len = layout
    with torch.no_grad():
        rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)  # no dropout
        unused = torch.empty((), dtype=torch.uint64, device=q.device)
        dq, dk, dv = _aten._flash_attention_backward(
            tokens_of(dout), tokens_of(q), tokens_of(k), tokens_of(v), tokens_of(out),
            lse_to_varlen(lse), cu, cu, max_len, max_len, 0.0, causal, rng_state, unused,
            scale=scale, **_windows(window),
        )  # fmt: skip
    return heads_of(dq, batch), heads_of(dk, batch), heads_of(dv, batch)
