"""The weight rule of the step level: Adam's first steps move entries with near-zero (or
near-eps) gradients by noise, up to 2 lr; only what that explains may differ (checked with
torch.optim.AdamW)."""

from __future__ import annotations

import math

import pytest
import torch
from dataflow_training.tolerances import adam_weight_error

LR, EPS = 1e-3, 1e-8


def _adamw(weight: torch.Tensor, grads: list[torch.Tensor]) -> torch.Tensor:
    """``weight`` after one torch.optim.AdamW step per gradient (float64)."""
    param = torch.nn.Parameter(weight.clone().double())
    optimizer = torch.optim.AdamW([param], lr=LR, betas=(0.9, 0.95), eps=EPS, weight_decay=0.1)
    for grad in grads:
        param.grad = grad.clone().double()
        optimizer.step()
    return param.detach()


def _case(steps: int, flip: int = 10, seed: int = 0):
    g = torch.Generator().manual_seed(seed)
    weight = 0.02 * torch.randn(1000, generator=g, dtype=torch.float64)
    ref_grads = [torch.randn(1000, generator=g, dtype=torch.float64) for _ in range(steps)]
    ref_grads[0][:flip] = 1e-7 * torch.rand(flip, generator=g, dtype=torch.float64)
    ref_grads[0][flip : 2 * flip] = 1e-8 * torch.randn(flip, generator=g, dtype=torch.float64)
    noise = 1e-9 * torch.randn(1000, generator=g, dtype=torch.float64)
    grads = [ref_grads[0] + noise, *(r + noise for r in ref_grads[1:])]
    grads[0][:flip] = -ref_grads[0][:flip]  # near-zero entries with the other sign
    return weight, grads, ref_grads


@pytest.mark.parametrize("steps", [1, 2, 3])
def test_sign_flips_of_near_zero_gradients_pass(steps: int) -> None:
    weight, grads, ref_grads = _case(steps)
    out, ref = _adamw(weight, grads), _adamw(weight, ref_grads)
    whole = (out - ref).norm().item() / ref.norm().item()
    assert whole > 1e-4  # the plain relative rule would fail this correct run
    error = adam_weight_error(out, ref, grads[0], ref_grads[0], lr=LR, eps=EPS, steps=steps)
    assert error.rel <= (1e-12 if steps == 1 else 1e-4)  # the first step's bound is exact
    assert error.sign_flips >= 10
    assert error.max_abs <= 2 * LR * steps


def test_a_wrong_entry_with_a_clear_gradient_fails() -> None:
    weight, grads, ref_grads = _case(1)
    out, ref = _adamw(weight, grads), _adamw(weight, ref_grads)
    out[500] += 0.5 * LR  # an update gone wrong where the gradient is far from zero
    error = adam_weight_error(out, ref, grads[0], ref_grads[0], lr=LR, eps=EPS, steps=1)
    assert error.rel > 1e-4


def test_a_flipped_entry_that_moved_too_far_fails() -> None:
    weight, grads, ref_grads = _case(1)
    out, ref = _adamw(weight, grads), _adamw(weight, ref_grads)
    out[3] += 2 * LR  # on top of the flip's own 2 lr: more than Adam's steps can explain
    error = adam_weight_error(out, ref, grads[0], ref_grads[0], lr=LR, eps=EPS, steps=1)
    assert error.rel > 1e-4


def test_identical_gradients_allow_nothing() -> None:
    weight, _, ref_grads = _case(1)
    ref = _adamw(weight, ref_grads)
    moved = ref.clone()
    moved[0] += 1e-6
    error = adam_weight_error(moved, ref, ref_grads[0], ref_grads[0], lr=LR, eps=EPS, steps=1)
    assert error.sign_flips == 0 and error.rel == pytest.approx(1e-6 / ref.norm().item())


def test_shapes_that_differ_fail() -> None:
    zeros = torch.zeros
    error = adam_weight_error(zeros(3), zeros(4), zeros(3), zeros(4), lr=LR, eps=EPS, steps=1)
    assert error.rel == math.inf
