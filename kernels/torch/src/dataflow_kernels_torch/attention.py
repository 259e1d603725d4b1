"""Softmax attention as an explicit forward/backward pair: the forward returns the
logsumexp its backward takes, so backward never runs the forward again.

``attention_fwd(q, k, v, *, causal, scale=None, window=None, mask=None, segments=None) ->
(out, lse)`` with q
(batch, heads, seq, head_dim) and k, v (batch, kv_heads, seq, head_dim), one sequence length for all three and
``kv_heads`` dividing ``heads`` (grouped-query attention: query head ``h`` attends with
key/value head ``h // (heads // kv_heads)``; ``kv_heads == heads`` is plain multi-head
attention):

    scores = q @ k.T * scale               (scale defaults to 1 / sqrt(head_dim))
    scores[i, j] = -inf where j > i        (causal only)
    scores[i, j] = -inf where j <= i - window   (a sliding window: causal, ``window`` keys)
    scores[i, j] = -inf where not mask[i, j]    (a mask: any (seq, seq) pattern of pairs)
    lse    = logsumexp(scores, -1)         (batch, heads, seq), float32 (float64 inputs: float64)
    out    = exp(scores - lse) @ v         like q

``attention_bwd(dout, q, k, v, out, lse, *, causal, scale=None, window=None, mask=None,
segments=None) -> (dq, dk, dv)``, with ``P = exp(scores - lse)``:

    dv = P.T @ dout
    dS = P * (dout @ v.T - rowsum(dout * out))
    dq = dS @ k * scale
    dk = dS.T @ q * scale

``dk`` and ``dv`` come back like ``k`` and ``v``: with grouped heads, each is the sum over its
group of query heads. ``lse`` is the one contract between the two: any variant's backward
accepts any variant's forward output, contiguous (batch, heads, seq).

With grouped heads the pairs here repeat each key/value head for its group before the
kernel (``repeat_kv``) and sum the group's gradients after it (``sum_groups``); cuDNN's pair
(``attention_cudnn``) takes the grouped heads as they are.

Which kernel the fast pair (``attention_fwd``, ``attention_bwd``) calls, by device and dtype
(``backend``):

- CUDA, float16/bfloat16, head_dim a multiple of 8 and at most 256, sm80 or newer:
  ``aten._scaled_dot_product_flash_attention`` and its backward (lse float32 already).
- CUDA, float32 (or 16-bit where flash does not apply), head_dim a multiple of 8 and at
  most 128: ``aten._scaled_dot_product_efficient_attention(compute_log_sumexp=True)``; its
  lse rows are padded to a multiple of 32, so the forward slices them off and the backward
  pads them again (a (batch, heads, 32) copy at most).
- CPU: ``aten._scaled_dot_product_flash_attention_for_cpu`` and its backward (its lse comes
  out (batch, seq, heads) in memory; returned contiguous).
- Anything else (float64 on CUDA, other head dims): the reference formulas below.

With a sliding ``window`` (HF's ``sliding_window``: query ``i`` sees keys ``i - window < j
<= i``; causal only; a window at or past the sequence length is plain causal attention):
flash on CUDA runs ``aten._flash_attention_forward`` / ``_flash_attention_backward`` with
``window_size_left = window - 1`` (its window in (batch, seq, heads, head_dim) layout,
views of the same tensors); the CPU kernel takes the window as an additive mask
(``attn_mask``: 0 where a key is seen, -inf elsewhere), exact as it is without one; the
memory-efficient kernel and everything else run the reference formulas, masked.

With a ``mask`` (a (seq, seq) bool tensor on q's device, True where query ``i`` sees key
``j``, the same for every sequence and head; with ``causal`` and ``window`` too, a key must
pass all three): the CPU kernel takes it as an additive mask, and on CUDA the
memory-efficient kernel takes it as its additive bias (a (seq, seq) tensor of q's dtype,
its rows padded to the kernel's alignment, expanded over batch and heads without a copy;
16 or 32 bits, head_dim a multiple of 8 and at most 128); everything else runs the
reference formulas, masked. Every query must see at least one key (its own position, say):
a row with none has no softmax (its lse is -inf), and nothing here checks it, which would
wait for the device.

With ``segments`` (a (batch, seq) int32/int64 tensor on q's device, each token's sequence
id, -1 at padding: padded or packed batches): query ``i`` of row ``b`` sees key ``j`` only
where ``segments[b, i] == segments[b, j]``, besides causal, window and mask; a padded query
sees nothing, and its out and lse are 0, its gradients zero, whatever the backward is given
for it. ``segment_keep`` makes the pairs, (batch, 1, seq, seq), with each row's padding as
one sequence of its own (so no kernel meets a query without keys); the CPU kernel takes
them as its additive mask, the memory-efficient kernel on CUDA as its per-row bias (as
with a mask), everything else runs the reference formulas; then the padded rows are
zeroed (``zero_padded``), and a backward zeroes their ``dout`` and ``q`` before the kernel
(no gradient from them, and finite probabilities whatever their lse). The mask costs
(batch, seq, seq) bools, and the bias as much of q's dtype. On CUDA a masked backward of
16-bit inputs runs in float32 (``MASKED_BWD_DTYPE`` says why).

Where flash runs (``backend`` says ``flash``) and no ``mask`` is given, segments run on
flash's variable-length kernels instead (``attention_varlen``; causal or not, with a
window or without): each run of one id in a row is a sequence of the flattened tokens
(``cu_seqlens``), padding runs too, grouped key/value heads as they are, no (seq, seq)
tensor and a 16-bit backward; padded rows are zeroed as above (the backward zeroes their
lse too). Making the layout reads the segments on the host, one wait for the device per
call, so this path is not taken while a CUDA graph is captured (the engine's step graph)
or torch.compile traces, nor where an id has two separated runs in one row (the mask
joins them, the varlen kernels cannot), nor where every sequence is one token: those take
the mask path.

The reference pair (``attention_fwd_reference``, ``attention_bwd_reference``) computes the
formulas above with matmuls in the statistics dtype: (batch, heads, seq, seq) scores, any
device. Nothing here builds an autograd graph, and nothing but the varlen layout waits for
the device.
"""

from __future__ import annotations

import math

import torch

from dataflow_kernels_torch import attention_varlen
from dataflow_kernels_torch._support import HALF_DTYPES, stats_dtype

_aten = torch.ops.aten
#: The efficient kernel pads each (batch, head) row of its lse to a multiple of this.
_EFFICIENT_LSE_ALIGN = 32
#: The efficient kernel reads its additive bias in rows whose length is a multiple of this
#: (as ``torch.nn.functional.scaled_dot_product_attention`` pads a mask before calling it).
_EFFICIENT_BIAS_ALIGN = 16
#: A masked backward (a mask or segments) of 16-bit inputs on CUDA runs the memory-efficient
#: kernel in float32 and casts the gradients back. Session 31 on an H100 (torch 2.11): its
#: bfloat16 and float16 backward with a per-row bias returned NaN in dq and dk for some
#: inputs (kernels/torch/tests/test_attention_segments.py, and 19 of 36 16-bit trials of a
#: script built like it), not reproduced in isolation from fresh memory; the float32 kernel
#: never did (all trials, every test). It costs the float32 copies of q, k, v, out and
#: dout; the unmasked and windowed paths keep their 16-bit kernels.
MASKED_BWD_DTYPE = torch.float32


def attention_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """-> (out like q, lse (batch, heads, seq) in the statistics dtype); see the module doc."""
    group = _check(q, k, v)
    window = _cut(window, causal, q)
    kernel = backend(q)
    if segments is not None:
        layout = _flash_varlen(kernel, q, mask, segments)
        if layout is not None:  # grouped heads as they are: flash takes them
            out, lse = attention_varlen.varlen_fwd(q, k, v, causal, scale, window, layout)
            return zero_padded(out, lse, segments < 0)
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    if segments is not None:
        keep, padded = segment_keep(q, causal, window, mask, segments)
        return zero_padded(*_masked_fwd(kernel, q, k, v, scale, keep), padded)
    if mask is not None:
        return _masked_fwd(kernel, q, k, v, scale, keep_of(q, causal, window, mask))
    if window is not None:
        return _windowed_fwd(kernel, q, k, v, scale, window)
    with torch.no_grad():
        if kernel == "flash":
            q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
            out, lse, *_ = _aten._scaled_dot_product_flash_attention(
                q, k, v, 0.0, causal, False, scale=scale
            )
            return out, lse.contiguous()
        if kernel == "efficient":
            q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
            out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
                q, k, v, None, True, 0.0, causal, scale=scale
            )
            return out, lse[:, :, : q.shape[2]].contiguous()
        if kernel == "cpu":
            out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, causal, scale=scale
            )
            return out, lse.contiguous()
    return attention_fwd_reference(q, k, v, causal=causal, scale=scale)


def _flash_varlen(
    kernel: str, q: torch.Tensor, mask: torch.Tensor | None, segments: torch.Tensor
) -> attention_varlen.VarlenLayout | None:
    """The varlen layout of ``segments`` where flash's varlen kernels run them (module
    doc), else None: checks the segments, and waits for the device where it reads them."""
    _check_segments(q, segments)
    if kernel != "flash" or mask is not None or torch.compiler.is_compiling():
        return None
    if q.is_cuda and torch.cuda.is_current_stream_capturing():  # no wait in a graph
        return None
    layout = attention_varlen.varlen_layout(segments)
    # sequences of one token each would take flash's swap of grouped query heads into
    # the query length, whose lse has another layout: the mask path runs them
    return layout if layout is not None and layout.max_len > 1 else None


def _windowed_fwd(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, window: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with a sliding window that cuts (module doc), heads already repeated."""
    with torch.no_grad():
        if kernel == "flash":
            q, k, v = (_last_dim_contiguous(t.transpose(1, 2)) for t in (q, k, v))
            seq = q.shape[1]
            out, lse, *_ = _aten._flash_attention_forward(
                q, k, v, None, None, seq, seq, 0.0, True, False,
                scale=scale, window_size_left=window - 1, window_size_right=0,
            )  # fmt: skip
            return out.transpose(1, 2), lse.contiguous()
        if kernel == "cpu":  # the window as a mask
            return _masked_fwd(kernel, q, k, v, scale, window_keep(q.shape[2], window, q.device))
    return attention_fwd_reference(q, k, v, causal=True, scale=scale, window=window)


def attention_bwd(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (dq, dk, dv) like q, k, v, from the forward's ``out`` and ``lse``."""
    group = _check(q, k, v)
    _check_saved(dout, q, out, lse)
    window = _cut(window, causal, q)
    kernel = backend(q)
    if segments is not None:
        layout = _flash_varlen(kernel, q, mask, segments)
        if layout is not None:  # grouped heads as they are: dk, dv come summed per group
            # the padded queries' dout and q zero (no gradient from them) and their lse
            # too (finite probabilities whatever the forward gave them)
            padded = segments < 0
            dout, q = _unpadded_rows(dout, padded), _unpadded_rows(q, padded)
            lse = lse.masked_fill(padded[:, None, :], 0.0)
            return attention_varlen.varlen_bwd(
                dout, q, k, v, out, lse, causal, scale, window, layout
            )
    dq, dk, dv = _bwd_repeated(
        kernel, dout, q, repeat_kv(k, group), repeat_kv(v, group), out, lse,
        causal, scale, window, mask, segments,
    )  # fmt: skip
    return dq, sum_groups(dk, group), sum_groups(dv, group)


def _bwd_repeated(
    kernel: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    causal: bool,
    scale: float | None,
    window: int | None,
    mask: torch.Tensor | None,
    segments: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``attention_bwd`` with one key/value head per query head (``repeat_kv``), the
    window already cut."""
    if segments is not None:
        keep, padded = segment_keep(q, causal, window, mask, segments)
        dout, q = _unpadded_rows(dout, padded), _unpadded_rows(q, padded)
        return _masked_bwd(kernel, dout, q, k, v, out, lse, scale, keep)
    if mask is not None:
        keep = keep_of(q, causal, window, mask)
        return _masked_bwd(kernel, dout, q, k, v, out, lse, scale, keep)
    if window is not None:
        return _windowed_bwd(kernel, dout, q, k, v, out, lse, scale, window)
    with torch.no_grad():
        if kernel == "flash":
            q, k, v, out, dout = (_last_dim_contiguous(t) for t in (q, k, v, out, dout))
            seq = q.shape[2]
            # Dense, no dropout: no cumulative sequence lengths (None is an undefined
            # tensor, which selects the dense kernel); the rng state is never read.
            rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)
            unused = torch.empty((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = _aten._scaled_dot_product_flash_attention_backward(
                dout, q, k, v, out, lse.float().contiguous(), None, None, seq, seq, 0.0,
                causal, rng_state, unused, scale=scale,
            )  # fmt: skip
            return dq, dk, dv
        if kernel == "efficient":
            q, k, v, out = (_last_dim_contiguous(t) for t in (q, k, v, out))
            seed = torch.empty((), dtype=torch.int64, device=q.device)  # unused: no dropout
            offset = torch.empty((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, None, out, _padded_lse(lse.float()), seed, offset, 0.0,
                [True, True, True, False], causal, scale=scale,
            )  # fmt: skip
            return dq, dk, dv
        if kernel == "cpu":
            return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse.to(stats_dtype(q.dtype)), 0.0, causal, scale=scale
            )
    return attention_bwd_reference(dout, q, k, v, out, lse, causal=causal, scale=scale)


def _windowed_bwd(
    kernel: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float | None,
    window: int,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward with a sliding window that cuts (module doc), one head per query head."""
    with torch.no_grad():
        if kernel == "flash":
            seq = q.shape[2]
            q, k, v, out, dout = (
                _last_dim_contiguous(t.transpose(1, 2)) for t in (q, k, v, out, dout)
            )
            rng_state = torch.empty(2, dtype=torch.uint64, device=q.device)  # no dropout
            unused = torch.empty((), dtype=torch.uint64, device=q.device)
            dq, dk, dv = _aten._flash_attention_backward(
                dout, q, k, v, out, lse.float().contiguous(), None, None, seq, seq, 0.0, True,
                rng_state, unused, scale=scale, window_size_left=window - 1,
                window_size_right=0,
            )  # fmt: skip
            return dq.transpose(1, 2), dk.transpose(1, 2), dv.transpose(1, 2)
        if kernel == "cpu":  # the window as a mask
            keep = window_keep(q.shape[2], window, q.device)
            return _masked_bwd(kernel, dout, q, k, v, out, lse, scale, keep)
    return attention_bwd_reference(dout, q, k, v, out, lse, causal=True, scale=scale, window=window)


def _masked_fwd(
    kernel: str, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: float | None, keep
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward with a mask (``keep``: the pairs kept, module doc), heads repeated."""
    with torch.no_grad():
        if kernel == "cpu":
            bias = keep_bias(keep, q.dtype)
            out, lse = _aten._scaled_dot_product_flash_attention_for_cpu(
                q, k, v, 0.0, False, attn_mask=bias, scale=scale
            )
            return out, lse.contiguous()
        if _efficient_takes_bias(kernel, q):
            q, k, v = (_last_dim_contiguous(t) for t in (q, k, v))
            bias = _efficient_bias(keep, q)
            out, lse, _, _ = _aten._scaled_dot_product_efficient_attention(
                q, k, v, bias, True, 0.0, False, scale=scale
            )
            return out, lse[:, :, : q.shape[2]].contiguous()
    return attention_fwd_reference(q, k, v, causal=False, scale=scale, mask=keep)


def _masked_bwd(
    kernel: str,
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    scale: float | None,
    keep: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward with a mask (``keep``, module doc), one head per query head."""
    dtype = q.dtype
    with torch.no_grad():
        if kernel == "cpu":
            return _aten._scaled_dot_product_flash_attention_for_cpu_backward(
                dout, q, k, v, out, lse.to(stats_dtype(q.dtype)), 0.0, False,
                attn_mask=keep_bias(keep, q.dtype), scale=scale,
            )  # fmt: skip
        if _efficient_takes_bias(kernel, q):
            # 16-bit inputs run the float32 kernel (MASKED_BWD_DTYPE), cast back after
            wide = MASKED_BWD_DTYPE if q.dtype in HALF_DTYPES else q.dtype
            dout, q, k, v, out = (_last_dim_contiguous(t.to(wide)) for t in (dout, q, k, v, out))
            seed = torch.zeros((), dtype=torch.int64, device=q.device)  # unused: no dropout
            offset = torch.zeros((), dtype=torch.int64, device=q.device)
            dq, dk, dv, _ = _aten._scaled_dot_product_efficient_attention_backward(
                dout, q, k, v, _efficient_bias(keep, q), out, _padded_lse(lse.float()), seed,
                offset, 0.0, [True, True, True, False], False, scale=scale,
            )  # fmt: skip
            return dq.to(dtype), dk.to(dtype), dv.to(dtype)
    return attention_bwd_reference(dout, q, k, v, out, lse, causal=False, scale=scale, mask=keep)


def _efficient_takes_bias(kernel: str, q: torch.Tensor) -> bool:
    """Whether the memory-efficient kernel runs a mask for q (module doc): the kernels
    ``backend`` picks on CUDA, within its head sizes."""
    return kernel in ("flash", "efficient") and q.shape[-1] <= 128


def _efficient_bias(keep: torch.Tensor, q: torch.Tensor) -> torch.Tensor:
    """``keep`` as the efficient kernel's additive bias: (batch, heads, seq, seq) of q's
    dtype, a view of one (seq, seq) tensor (or (batch, 1, seq, seq), one per sequence of
    the batch: segments) whose rows are padded to its alignment."""
    seq = keep.shape[-1]
    row = -(-seq // _EFFICIENT_BIAS_ALIGN) * _EFFICIENT_BIAS_ALIGN
    bias = torch.zeros(*keep.shape[:-1], row, dtype=q.dtype, device=q.device)
    bias[..., :seq].masked_fill_(~keep, -math.inf)
    return bias[..., :seq].expand(q.shape[0], q.shape[1], seq, seq)


def keep_of(q: torch.Tensor, causal: bool, window: int | None, mask: torch.Tensor) -> torch.Tensor:
    """The (seq, seq) pairs a query sees: ``mask``, and causal and inside ``window`` where
    those are given (``window`` as ``_cut`` left it)."""
    seq = q.shape[-2]
    if (
        not isinstance(mask, torch.Tensor)
        or mask.dtype != torch.bool
        or tuple(mask.shape) != (seq, seq)
        or mask.device != q.device
    ):
        shown = (
            f"{mask.dtype} {tuple(mask.shape)} on {mask.device}"
            if isinstance(mask, torch.Tensor)
            else type(mask).__name__
        )
        raise ValueError(
            f"attention: a mask is a ({seq}, {seq}) bool tensor on {q.device}, got {shown}"
        )
    if window is not None:
        return mask & window_keep(seq, window, q.device)
    if causal:
        return mask & torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril_()
    return mask


def segment_keep(
    q: torch.Tensor,
    causal: bool,
    window: int | None,
    mask: torch.Tensor | None,
    segments: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """(the (batch, 1, seq, seq) pairs a query sees, the (batch, seq) padded queries) of a
    segments tensor (module doc). The padding of a row is kept as one sequence of its own,
    so that every query, padded or not, sees a key (itself) and no kernel meets a row
    without one; the callers zero what the padded queries make."""
    _check_segments(q, segments)
    seq = q.shape[-2]
    keep = segments[:, :, None] == segments[:, None, :]
    if mask is not None:
        keep &= keep_of(q, causal, window, mask)
    elif window is not None:
        keep &= window_keep(seq, window, q.device)
    elif causal:
        keep &= torch.ones(seq, seq, dtype=torch.bool, device=q.device).tril_()
    return keep.unsqueeze(1), segments < 0


def _check_segments(q: torch.Tensor, segments: torch.Tensor) -> None:
    batch, seq = q.shape[0], q.shape[-2]
    if (
        not isinstance(segments, torch.Tensor)
        or segments.dtype not in (torch.int32, torch.int64)
        or tuple(segments.shape) != (batch, seq)
        or segments.device != q.device
    ):
        shown = (
            f"{segments.dtype} {tuple(segments.shape)} on {segments.device}"
            if isinstance(segments, torch.Tensor)
            else type(segments).__name__
        )
        raise ValueError(
            f"attention: segments are a ({batch}, {seq}) int32/int64 tensor of sequence ids "
            f"on {q.device}, got {shown}"
        )


def zero_padded(
    out: torch.Tensor, lse: torch.Tensor, padded: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``out`` and ``lse`` with the padded queries' rows zero (module doc)."""
    out = out.masked_fill(padded[:, None, :, None], 0.0)
    return out, lse.masked_fill(padded[:, None, :], 0.0).contiguous()


def _unpadded_rows(t: torch.Tensor, padded: torch.Tensor) -> torch.Tensor:
    """``t`` (batch, heads, seq, dim) with the padded queries' rows zero: a backward given
    zero ``dout`` and ``q`` there returns zero gradients from them, whatever their lse."""
    return t.masked_fill(padded[:, None, :, None], 0.0)


def _reference_keep(
    q: torch.Tensor,
    causal: bool,
    window: int | None,
    mask: torch.Tensor | None,
    segments: torch.Tensor | None,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """(the pairs kept, or None where causal and the window say it all; the padded
    queries, or None without segments)."""
    if segments is not None:
        return segment_keep(q, causal, window, mask, segments)
    return (None if mask is None else keep_of(q, causal, window, mask)), None


def keep_bias(keep: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """``keep`` as an additive mask of ``dtype``: 0 where a key is seen, -inf elsewhere."""
    bias = torch.zeros(keep.shape, dtype=dtype, device=keep.device)
    return bias.masked_fill_(~keep, -math.inf)


def attention_fwd_reference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward formulas with explicit (seq, seq) scores in the statistics dtype."""
    group = _check(q, k, v)
    window = _cut(window, causal, q)
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    compute = stats_dtype(q.dtype)
    keep, padded = _reference_keep(q, causal, window, mask, segments)
    with torch.no_grad():
        scores = _scores(q, k, causal, scale, compute, window, keep)
        lse = torch.logsumexp(scores, dim=-1)
        probs = scores.sub_(lse.unsqueeze(-1)).exp_()
        out = (probs @ v.to(compute)).to(q.dtype)
    return (out, lse) if padded is None else zero_padded(out, lse, padded)


def attention_bwd_reference(
    dout: torch.Tensor,
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    out: torch.Tensor,
    lse: torch.Tensor,
    *,
    causal: bool,
    scale: float | None = None,
    window: int | None = None,
    mask: torch.Tensor | None = None,
    segments: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The backward formulas: P from q, k and lse; dS = P * (dP - rowsum(dout * out))."""
    group = _check(q, k, v)
    _check_saved(dout, q, out, lse)
    window = _cut(window, causal, q)
    k, v = repeat_kv(k, group), repeat_kv(v, group)
    compute = stats_dtype(q.dtype)
    factor = _scale(q, scale)
    keep, padded = _reference_keep(q, causal, window, mask, segments)
    with torch.no_grad():
        scores = _scores(q, k, causal, scale, compute, window, keep)
        probs = scores.sub_(lse.to(compute).unsqueeze(-1)).exp_()
        if padded is not None:  # a padded query attends nothing: no gradient in or out
            probs.masked_fill_(padded[:, None, :, None], 0.0)
        dout_c = dout.to(compute)
        dv = probs.transpose(-2, -1) @ dout_c
        delta = (dout_c * out.to(compute)).sum(dim=-1, keepdim=True)
        d_scores = probs.mul_((dout_c @ v.to(compute).transpose(-2, -1)).sub_(delta))
        dq = (d_scores @ k.to(compute)).mul_(factor)
        dk = (d_scores.transpose(-2, -1) @ q.to(compute)).mul_(factor)
    return dq.to(q.dtype), sum_groups(dk, group).to(k.dtype), sum_groups(dv, group).to(v.dtype)


def backend(q: torch.Tensor) -> str:
    """Which kernel the fast pair runs for q: ``flash``, ``efficient``, ``cpu`` or
    ``reference`` (module doc)."""
    head_dim = q.shape[-1]
    if q.device.type == "cpu":
        return "cpu" if q.dtype in (*HALF_DTYPES, torch.float32, torch.float64) else "reference"
    if q.device.type != "cuda" or head_dim % 8:
        return "reference"
    if (
        q.dtype in HALF_DTYPES
        and head_dim <= 256
        and torch.cuda.get_device_capability(q.device) >= (8, 0)
        and torch.backends.cuda.is_flash_attention_available()
    ):
        return "flash"
    if q.dtype in (*HALF_DTYPES, torch.float32) and head_dim <= 128:
        return "efficient"
    return "reference"


def _scores(
    q: torch.Tensor,
    k: torch.Tensor,
    causal: bool,
    scale: float | None,
    compute: torch.dtype,
    window: int | None = None,
    keep: torch.Tensor | None = None,
) -> torch.Tensor:
    scores = (q.to(compute) @ k.to(compute).transpose(-2, -1)).mul_(_scale(q, scale))
    if keep is not None:  # causal and the window already in it
        scores.masked_fill_(~keep, -math.inf)
    elif window is not None:
        scores.masked_fill_(~window_keep(q.shape[-2], window, q.device), -math.inf)
    elif causal:
        seq = q.shape[-2]
        future = torch.ones(seq, seq, dtype=torch.bool, device=q.device).triu_(1)
        scores.masked_fill_(future, -math.inf)
    return scores


def window_keep(seq: int, window: int, device: torch.device) -> torch.Tensor:
    """(seq, seq) bool: True where query ``i`` sees key ``j`` (``i - window < j <= i``)."""
    distance = torch.arange(seq, device=device)[:, None] - torch.arange(seq, device=device)
    return (distance >= 0) & (distance < window)


def _cut(window: int | None, causal: bool, q: torch.Tensor) -> int | None:
    """The window where it cuts something (below the sequence length), else None; a window
    is causal and at least one token."""
    if window is None:
        return None
    if not causal or isinstance(window, bool) or not isinstance(window, int) or window < 1:
        raise ValueError(
            f"attention: a sliding window is a causal window of at least 1 token, got "
            f"window={window!r}, causal={causal}"
        )
    return window if window < q.shape[-2] else None


def _scale(q: torch.Tensor, scale: float | None) -> float:
    return 1.0 / math.sqrt(q.shape[-1]) if scale is None else scale


def _padded_lse(lse: torch.Tensor) -> torch.Tensor:
    """lse with its rows padded to the efficient kernel's alignment, as its forward left it:
    +inf past the last query (what the forward writes there, seen on the H100 in session
    31), so a query past the end has no probabilities."""
    seq = lse.shape[-1]
    padded_seq = -(-seq // _EFFICIENT_LSE_ALIGN) * _EFFICIENT_LSE_ALIGN
    if padded_seq == seq:
        return lse.contiguous()
    padded = lse.new_full((*lse.shape[:-1], padded_seq), math.inf)
    padded[..., :seq] = lse
    return padded


def _last_dim_contiguous(t: torch.Tensor) -> torch.Tensor:
    return t if t.stride(-1) == 1 else t.contiguous()


def repeat_kv(kv: torch.Tensor, group: int) -> torch.Tensor:
    """(batch, kv_heads, seq, dim) -> (batch, kv_heads * group, seq, dim), each head repeated
    for its ``group`` query heads (``kv`` itself when ``group`` is 1)."""
    return kv if group == 1 else kv.repeat_interleave(group, dim=1)


def sum_groups(d_kv: torch.Tensor, group: int) -> torch.Tensor:
    """The inverse of ``repeat_kv`` for gradients: each group of ``group`` heads summed."""
    if group == 1:
        return d_kv
    batch, heads, seq, head_dim = d_kv.shape
    return d_kv.view(batch, heads // group, group, seq, head_dim).sum(2)


def _check(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> int:
    """Validate q, k, v (module doc); -> query heads per key/value head."""
    if (
        q.dim() != 4
        or k.shape != v.shape
        or k.dim() != 4
        or (k.shape[0], k.shape[2], k.shape[3]) != (q.shape[0], q.shape[2], q.shape[3])
        or k.shape[1] == 0
        or q.shape[1] % k.shape[1]
    ):
        raise ValueError(
            "attention expects q (batch, heads, seq, head_dim) and k, v (batch, kv_heads, "
            f"seq, head_dim) with kv_heads dividing heads, got q {tuple(q.shape)}, k "
            f"{tuple(k.shape)}, v {tuple(v.shape)}"
        )
    if not (q.dtype == k.dtype == v.dtype) or not q.is_floating_point():
        raise ValueError(
            f"attention expects q, k, v of one float dtype, got {q.dtype}, {k.dtype}, {v.dtype}"
        )
    return q.shape[1] // k.shape[1]


def _check_saved(dout: torch.Tensor, q: torch.Tensor, out: torch.Tensor, lse: torch.Tensor) -> None:
    if dout.shape != q.shape or out.shape != q.shape:
        raise ValueError(
            f"attention_bwd expects dout and out shaped like q {tuple(q.shape)}, got dout "
            f"{tuple(dout.shape)}, out {tuple(out.shape)}"
        )
    if lse.shape != q.shape[:3]:
        raise ValueError(
            f"attention_bwd expects lse (batch, heads, seq) = {tuple(q.shape[:3])}, got "
            f"{tuple(lse.shape)}"
        )
