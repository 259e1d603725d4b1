"""Cross-entropy of an output projection, token chunk by token chunk, with its gradients.

``chunked_cross_entropy(hidden, weight, targets, chunk_tokens, *, grad_scale=1.0)``
computes ``logits = hidden @ weight.T`` for ``chunk_tokens`` rows at a time and returns the
summed loss with ``grad_scale`` times d loss / d hidden and d loss / d weight, so no
(tokens, vocab) tensor ever exists. Per chunk:

    loss_i      = logsumexp(logits_i) - logits_i[t_i]
    d_logits_i  = grad_scale * (softmax(logits_i) - onehot(t_i))   (zero where t_i == -100)
    d_hidden_i  = d_logits_i @ weight
    d_weight   += d_logits_i.T @ hidden_i

``grad_scale`` scales the gradients only (a caller's 1 / number-of-scored-tokens rides in
the pass that forms d_logits); the loss is the plain sum. Nothing here synchronizes with
the device (no ``.item()``), so on CUDA it only enqueues work.

``vocab=V`` (fewer than weight's rows) says the vocabulary is the first V rows: the
weight is stored padded for the tensor cores (a model's ``vocab_multiple``), the logits
of the rows past V are left out of the softmax and the loss, and d_weight is zero in
those rows (exactly: their d_logits are zero). The logits matmul still runs over every
stored row, which is the point of the padding.

``vocab_tiles=True`` (with more than one chunk) trades compute for memory: d_weight is
not summed over the chunks in a float32 (vocab, dim) accumulator (2.1 GB for Llama 3's
128,256 x 4,096 head) but made one vocabulary tile at a time over every token. The first
pass keeps each token's log-sum-exp; then per tile the logits are computed again
(``hidden @ weight[tile].T``, one more logits matmul: a third more head compute),
turned into ``grad_scale * (softmax - onehot)`` with that log-sum-exp, and one matmul
over all tokens writes the tile's rows of d_weight (float32 accumulation inside it, one
rounding). A tile has about as many logits as one token chunk, so the head's workspace is
one chunk's logits and the 16-bit d_weight.

Two variants, one formula:

- ``chunked_cross_entropy`` (fast). hidden and weight both bfloat16 (or both float16): the
  logits matmul reads the 16-bit operands and writes float32 logits (``torch.mm(...,
  out_dtype=torch.float32)``, float32 accumulation in cuBLAS; on devices without that
  kernel, CPU, the operands are upcast); max, exp, sum, loss and ``softmax - onehot`` run
  in float32 in place on that one chunk buffer; one pass scales it and casts it to the
  input dtype, and the two backward matmuls read that 16-bit d_logits. d_weight
  accumulates across chunks in float32 and is returned as that float32 accumulator; a
  single chunk writes it directly in weight's dtype. Where the device has
  ``addmm(..., out_dtype=torch.float32)`` (CUDA) each chunk's product is added into the
  accumulator inside the matmul, as the Triton variant does; elsewhere it comes out of
  its own float32 matmul into a (vocab, dim) buffer beside the accumulator and is added.
  Memory beyond the outputs: per chunk the (chunk, vocab) float32 logits and a (chunk,
  vocab) 16-bit d_logits; without that kernel and with more than one chunk, that product
  buffer. Any other dtypes: the reference.
- ``chunked_cross_entropy_reference``: every matmul and the softmax in float32 (float64
  when hidden or weight is float64), from a float32 copy of weight; the truth the fast
  variant is tested against, and the fast variant's path for float32/float64 inputs.

The loss is a 0-d float32 tensor (float64 for float64 inputs); d_hidden is like hidden;
d_weight has weight's shape and dtype, except that a 16-bit d_weight summed over several
chunks comes back as its float32 accumulator: the caller rounds it once, into its own
gradient (the head's task adds it into its 16-bit gradient object). Cast here, it would
be one more (vocab, dim) 16-bit tensor beside the accumulator at the end of the call, the
call's largest moment (2 GB for Qwen 3.5's 248,320 x 4,096 head), and a second rounding
where the gradient accumulates over rounds.

``weight`` may also be a sequence of row pieces (equal dim, dtype and device), the
vocabulary table stored in pieces (``TrainConfig.vocab_pieces``): the same math over
their rows in order, with nothing joined. Each chunk's logits are one (chunk, vocab)
buffer whose columns the pieces' matmuls write; d_hidden sums the pieces' products in
float32 and is rounded once; d_weight comes back as a tuple, one gradient per piece
(each as above: float32 where summed over several chunks).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

from dataflow_kernels_torch._support import HALF_DTYPES, has_kernel

#: Targets equal to this are left out of the loss and get no gradient.
IGNORE_INDEX = -100


def chunked_cross_entropy(
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
    over several chunks; a tuple, one per piece, for a weight in row pieces); 16-bit
    matmuls with float32 softmax when hidden and weight share a 16-bit dtype (module
    doc). ``d_weight_into`` / ``scale_by``: see ``into_and_scale``."""
    pieces = weight_pieces(weight)
    into = into_and_scale(pieces, d_weight_into, scale_by, vocab_tiles)
    if not (hidden.dtype == pieces[0].dtype and hidden.dtype in HALF_DTYPES):
        return chunked_cross_entropy_reference(
            hidden, weight, targets, chunk_tokens, grad_scale=grad_scale, vocab=vocab,
            d_weight_into=d_weight_into, scale_by=scale_by,
        )  # fmt: skip
    vocab = _check(hidden, pieces, targets, chunk_tokens, grad_scale, vocab)
    tokens = hidden.shape[0]
    starts = range(0, tokens, chunk_tokens)
    tiled = vocab_tiles and len(starts) > 1
    columns = piece_columns(pieces)
    with torch.no_grad():
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        # each piece's: one chunk's 16-bit product, the float32 accumulator, or the tiles'
        d_weight: list[torch.Tensor | None] = [None] * len(pieces)
        product = None  # float32 (piece rows, dim), only with several chunks
        lse = torch.empty(tokens, 1, dtype=torch.float32, device=hidden.device) if tiled else None
        for index, start in enumerate(starts):
            chunk = hidden[start : start + chunk_tokens]
            valid, target = _valid_targets(targets[start : start + chunk_tokens])
            logits = _logits_float32(chunk, pieces, columns)  # (rows, vocab): the one chunk
            if vocab < columns[-1].stop:  # the padded rows: out of the softmax
                logits[:, vocab:] = -torch.inf
            chunk_loss, row_sum, row_lse = _softmax_minus_onehot_(logits, valid, target)
            loss_sum += chunk_loss
            # d_logits = grad_scale * (softmax - onehot), scaled and cast in one pass.
            d_logits = torch.empty(logits.shape, dtype=hidden.dtype, device=hidden.device)
            torch.mul(logits, _row_scale(valid, row_sum, grad_scale, scale_by), out=d_logits)
            del logits
            _d_hidden_into(d_logits, pieces, columns, d_hidden[start : start + chunk_tokens])
            if tiled:  # d_weight after the last chunk, tile by tile
                lse[start : start + chunk_tokens] = row_lse
                del d_logits
                continue
            for j, cols in enumerate(columns):
                part = d_logits[:, cols]
                if into is not None:  # added into the caller's 16-bit gradient, in the matmul
                    torch.addmm(into[j], part.T, chunk, out=into[j])
                elif len(starts) == 1:  # one chunk: the 16-bit matmul writes d_weight directly
                    d_weight[j] = part.T @ chunk
                elif index == 0:
                    d_weight[j] = _mm_float32(part.T, chunk)
                elif has_kernel("aten::addmm.dtype", chunk.device.type):
                    # in place, inside the matmul: no (vocab, dim) product beside
                    torch.addmm(d_weight[j], part.T, chunk, torch.float32, out=d_weight[j])
                else:
                    product = _mm_float32(part.T, chunk, out=_reuse(product, part.shape[1]))
                    d_weight[j].add_(product)
            del d_logits, part  # the view too: else this chunk's d_logits outlives it
        del product
        if tiled:
            tile = vocab_tile_rows(tokens, columns[-1].stop, chunk_tokens)
            d_weight = [
                _d_weight_by_tiles(
                    hidden, piece, targets, lse, grad_scale, vocab, tile, first=cols.start
                )
                for piece, cols in zip(pieces, columns, strict=True)
            ]
        if into is not None:
            return loss_sum, d_hidden, as_given(weight, into)
        return loss_sum, d_hidden, as_given(weight, d_weight)


def into_and_scale(
    pieces: Sequence[torch.Tensor],
    d_weight_into: torch.Tensor | Sequence[torch.Tensor] | None,
    scale_by: torch.Tensor | None,
    vocab_tiles: bool,
) -> tuple[torch.Tensor, ...] | None:
    """Checks the two keywords of a head that adds its weight's gradient into its own
    16-bit gradient object chunk by chunk (``TrainConfig.head_accumulate="gradient"``):
    no (vocab, dim) float32 sum exists, each chunk's product rounded once into the target.

    ``d_weight_into``: tensors shaped and typed like weight's pieces (a tensor for one),
    each chunk's product added into them (the call returns them as d_weight).
    ``scale_by``: a 0-d float32 tensor on hidden's device that every gradient (d_logits,
    hence d_hidden and d_weight) is also multiplied by: a scale the host does not know,
    such as the round's 1 / scored tokens, which a CUDA graph cannot take as a number.
    Not with ``vocab_tiles`` (which makes d_weight tile by tile). -> the targets as a
    tuple, or None."""
    if scale_by is not None and (scale_by.dim() != 0 or scale_by.dtype != torch.float32):
        raise ValueError(f"scale_by must be a 0-d float32 tensor, got {scale_by!r}")
    if d_weight_into is None:
        return None
    into = weight_pieces(d_weight_into)
    if vocab_tiles:
        raise ValueError("d_weight_into: not with vocab_tiles (the tiles make d_weight whole)")
    if len(into) != len(pieces) or any(
        t.shape != p.shape or t.dtype != p.dtype or t.device != p.device
        for t, p in zip(into, pieces, strict=True)
    ):
        raise ValueError(
            "d_weight_into must be shaped, typed and placed as weight's pieces: got "
            f"{[(tuple(t.shape), t.dtype) for t in into]} for "
            f"{[(tuple(p.shape), p.dtype) for p in pieces]}"
        )
    return into


def weight_pieces(weight: torch.Tensor | Sequence[torch.Tensor]) -> tuple[torch.Tensor, ...]:
    """``weight`` as its row pieces (a tensor is one), checked to agree in their other
    dimensions, dtype and device."""
    if isinstance(weight, torch.Tensor):
        return (weight,)
    pieces = tuple(weight)
    if not pieces or not all(isinstance(p, torch.Tensor) for p in pieces):
        raise ValueError("weight must be a tensor or a non-empty sequence of row pieces")
    first = pieces[0]
    for piece in pieces[1:]:
        if (piece.shape[1:], piece.dtype, piece.device) != (
            first.shape[1:],
            first.dtype,
            first.device,
        ):
            raise ValueError(
                "weight's row pieces must agree in their other dimensions, dtype and device, "
                f"got {tuple(first.shape)} {first.dtype} {first.device} and "
                f"{tuple(piece.shape)} {piece.dtype} {piece.device}"
            )
    return pieces


def piece_columns(pieces: Sequence[torch.Tensor]) -> list[slice]:
    """Each piece's rows of the whole table (its columns of the logits)."""
    out, start = [], 0
    for piece in pieces:
        out.append(slice(start, start + piece.shape[0]))
        start += piece.shape[0]
    return out


def as_given(weight: object, d_pieces: Sequence[torch.Tensor]) -> object:
    """The pieces' gradients as ``weight`` came: one tensor, or a tuple of them."""
    return d_pieces[0] if isinstance(weight, torch.Tensor) else tuple(d_pieces)


def _reuse(buffer: torch.Tensor | None, rows: int) -> torch.Tensor | None:
    """``buffer``'s first ``rows`` rows (a product buffer kept across pieces), or None."""
    return None if buffer is None or buffer.shape[0] < rows else buffer[:rows]


def _logits_float32(
    chunk: torch.Tensor, pieces: Sequence[torch.Tensor], columns: list[slice]
) -> torch.Tensor:
    """``chunk @ weight.T`` in float32, each piece's matmul writing its columns."""
    if len(pieces) == 1:
        return _mm_float32(chunk, pieces[0].T)
    logits = torch.empty(chunk.shape[0], columns[-1].stop, dtype=torch.float32, device=chunk.device)
    for piece, cols in zip(pieces, columns, strict=True):
        _mm_float32(chunk, piece.T, out=logits[:, cols])
    return logits


def _d_hidden_into(
    d_logits: torch.Tensor, pieces: Sequence[torch.Tensor], columns: list[slice], out: torch.Tensor
) -> None:
    """``out = d_logits @ weight``: one matmul for one piece; for several, the pieces'
    products summed in float32 and rounded once into ``out``."""
    if len(pieces) == 1:
        torch.mm(d_logits, pieces[0], out=out)
        return
    total = None
    for piece, cols in zip(pieces, columns, strict=True):
        if total is None:
            total = _mm_float32(d_logits[:, cols], piece)
        else:
            total.add_(_mm_float32(d_logits[:, cols], piece))
    out.copy_(total)


def vocab_tile_rows(tokens: int, vocab: int, chunk_tokens: int, multiple: int = 1) -> int:
    """The rows of a vocabulary tile (``vocab_tiles``): about as many logits over every
    token as one chunk has over the whole vocabulary, a multiple of ``multiple`` rows."""
    rows = max(1, chunk_tokens * vocab // tokens)
    return max(multiple, rows // multiple * multiple)


def _d_weight_by_tiles(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    lse: torch.Tensor,
    grad_scale: float,
    vocab: int,
    tile: int,
    first: int = 0,
) -> torch.Tensor:
    """d_weight one vocabulary tile of ``tile`` rows at a time, over every token, from
    each token's log-sum-exp ``lse`` (tokens, 1) (the module doc's ``vocab_tiles``); the
    rows from ``vocab`` on (padding) zero. ``weight`` is the table's rows from ``first``
    on (a piece of it)."""
    valid, target = _valid_targets(targets)
    scale = torch.where(valid, grad_scale, 0.0)  # (tokens, 1): 0 on ignored rows
    d_weight = torch.empty_like(weight)
    for start in range(0, weight.shape[0], tile):
        rows = weight[start : start + tile]
        logits = _mm_float32(hidden, rows.T)  # (tokens, tile) float32, again
        logits.sub_(lse).exp_()  # softmax over the whole vocabulary, this tile's columns
        row = first + start  # the tile's first row of the whole table
        if row + rows.shape[0] > vocab:  # padded rows: no probability, no gradient
            logits[:, max(0, vocab - row) :] = 0.0
        local = target - row
        inside = (local >= 0) & (local < rows.shape[0])
        logits.scatter_add_(1, local.clamp(0, rows.shape[0] - 1), -inside.to(logits.dtype))
        d_logits = torch.empty(logits.shape, dtype=hidden.dtype, device=hidden.device)
        torch.mul(logits, scale, out=d_logits)
        del logits
        torch.mm(d_logits.T, hidden, out=d_weight[start : start + tile])
        del d_logits
    return d_weight


def chunked_cross_entropy_reference(
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
    """-> (loss_sum, d_hidden like hidden, d_weight like weight), all math in float32
    (float64 when hidden or weight is float64); see the module doc. ``vocab_tiles`` is
    taken and changes nothing: the truth sums d_weight in a whole compute-dtype table.
    With ``vocab`` the truth is that of the first ``vocab`` rows alone (the rest of
    d_weight zero). A weight in row pieces is joined first (the truth), its d_weight
    split into the pieces' again. ``scale_by`` multiplies every gradient; with
    ``d_weight_into`` (``into_and_scale``) the truth's d_weight, in weight's dtype, is
    added into those tensors (the fast variants add a chunk at a time)."""
    pieces = weight_pieces(weight)
    into = into_and_scale(pieces, d_weight_into, scale_by, False)
    if into is not None:
        loss, d_hidden, d_weight = chunked_cross_entropy_reference(
            hidden, weight, targets, chunk_tokens, grad_scale=grad_scale, vocab=vocab,
            scale_by=scale_by,
        )  # fmt: skip
        for target, part in zip(into, weight_pieces(d_weight), strict=True):
            target.add_(part)
        return loss, d_hidden, as_given(weight, into)
    if len(pieces) > 1:
        loss, d_hidden, d_whole = chunked_cross_entropy_reference(
            hidden, torch.cat(pieces), targets, chunk_tokens, grad_scale=grad_scale, vocab=vocab,
            scale_by=scale_by,
        )  # fmt: skip
        return loss, d_hidden, tuple(d_whole[cols] for cols in piece_columns(pieces))
    weight = pieces[0]
    vocab = _check(hidden, weight, targets, chunk_tokens, grad_scale, vocab)
    compute = torch.float64 if torch.float64 in (hidden.dtype, weight.dtype) else torch.float32
    tokens = hidden.shape[0]
    with torch.no_grad():
        # the same tensor when weight is in compute already and has no padded rows
        weight_c = weight[:vocab].to(compute)
        loss_sum = torch.zeros((), dtype=compute, device=hidden.device)
        d_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        d_weight = torch.zeros(weight.shape, dtype=compute, device=weight.device)
        d_real = d_weight[:vocab]
        for start in range(0, tokens, chunk_tokens):
            stop = min(start + chunk_tokens, tokens)
            chunk = hidden[start:stop].to(compute)
            valid, target = _valid_targets(targets[start:stop])
            logits = chunk @ weight_c.T  # (rows, vocab): the only chunk-sized buffer
            chunk_loss, row_sum, _ = _softmax_minus_onehot_(logits, valid, target)
            loss_sum += chunk_loss
            logits.mul_(_row_scale(valid, row_sum, grad_scale, scale_by))
            if d_hidden.dtype == compute:
                torch.mm(logits, weight_c, out=d_hidden[start:stop])
            else:
                d_hidden[start:stop] = logits @ weight_c
            d_real.addmm_(logits.T, chunk)
            del logits, chunk
        return loss_sum, d_hidden, d_weight.to(weight.dtype)


def _valid_targets(target: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(valid rows, targets with ignored rows pointed at column 0), shaped (rows, 1)."""
    valid = (target != IGNORE_INDEX).unsqueeze(1)
    return valid, torch.where(valid, target.unsqueeze(1), 0)


def _softmax_minus_onehot_(
    logits: torch.Tensor, valid: torch.Tensor, target: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Turns ``logits`` in place into ``row_sum * (softmax - onehot)`` with
    ``row_sum = sum(exp(logits - row_max))``; returns (the chunk's loss sum, row_sum, each
    row's log-sum-exp), so one scaling pass by ``_row_scale`` finishes d_logits."""
    target_logit = logits.gather(1, target)
    row_max = logits.amax(dim=1, keepdim=True)
    logits.sub_(row_max).exp_()
    row_sum = logits.sum(dim=1, keepdim=True)
    lse = row_max + row_sum.log()
    row_loss = lse - target_logit
    # exp - row_sum * onehot: one index per row, so the scatter has no colliding adds.
    logits.scatter_add_(1, target, -row_sum)
    return torch.where(valid, row_loss, 0.0).sum(), row_sum, lse


def _row_scale(
    valid: torch.Tensor, row_sum: torch.Tensor, grad_scale: float, scale_by=None
) -> torch.Tensor:
    """(rows, 1): grad_scale / row_sum (times ``scale_by``) on valid rows, 0 on ignored ones."""
    scale = torch.where(valid, grad_scale / row_sum, 0.0)
    return scale if scale_by is None else scale.mul_(scale_by.to(scale.dtype))


def _mm_float32(a: torch.Tensor, b: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``a @ b`` of two 16-bit matrices as float32: cuBLAS writes float32 directly where
    this build has ``mm.dtype`` for the device; elsewhere the operands are upcast."""
    if has_kernel("aten::mm.dtype", a.device.type):
        if out is None:
            return torch.mm(a, b, out_dtype=torch.float32)
        return torch.mm(a, b, out_dtype=torch.float32, out=out)
    return torch.mm(a.float(), b.float(), out=out)


def _check(
    hidden: torch.Tensor,
    weight: torch.Tensor | Sequence[torch.Tensor],
    targets: torch.Tensor,
    chunk_tokens: int,
    grad_scale: float,
    vocab: int | None = None,
) -> int:
    """Shape, dtype and chunk checks on the host (no device synchronization); returns the
    vocabulary, ``vocab`` or every row of weight (of its pieces together)."""
    pieces = weight_pieces(weight)
    rows = sum(p.shape[0] for p in pieces)
    weight = pieces[0]
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
    if isinstance(grad_scale, bool) or not isinstance(grad_scale, int | float):
        raise ValueError(f"grad_scale must be a float, got {grad_scale!r}")
    if hidden.dim() != 2 or weight.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(
            f"expected hidden (tokens, dim) and weight (vocab, dim), got hidden "
            f"{tuple(hidden.shape)} and weight {tuple(weight.shape)}"
        )
    if targets.shape != (hidden.shape[0],):
        raise ValueError(
            f"expected targets ({hidden.shape[0]},) for hidden {tuple(hidden.shape)}, got "
            f"{tuple(targets.shape)}"
        )
    if targets.dtype != torch.int64:
        raise ValueError(f"targets must be int64, got {targets.dtype}")
    if not (hidden.is_floating_point() and weight.is_floating_point()):
        raise ValueError(
            f"hidden and weight must be floating point, got {hidden.dtype} and {weight.dtype}"
        )
    if vocab is None:
        return rows
    if isinstance(vocab, bool) or not isinstance(vocab, int) or not 0 < vocab <= rows:
        raise ValueError(f"vocab must be an int from 1 to weight's {rows} rows, got {vocab!r}")
    return vocab
