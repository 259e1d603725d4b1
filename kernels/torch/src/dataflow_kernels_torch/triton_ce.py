"""The chunked cross-entropy on CUDA with the vocabulary padded for the tensor cores and
the softmax fused into one Triton kernel.

``chunked_cross_entropy_triton`` computes what ``cross_entropy.chunked_cross_entropy``
documents, for 16-bit hidden and weight on CUDA (anything else goes to that function):

- The vocabulary is padded for the tensor cores. A vocabulary like GPT-2's 50,257 gives
  matrices whose leading dimension no 16-byte vector divides, and cuBLAS then falls back
  to old, slow kernels (measured on an H200: the 8192 x 768 x 50257 logits product took
  6.6 ms, an sm75 cutlass kernel; the padded backward product 1.4 ms instead of 4.3 ms).
  A model stores its head padded (``vocab_multiple``, 64 by default) and says its real
  vocabulary with ``vocab=``: a weight whose rows are a multiple of 64 is used as it is.
  Any other weight is copied once per call into a buffer whose row count is a multiple
  of 128 (extra rows zero), as before the models padded.
- Per chunk, one 16-bit matmul writes the logits (bf16 output, float32 accumulation, as
  under autocast); one kernel pass per row reads them twice (an online max and sum of
  exp in float32, then ``grad_scale * (softmax - onehot)``) and writes d_logits over them
  in place, zero in the padding columns (from ``vocab`` on: stored or copied padding
  alike, so those rows of d_weight are exactly zero) and on ignored rows, with the row's
  loss; the two backward matmuls read that d_logits. d_weight accumulates across chunks
  in float32 and is returned so (a view of the accumulator's real rows: the caller rounds
  it into its gradient, as ``cross_entropy``'s module doc says).

Memory beyond the outputs: the padded weight copy (none for a weight stored padded),
one chunk's (chunk, vocab) 16-bit logits, and with several chunks one float32 (vocab,
dim) accumulator, which each chunk's product adds into in place (a product beside it
measured 2 GiB more workspace for Llama 3's 128K x 4096 head), and returned as it is (a
16-bit copy made of it at the end was the call's peak: 6.4 GB of workspace measured for
Qwen 3.5's 248,320 x 4,096 head on the H100, 4.1 GB of it the accumulator).

With ``vocab_tiles`` (``cross_entropy``'s module doc) there is no accumulator: the first
kernel also keeps each row's log-sum-exp, and per vocabulary tile (a multiple of 128
rows of the padded weight, about one chunk's logits over every token) a 16-bit matmul
makes the tile's logits again, a second kernel turns them into d_logits in place, and a
matmul over every token writes the tile's rows of d_weight.

A weight in row pieces (``cross_entropy``'s module doc) runs the same loop: each piece's
logits matmul writes its columns of the chunk's one 16-bit buffer, the row kernel runs
over the whole row, d_hidden sums the pieces' products in float32, each piece keeps its
own accumulator (or its tiles). Pieces whose rows are not all multiples of 64 go to the
torch variant.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import triton
import triton.language as tl

from dataflow_kernels_torch import cross_entropy
from dataflow_kernels_torch._support import HALF_DTYPES

_PAD_ROWS = 128
#: a weight whose rows are a multiple of this is used as stored (a model's padded
#: vocabulary: ``vocab_multiple``'s default; nanoGPT's and llm.c's 50,304 for GPT-2)
_ALIGNED_ROWS = 64
_BLOCK = 4096


@triton.jit
def _softmax_ce_kernel(
    logits_ptr, stride, targets_ptr, loss_ptr, lse_ptr, vocab, padded, scale, scale_ptr,
    ignore, SCALE_BY: tl.constexpr, BLOCK: tl.constexpr,
):  # fmt: skip
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    target = tl.load(targets_ptr + row)
    running_max = -float("inf")
    running_sum = 0.0
    for start in range(0, vocab, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        x = tl.load(base + cols, mask=cols < vocab, other=-float("inf")).to(tl.float32)
        new_max = tl.maximum(running_max, tl.max(x, axis=0))
        running_sum = running_sum * tl.exp(running_max - new_max) + tl.sum(
            tl.exp(x - new_max), axis=0
        )
        running_max = new_max
    lse = running_max + tl.log(running_sum)
    tl.store(lse_ptr + row, lse)
    valid = target != ignore
    safe_target = tl.where(valid, target, 0)
    picked = tl.load(base + safe_target).to(tl.float32)
    tl.store(loss_ptr + row, tl.where(valid, lse - picked, 0.0))
    factor = scale
    if SCALE_BY:  # a device scale too (``scale_by``: a graph replays it with new values)
        factor = scale * tl.load(scale_ptr).to(tl.float32)
    row_scale = tl.where(valid, factor, 0.0)
    for start in range(0, padded, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < padded
        x = tl.load(base + cols, mask=in_row, other=0.0).to(tl.float32)
        p = tl.where(cols < vocab, tl.exp(x - lse), 0.0)
        p = tl.where(cols == safe_target, p - 1.0, p)
        tl.store(base + cols, (p * row_scale).to(logits_ptr.dtype.element_ty), mask=in_row)


@triton.jit
def _tile_grad_kernel(
    logits_ptr, stride, targets_ptr, lse_ptr, first, vocab, columns, scale, ignore,
    BLOCK: tl.constexpr,
):  # fmt: skip
    """One row of a vocabulary tile's logits (columns ``first`` on) turned in place into
    ``scale * (softmax - onehot)`` from the row's log-sum-exp; zero past ``vocab``."""
    row = tl.program_id(0).to(tl.int64)
    base = logits_ptr + row * stride
    target = tl.load(targets_ptr + row)
    lse = tl.load(lse_ptr + row)
    row_scale = tl.where(target != ignore, scale, 0.0)
    local = target - first
    for start in range(0, columns, BLOCK):
        cols = start + tl.arange(0, BLOCK)
        in_row = cols < columns
        x = tl.load(base + cols, mask=in_row, other=0.0).to(tl.float32)
        p = tl.where(first + cols < vocab, tl.exp(x - lse), 0.0)
        p = tl.where(cols == local, p - 1.0, p)
        tl.store(base + cols, (p * row_scale).to(logits_ptr.dtype.element_ty), mask=in_row)


def chunked_cross_entropy_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor | Sequence[torch.Tensor],
    targets: torch.Tensor,
    chunk_tokens: int,
    *,
    grad_scale: float = 1.0,
    vocab_tiles: bool = False,
    vocab: int | None = None,
    d_weight_into: torch.Tensor | Sequence[torch.Tensor] | None = None,
    scale_by: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | tuple[torch.Tensor, ...]]:
    """-> (loss_sum, d_hidden like hidden, d_weight: weight's shape, float32 when summed
    over several chunks; a tuple, one per piece, for a weight in row pieces); see the
    module doc. ``d_weight_into`` / ``scale_by``: ``cross_entropy.into_and_scale``."""
    pieces = cross_entropy.weight_pieces(weight)
    into = cross_entropy.into_and_scale(pieces, d_weight_into, scale_by, vocab_tiles)
    one = len(pieces) == 1
    if not (
        hidden.device.type == "cuda"
        and hidden.dtype == pieces[0].dtype
        and hidden.dtype in HALF_DTYPES
        and hidden.is_contiguous()
        and (one or all(p.shape[0] % _ALIGNED_ROWS == 0 for p in pieces))
    ):
        return cross_entropy.chunked_cross_entropy(
            hidden,
            weight,
            targets,
            chunk_tokens,
            grad_scale=grad_scale,
            vocab_tiles=vocab_tiles,
            vocab=vocab,
            d_weight_into=d_weight_into,
            scale_by=scale_by,
        )
    vocab = cross_entropy._check(hidden, pieces, targets, chunk_tokens, grad_scale, vocab)
    stored, dim = sum(p.shape[0] for p in pieces), pieces[0].shape[1]
    tokens = hidden.shape[0]
    starts = range(0, tokens, chunk_tokens)
    with torch.no_grad():
        if one and stored % _ALIGNED_ROWS:
            # one copy kernel: zeroing the whole buffer first wrote it twice
            padded = -(-stored // _PAD_ROWS) * _PAD_ROWS
            pieces = (torch.cat((pieces[0], pieces[0].new_zeros(padded - stored, dim))),)
        columns = cross_entropy.piece_columns(pieces)
        padded = columns[-1].stop
        targets = targets.reshape(-1).contiguous()
        losses = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        lse = torch.empty(tokens, dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty_like(hidden)
        tiled = vocab_tiles and len(starts) > 1
        # each piece's: one chunk's 16-bit product, or its float32 accumulator
        d_weight: list[torch.Tensor | None] = [None] * len(pieces)
        for index, start in enumerate(starts):
            chunk = hidden[start : start + chunk_tokens]
            rows = chunk.shape[0]
            logits = _logits(chunk, pieces, columns)  # (rows, padded), 16-bit
            _softmax_ce_kernel[(rows,)](
                logits, logits.stride(0), targets[start : start + rows],
                losses[start : start + rows], lse[start : start + rows], vocab, padded,
                float(grad_scale), losses if scale_by is None else scale_by,
                cross_entropy.IGNORE_INDEX, SCALE_BY=scale_by is not None, BLOCK=_BLOCK,
                num_warps=8,
            )  # fmt: skip
            _d_hidden_into(logits, pieces, columns, d_hidden[start : start + rows])
            if tiled:  # d_weight after the last chunk, tile by tile
                del logits
                continue
            for j, cols in enumerate(columns):
                part = logits[:, cols]
                if into is not None:  # added into the caller's 16-bit gradient, in the matmul
                    target = into[j]
                    torch.addmm(target, part[:, : target.shape[0]].T, chunk, out=target)
                elif len(starts) == 1:
                    d_weight[j] = part.T @ chunk
                elif index == 0:
                    d_weight[j] = torch.mm(part.T, chunk, out_dtype=torch.float32)
                else:  # accumulate in place: no second (vocab, dim) float32 product
                    torch.addmm(d_weight[j], part.T, chunk, torch.float32, out=d_weight[j])
            del logits, part  # the view too: else this chunk's logits outlive it
        if tiled:
            d_weight = [
                _d_weight_by_tiles(
                    hidden,
                    piece,
                    targets,
                    lse,
                    vocab,
                    chunk_tokens,
                    grad_scale,
                    cols.start,
                    padded,
                )  # fmt: skip
                for piece, cols in zip(pieces, columns, strict=True)
            ]
        if into is not None:
            return losses.sum(), d_hidden, cross_entropy.as_given(weight, into)
        # several chunks: each float32 accumulator as it is; one piece: its stored rows
        if one:
            return losses.sum(), d_hidden, d_weight[0][:stored]
        return losses.sum(), d_hidden, tuple(d_weight)


def _logits(
    chunk: torch.Tensor, pieces: tuple[torch.Tensor, ...], columns: list[slice]
) -> torch.Tensor:
    """``chunk @ weight.T`` in 16 bits, each piece's matmul writing its columns."""
    if len(pieces) == 1:
        return torch.mm(chunk, pieces[0].T)
    logits = torch.empty(chunk.shape[0], columns[-1].stop, dtype=chunk.dtype, device=chunk.device)
    for piece, cols in zip(pieces, columns, strict=True):
        torch.mm(chunk, piece.T, out=logits[:, cols])
    return logits


def _d_hidden_into(
    logits: torch.Tensor, pieces: tuple[torch.Tensor, ...], columns: list[slice], out: torch.Tensor
) -> None:
    """``out = d_logits @ weight``: one matmul for one piece; for several, the pieces'
    products summed in float32 and rounded once into ``out``."""
    if len(pieces) == 1:
        torch.mm(logits, pieces[0], out=out)
        return
    total = torch.mm(logits[:, columns[0]], pieces[0], out_dtype=torch.float32)
    for piece, cols in zip(pieces[1:], columns[1:], strict=True):
        torch.addmm(total, logits[:, cols], piece, torch.float32, out=total)
    out.copy_(total)


def _d_weight_by_tiles(
    hidden: torch.Tensor,
    weight_p: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    vocab: int,
    chunk_tokens: int,
    grad_scale: float,
    offset: int = 0,
    table_rows: int | None = None,
) -> torch.Tensor:
    """The padded weight's gradient one vocabulary tile at a time over every token, from
    each token's log-sum-exp ``lse`` (module doc). ``weight_p`` is the table's rows from
    ``offset`` on (a piece of a table of ``table_rows``), or all of it."""
    tokens, padded = hidden.shape[0], weight_p.shape[0]
    d_weight_p = torch.empty_like(weight_p)
    whole = padded if table_rows is None else table_rows
    tile = cross_entropy.vocab_tile_rows(tokens, whole, chunk_tokens, _PAD_ROWS)
    for first in range(0, padded, tile):
        rows = weight_p[first : first + tile]
        logits = torch.mm(hidden, rows.T)  # (tokens, tile), 16-bit, again
        _tile_grad_kernel[(tokens,)](
            logits, logits.stride(0), targets, lse, offset + first, vocab, rows.shape[0],
            float(grad_scale), cross_entropy.IGNORE_INDEX, BLOCK=_BLOCK, num_warps=8,
        )  # fmt: skip
        torch.mm(logits.T, hidden, out=d_weight_p[first : first + tile])
        del logits
    return d_weight_p
