"""AdamW with block-wise 8-bit moments (``--optimizer-states int8``): each moment is kept
as one-byte codes plus a float32 scale per block (``blockwise8``), 2.03 bytes a parameter
for both instead of 8 (float32) or 4 (bfloat16).

The update dequantizes both moments to float32 working copies, runs the plain AdamW
update over them (the ``adamw_multi`` op, the same fused kernel as ``--optimizer-states
fp32``), and quantizes the new moments back into the packed state in place, a piece of
the group at a time (``PIECE_ELEMENTS``). So the weights move exactly as float32 AdamW would from the moments as stored; what
int8 changes is only what the moments keep between steps. ``lr`` and ``step`` may be
device tensors (``scalars``): nothing is read back."""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from typing import Any

import torch

from dataflow_training.optim.blockwise8 import dequantize, quantize_
from dataflow_training.optim.int8_blocks import BLOCK

#: elements updated together at most: the float32 working copies of both moments, the
#: update's and the quantizer's temporaries (about a dozen float32 tensors of a piece)
#: stay within 200 MiB beside the arena however large the parameter group (float32
#: copies of a whole group's moments would be 4.2 GB for Llama 3's 525M-element embedding)
PIECE_ELEMENTS = 1 << 22

#: one piece of one tensor, flat: (param, grad, m codes, m scales, v codes, v scales)
Piece = tuple[torch.Tensor, ...]


def adamw_int8_update(
    ops: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Mapping[str, Sequence[torch.Tensor]],
    *,
    step: Any,
    policy: Mapping[str, Any],
    weight_decay: float,
    roles: Sequence[str] = (),
) -> None:
    """AdamW over the lists, the moments kept in ``states``' codes and scales: pieces of
    at most ``PIECE_ELEMENTS`` elements (small tensors together, a large one cut at block
    boundaries), each dequantized, updated by one ``adamw_multi`` call and quantized back."""
    hyper = {k: policy[k] for k in ("lr", "beta1", "beta2", "eps")}
    lists = (params, grads, *(states[f] for f in ("exp_avg", "exp_avg_scale")))
    lists += tuple(states[f] for f in ("exp_avg_sq", "exp_avg_sq_scale"))
    for batch in _batches(_pieces(*lists)):
        exp_avgs = [dequantize(piece[2], piece[3]) for piece in batch]
        exp_avg_sqs = [dequantize(piece[4], piece[5]) for piece in batch]
        ops["adamw_multi"](
            [piece[0] for piece in batch],
            [piece[1] for piece in batch],
            exp_avgs,
            exp_avg_sqs,
            step=step,
            weight_decay=weight_decay,
            **hyper,
        )
        for piece, m, v in zip(batch, exp_avgs, exp_avg_sqs, strict=True):
            quantize_(m, piece[2], piece[3])
            quantize_(v, piece[4], piece[5])


def _pieces(*lists: Sequence[torch.Tensor]) -> Iterator[Piece]:
    """Every tensor's flat pieces of at most ``PIECE_ELEMENTS`` elements, each starting
    on a block, with the scales of its blocks (views: updated in place)."""
    for p, g, mc, ms, vc, vs in zip(*lists, strict=True):
        flat = [t.view(-1) for t in (p, g, mc, vc)]
        numel = flat[0].numel()
        for start in range(0, numel, PIECE_ELEMENTS):
            end = min(numel, start + PIECE_ELEMENTS)
            blocks = slice(start // BLOCK, -(-end // BLOCK))
            pf, gf, mf, vf = (t[start:end] for t in flat)
            yield pf, gf, mf, ms[blocks], vf, vs[blocks]


def _batches(pieces: Iterator[Piece]) -> Iterator[list[Piece]]:
    """Consecutive pieces together up to ``PIECE_ELEMENTS`` elements (one update call)."""
    batch: list[Piece] = []
    size = 0
    for piece in pieces:
        if batch and size + piece[0].numel() > PIECE_ELEMENTS:
            yield batch
            batch, size = [], 0
        batch.append(piece)
        size += piece[0].numel()
    if batch:
        yield batch
