"""How weights after the first AdamW steps are compared, in every dtype.

Adam's first update of an entry is ``lr * g / (|g| + eps)``: about ``lr * sign(g)``,
whatever the gradient's size. Where ``|g|`` is as small as the difference between two
correct computations of it (engine and reference sum in another order, or round to
another dtype) the update is noise: a sign flip moves the entry by ``2 lr`` the other
way, in fp32 as in bf16, and later steps do not undo it. For ``f(g) = g / (|g| + eps)``
and any two gradients ``a`` (engine) and ``b`` (reference)::

    |f(a) - f(b)| <= min(2, 2 |a - b| / (|b| + eps))

(same signs: ``|a - b| eps / ((|a| + eps)(|b| + eps))``; opposite signs: each term is at
most ``|a - b| / (|b| + eps)``). So each entry is allowed

    allowance = lr * steps * min(2, 2 |a - b| / (|b| + eps))

from the first step's gradients (exact for the first step; for later steps it assumes an
entry's sensitivity does not grow, which holds once its gradients are clear of the
noise), and the check is the relative error of what the allowance does not explain::

    rel = || max(0, |w - w_ref| - allowance) || / || w_ref ||  <=  the step tolerance

Entries with a clear gradient get an allowance near zero and are held to the plain
relative tolerance; the gradients themselves are checked apart (``grad ... (step 0)``), so
a wrong gradient cannot hide behind its own allowance. docs/correctness_compare.md
explains it with the numbers of gpt2_124m.
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


def adam_weight_error(
    weight: torch.Tensor,
    ref_weight: torch.Tensor,
    grad: torch.Tensor,
    ref_grad: torch.Tensor,
    *,
    lr: float,
    eps: float,
    steps: int,
) -> WeightError:
    """One weight after ``steps`` AdamW steps against the reference, by the rule above;
    ``grad`` and ``ref_grad`` are the engine's and the reference's first-step gradients."""
    out, ref = weight.detach().double().cpu(), ref_weight.detach().double().cpu()
    a, b = grad.detach().double().cpu(), ref_grad.detach().double().cpu()
    if not out.shape == ref.shape == a.shape == b.shape:
        return WeightError(math.inf, math.inf, 0)
    diff = (out - ref).abs()
    sensitivity = torch.clamp(2 * (a - b).abs() / (b.abs() + eps), max=2.0)
    excess = torch.clamp(diff - lr * steps * sensitivity, min=0.0)
    scale = ref.norm().item()
    rel = excess.norm().item() / scale if scale > 0 else excess.norm().item()
    flips = int(((a * b) < 0).sum().item())
    return WeightError(diff.max().item() if diff.numel() else 0.0, rel, flips)
