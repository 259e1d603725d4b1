"""The fused head of a causal LM: final norm, output projection and cross-entropy, with
their backward, over token chunks (``chunked_cross_entropy``: no tokens x vocab tensor
beyond one chunk; matmuls in the input dtype, the loss in float32).

The loss is the mean over scored tokens (targets other than -100; 0 when none is), and
every gradient is of that mean times ``env.grad_scale``. The count of scored tokens stays
on the device: nothing here waits for the GPU.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch

from dataflow_training.step.family import RowPieces

IGNORE_INDEX = -100

Tensors = Mapping[str, torch.Tensor]


def lm_head_loss(
    env: Any,
    params: Tensors,
    x: torch.Tensor,
    targets: torch.Tensor,
    *,
    norm: Any,
    projection: str,
    vocab: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor, dict[str, torch.Tensor]]:
    """-> (loss, dx, gradients of the norm's parameters and of ``projection``).
    ``vocab``: the real vocabulary where ``projection`` is stored with more rows (padded,
    ``decoder_math.padded_vocab``): the logits past it are left out of the softmax and
    their rows' gradient is zero."""
    ops = env.ops
    weight = params[projection]
    hidden, stats = norm.forward(ops, params, x)
    flat_targets = targets.reshape(-1)
    # only when asked: a kernel variant written before the keywords need not take them
    keywords = {"vocab_tiles": True} if env.head_vocab_tiles else {}
    if vocab is not None and vocab != weight.shape[0]:
        keywords["vocab"] = vocab
    scored = (flat_targets != IGNORE_INDEX).sum().clamp(min=1)
    into = env.head_grad_into
    if into is not None:  # added into the gradient object, divided by the count first
        keywords |= {"d_weight_into": into, "scale_by": 1.0 / scored.float()}
    loss_sum, d_hidden, d_weight = ops["chunked_cross_entropy"](
        hidden.reshape(-1, hidden.shape[-1]),
        weight.pieces if isinstance(weight, RowPieces) else weight,
        flat_targets,
        env.chunk_tokens,
        grad_scale=env.grad_scale,
        **keywords,
    )
    if into is None:
        d_hidden = d_hidden / scored
    d_hidden = d_hidden.to(hidden.dtype).view_as(hidden)
    dx, grads = norm.backward(ops, params, x, stats, d_hidden)
    if into is not None:  # the projection's gradient is in place already
        return (loss_sum / scored).to(torch.float32), dx, grads
    # in place: the kernel's d_weight is ours, and a divided copy would be one more
    # (vocab, dim) tensor of the task's workspace; float32 where the kernel summed it over
    # chunks, rounded once by the task into its gradient object (``store_grads``), as the
    # embedding's row sums are
    # (a table in row pieces, ``RowPieces``: one gradient per piece, each divided)
    if isinstance(d_weight, tuple):
        grads[projection] = tuple(d.div_(scored) for d in d_weight)
    else:
        grads[projection] = d_weight.div_(scored)
    return (loss_sum / scored).to(torch.float32), dx, grads
