"""How the weights after an AdamW step are compared, in every dtype.

The step level (``verify.step_checks``) runs each step of the engine and of the float64
reference from one state: the weights and AdamW moments the engine's step starts from.
AdamW's update of an entry is ``lr * u(g)``, ``u(g) = m_hat / (sqrt(v_hat) + eps)`` with
``m = b1 m0 + (1 - b1) g`` and ``v = b2 v0 + (1 - b2) g^2`` from the shared moments ``m0``,
``v0`` (weight decay moves both runs alike). At the first step (``m0 = v0 = 0``) that is
``g / (|g| + eps)``: about ``sign(g)``, whatever the gradient's size. Where ``|g|`` is as
small as the difference between two correct computations of it (engine and reference sum
in another order, or round to another dtype) the update is noise: a sign flip moves the
entry by ``2 lr`` the other way, in fp32 as in bf16. For any two gradients ``a`` (engine)
and ``b`` (reference) at the first step::

    |u(a) - u(b)| <= min(2, 2 |a - b| / (|b| + eps))

(same signs: ``|a - b| eps / ((|a| + eps)(|b| + eps))``; opposite signs: each term is at
most ``|a - b| / (|b| + eps)``). Each entry is allowed exactly what the two gradients make
the update differ by, ``adam_update_gap`` (computed, so the first-step bound above holds
and later steps need no assumption), and the check is the relative error of what that
does not explain::

    rel = || max(0, |w - w_ref| - lr |u(a) - u(b)|) || / || w_ref ||  <=  the step tolerance

Entries with a clear gradient get an allowance near zero and are held to the plain
relative tolerance; the gradients themselves are checked apart (``grad ... (step s)``), so
a wrong gradient cannot hide behind its own allowance, and a wrong update (its lr, its
bias correction) is not explained by any. docs/correctness_compare.md explains it with the
numbers of gpt2_124m.
"""

from __future__ import annotations

import math

import attrs
import torch


@attrs.frozen
class WeightError:
    """``rel``: relative error left after the allowance; ``max_abs``: largest difference;
    ``sign_flips``: entries whose first-step gradients have opposite signs."""

    max_abs: float
    rel: float
    sign_flips: int


def adam_update_gap(
    grad: torch.Tensor,
    ref_grad: torch.Tensor,
    exp_avg: torch.Tensor,
    exp_avg_sq: torch.Tensor,
    *,
    step: int,
    lr: float,
    betas: tuple[float, float],
    eps: float,
) -> torch.Tensor:
    """Per entry, how much farther AdamW's ``step``-th update (1-based) moves a weight with
    gradient ``grad`` than with ``ref_grad``, both from the moments ``exp_avg`` and
    ``exp_avg_sq``: ``lr * |u(grad) - u(ref_grad)|`` with ``u(g) = m_hat / (sqrt(v_hat) +
    eps)``, in float64 (weight decay moves both alike). Exact, not a bound: the allowance
    of one step from one state (``step_checks``); at the first step, moments zero, it is
    ``lr * |f(a) - f(b)|`` of the module docstring."""
    b1, b2 = betas
    m0, v0 = exp_avg.detach().double().cpu(), exp_avg_sq.detach().double().cpu()

    def update(g: torch.Tensor) -> torch.Tensor:
        g = g.detach().double().cpu()
        m = b1 * m0 + (1 - b1) * g
        v = b2 * v0 + (1 - b2) * g * g
        return (m / (1 - b1**step)) / ((v / (1 - b2**step)).sqrt() + eps)

    return lr * (update(grad) - update(ref_grad)).abs()


def weight_error(
    weight: torch.Tensor, ref_weight: torch.Tensor, allowance: torch.Tensor, flips: int = 0
) -> WeightError:
    """``weight`` against ``ref_weight`` with each entry allowed ``allowance``: the relative
    norm of what the allowance does not explain (module docstring)."""
    out, ref = weight.detach().double().cpu(), ref_weight.detach().double().cpu()
    if not out.shape == ref.shape == allowance.shape:
        return WeightError(math.inf, math.inf, flips)
    diff = (out - ref).abs()
    excess = torch.clamp(diff - allowance.double().cpu(), min=0.0)
    scale = ref.norm().item()
    rel = excess.norm().item() / scale if scale > 0 else excess.norm().item()
    return WeightError(diff.max().item() if diff.numel() else 0.0, rel, flips)


def sign_flips(grad: torch.Tensor, ref_grad: torch.Tensor) -> int:
    """Entries whose two gradients have opposite signs."""
    a, b = grad.detach().double().cpu(), ref_grad.detach().double().cpu()
    return int(((a * b) < 0).sum().item()) if a.shape == b.shape else 0
