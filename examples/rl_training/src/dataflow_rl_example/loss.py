"""The policy losses: GRPO's and PPO's clipped-ratio objectives, group-normalized
advantages, and the KL to a frozen reference.

For a completion token ``t`` of row ``i``, with ``ratio = exp(logp - behaviour_logp)``::

    pg_t = -min(ratio * A_i, clip(ratio, 1 - eps, 1 + eps) * A_i)
    kl_t = exp(ref_logp - logp) - (ref_logp - logp) - 1          (k3, >= 0)
    l_t  = pg_t + kl_coef * kl_t

- ``grpo``: ``A_i = (r_i - mean_g) / (std_g + 1e-4)`` over row ``i``'s group ``g`` (std with
  Bessel's correction, as GRPO's paper and TRL take it); the loss is the mean over rows of
  each row's mean over its completion tokens.
- ``ppo``: ``A_i = r_i - mean_g`` (the group mean as the baseline, no critic); the loss is
  the mean over every completion token of the batch.
"""

from __future__ import annotations

from typing import Any

LOSSES = ("grpo", "ppo")
STD_EPS = 1e-4


def advantages(rewards: Any, groups: Any, loss: str) -> Any:
    """One advantage per row (float32), normalized within each row's group.

    From a (rows, rows) same-group matrix rather than ``unique`` and an index: no value is
    read on the host and no shape depends on the data, so a CUDA graph can capture it."""
    import torch

    rewards = rewards.to(torch.float32)
    same = (groups[:, None] == groups[None, :]).to(torch.float32)
    count = same.sum(-1)
    mean = same @ rewards / count
    centred = rewards - mean
    if loss == "ppo":
        return centred
    std = (same @ centred**2 / (count - 1).clamp(min=1)).sqrt()
    return centred / (std + STD_EPS)


def token_weights(scored: Any, loss: str) -> Any:
    """Each token's weight in the batch loss (zero where it is not scored)."""
    scored = scored.float()
    if loss == "ppo":
        return scored / scored.sum().clamp(min=1)
    per_row = scored.sum(-1, keepdim=True)
    rows = (per_row > 0).sum().clamp(min=1)
    return scored / per_row.clamp(min=1) / rows


def token_loss(
    logp: Any, behaviour: Any, advantage: Any, *, clip_eps: float, ref: Any, kl_coef: Any
) -> tuple[Any, Any, Any]:
    """(per-token loss, ratio, k3 KL or None) of tokens with these log-probs."""
    import torch

    ratio = torch.exp(logp - behaviour)
    clipped = ratio.clamp(1 - clip_eps, 1 + clip_eps)
    loss = -torch.minimum(ratio * advantage, clipped * advantage)
    if ref is None:
        return loss, ratio, None
    gap = ref - logp
    kl = torch.exp(gap) - gap - 1
    return loss + kl_coef * kl, ratio, kl
