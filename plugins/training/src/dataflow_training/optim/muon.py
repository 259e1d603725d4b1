"""Muon for the hidden matrices, AdamW for every other tensor, as Moonlight and Kimi K2
were trained.

Sources (the equations, not code): Keller Jordan, "Muon: An optimizer for hidden layers in
neural networks" (2024 blog post) for the momentum, the Nesterov form and the quintic
Newton-Schulz iteration with coefficients (a, b, c) = (3.4445, -4.7750, 2.0315) over a
gradient normalized to Frobenius norm 1 (transposed to be wide); Liu et al., "Muon is
Scalable for LLM Training" (Moonshot AI, 2025, the Moonlight report, eq. 4) for decoupled
weight decay and the update scale ``0.2 * sqrt(max(A, B))`` that gives an A x B matrix's
update the RMS of AdamW's, so one learning rate and one decay serve both halves.

For a hidden matrix W (2-D, in a block) with gradient G, step t:

- ``M = mu M + G``; the direction is ``G + mu M`` (Nesterov) or ``M``;
- ``O = NewtonSchulz5(direction)`` (``ns_steps`` iterations);
- ``W = W (1 - lr wd) - lr 0.2 sqrt(max(A, B)) O``.

Every other tensor (norms, biases, the embedding and the head, whose ``role`` is not
``block``) takes AdamW with ``adam_beta1``, ``adam_beta2``, ``eps``, its first moment in
``momentum`` and its second in ``exp_avg_sq`` (a hidden matrix keeps no ``exp_avg_sq``:
its field is empty). The matrices of one optimizer task that share a shape are
orthogonalized together as one batch (``torch.baddbmm``), so a block's projections take a
few batched matmuls per iteration rather than one chain per matrix. ``lr`` and ``step``
may be device tensors (``scalars``): nothing is read back to the host.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from dataflow_training.optim.scalars import as_float

#: the quintic's coefficients, from Jordan's post
NS_COEFFICIENTS = (3.4445, -4.7750, 2.0315)


def hidden_matrix(shape: tuple[int, ...], role: str) -> bool:
    """Whether Muon updates a parameter of this shape and role (a block's 2-D weight)."""
    return len(shape) == 2 and role == "block"


def second_moment_shape(shape: tuple[int, ...], role: str) -> tuple[int, ...]:
    """``exp_avg_sq``: AdamW's second moment, nothing for a hidden matrix."""
    return (0,) if hidden_matrix(shape, role) else tuple(shape)


def newton_schulz(g: torch.Tensor, steps: int) -> torch.Tensor:
    """The quintic Newton-Schulz iteration over a batch ``(n, A, B)`` in float32: each
    matrix normalized to Frobenius norm 1 (+1e-7), made wide, then ``X = aX + (bS + cS^2)X``
    with ``S = X X^T``; returns ``(n, A, B)``, each near ``U V^T`` of its SVD."""
    a, b, c = NS_COEFFICIENTS
    x = g.float()
    tall = x.size(-2) > x.size(-1)
    if tall:
        x = x.mT
    x = x / (x.flatten(1).norm(dim=1).view(-1, 1, 1) + 1e-7)
    for _ in range(steps):
        s = x @ x.mT
        poly = torch.baddbmm(s, s, s, beta=b, alpha=c)
        x = torch.baddbmm(x, poly, x, beta=a)
    return x.mT if tall else x


def muon_update(
    ops: Mapping[str, Any],
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    states: Mapping[str, Sequence[torch.Tensor]],
    *,
    step: int,
    policy: Mapping[str, Any],
    weight_decay: float,
    roles: Sequence[str] = (),
) -> None:
    lr, mu = as_float(policy["lr"]), policy["momentum"]
    roles = list(roles) or ["block"] * len(params)
    by_shape: dict[tuple[int, ...], list[int]] = {}
    rest = []
    for i, (p, role) in enumerate(zip(params, roles, strict=True)):
        if hidden_matrix(tuple(p.shape), role):
            by_shape.setdefault(tuple(p.shape), []).append(i)
        else:
            rest.append(i)
    momenta = states["momentum"]
    for shape, chosen in by_shape.items():
        directions = []
        for i in chosen:
            m32, g32 = momenta[i].float(), grads[i].float()
            m32.mul_(mu).add_(g32)
            momenta[i].copy_(m32)
            directions.append(g32.add(m32, alpha=mu) if policy["nesterov"] else m32)
        orthogonal = newton_schulz(torch.stack(directions), int(policy["ns_steps"]))
        scale = 0.2 * math.sqrt(max(shape))
        for i, o in zip(chosen, orthogonal, strict=True):
            w = params[i].float()
            w.mul_(1 - lr * weight_decay).sub_(o * (lr * scale))
            params[i].copy_(w)
    if rest:
        _adamw(params, grads, momenta, states["exp_avg_sq"], rest, step, policy, weight_decay)


def _adamw(
    params: Sequence[torch.Tensor],
    grads: Sequence[torch.Tensor],
    exp_avgs: Sequence[torch.Tensor],
    exp_avg_sqs: Sequence[torch.Tensor],
    chosen: list[int],
    step: int,
    policy: Mapping[str, Any],
    weight_decay: float,
) -> None:
    """AdamW (decoupled decay, bias-corrected moments) in float32 on ``chosen``."""
    lr, t = as_float(policy["lr"]), as_float(step)
    beta1, beta2, eps = policy["adam_beta1"], policy["adam_beta2"], policy["eps"]
    correction1, correction2 = 1 - beta1**t, 1 - beta2**t
    for i in chosen:
        w, g = params[i].float(), grads[i].float()
        m, v = exp_avgs[i].float(), exp_avg_sqs[i].float()
        m.lerp_(g, 1 - beta1)
        v.mul_(beta2).addcmul_(g, g, value=1 - beta2)
        w.mul_(1 - lr * weight_decay)
        denom = (v / correction2).sqrt_().add_(eps)
        w.sub_(m / denom * (lr / correction1))
        for stored, value in ((params[i], w), (exp_avgs[i], m), (exp_avg_sqs[i], v)):
            stored.copy_(value)
