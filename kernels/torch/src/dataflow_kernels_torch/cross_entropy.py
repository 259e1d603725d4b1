"""Cross-entropy of an output projection, token chunk by token chunk, with its gradients.

``chunked_cross_entropy(hidden, weight, targets, chunk_tokens)`` computes
``logits = hidden @ weight.T`` for ``chunk_tokens`` rows at a time and returns the summed
loss with d loss / d hidden and d loss / d weight, so no (tokens, vocab) tensor ever
exists. Per chunk, in float32:

    loss_i      = logsumexp(logits_i) - logits_i[t_i]
    d_logits_i  = softmax(logits_i) - onehot(t_i)       (zero where t_i == -100)
    d_hidden_i  = d_logits_i @ weight
    d_weight   += d_logits_i.T @ hidden_i

The chunk's logits are the one chunk-sized buffer: max, exp, normalization and the
one-hot subtraction are done in place on it. Memory beyond the outputs: a float32 copy of
``weight`` when it is not float32 already, the float32 ``d_weight`` accumulator, and per
chunk the (chunk, vocab) logits plus two (chunk, dim) float32 temporaries. Nothing here
synchronizes with the device (no ``.item()``), so on CUDA it only enqueues work.
"""

from __future__ import annotations

import torch

#: Targets equal to this are left out of the loss and get no gradient.
IGNORE_INDEX = -100


def chunked_cross_entropy(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """-> (loss_sum: 0-d float32, d_hidden: like hidden, d_weight: like weight).

    hidden (tokens, dim), weight (vocab, dim), targets int64 (tokens,), each in
    [0, vocab) or -100 (ignored). Runs without autograd: the gradients are computed here.
    """
    _check(hidden, weight, targets, chunk_tokens)
    tokens = hidden.shape[0]
    with torch.no_grad():
        weight32 = weight.float()  # the same tensor when weight is float32 already
        loss_sum = torch.zeros((), dtype=torch.float32, device=hidden.device)
        d_hidden = torch.empty_like(hidden, memory_format=torch.contiguous_format)
        d_weight = torch.zeros(weight.shape, dtype=torch.float32, device=weight.device)
        for start in range(0, tokens, chunk_tokens):
            stop = min(start + chunk_tokens, tokens)
            chunk = hidden[start:stop].float()
            target = targets[start:stop]
            valid = target != IGNORE_INDEX
            index = torch.where(valid, target, 0).unsqueeze(1)  # ignored rows look at column 0
            logits = chunk @ weight32.T  # (rows, vocab): the only chunk-sized buffer
            target_logit = logits.gather(1, index).squeeze(1)
            row_max = logits.amax(dim=1, keepdim=True)
            logits.sub_(row_max).exp_()
            row_sum = logits.sum(dim=1, keepdim=True)
            logits.div_(row_sum)  # softmax
            row_loss = (row_max + row_sum.log()).squeeze(1) - target_logit
            loss_sum += torch.where(valid, row_loss, 0.0).sum()
            # softmax - onehot; one index per row, so the scatter has no colliding adds.
            logits.scatter_add_(1, index, -valid.to(torch.float32).unsqueeze(1))
            logits.mul_(valid.unsqueeze(1))  # ignored rows: no gradient
            if d_hidden.dtype == torch.float32:
                torch.mm(logits, weight32, out=d_hidden[start:stop])
            else:
                d_hidden[start:stop] = logits @ weight32
            d_weight.addmm_(logits.T, chunk)
            del logits, chunk
        return loss_sum, d_hidden, d_weight.to(weight.dtype)


def _check(
    hidden: torch.Tensor, weight: torch.Tensor, targets: torch.Tensor, chunk_tokens: int
) -> None:
    """Shape, dtype and chunk checks on the host (no device synchronization)."""
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be a positive int, got {chunk_tokens!r}")
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
