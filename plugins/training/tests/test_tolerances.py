"""The weight rule of the step level: one AdamW step from a given state moves entries with
near-zero (or near-eps) gradients by noise, up to 2 lr at the first step; only what the two
gradients make the update differ by may differ (checked with torch.optim.AdamW)."""

from __future__ import annotations

import math

import pytest
import torch
from dataflow_training.check.tolerances import adam_update_gap, sign_flips, weight_error

LR, EPS, BETAS = 1e-3, 1e-8, (0.9, 0.95)


def _state(weight: torch.Tensor, before: list[torch.Tensor]):
    """The weight and moments after one torch.optim.AdamW step per gradient of ``before``."""
    param = torch.nn.Parameter(weight.clone().double())
    optimizer = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1)
    for grad in before:
        param.grad = grad.clone().double()
        optimizer.step()
    if not before:
        return param.detach(), torch.zeros_like(weight), torch.zeros_like(weight)
    state = optimizer.state[param]
    return param.detach(), state["exp_avg"].clone(), state["exp_avg_sq"].clone()


def _step(weight, exp_avg, exp_avg_sq, done: int, grad) -> torch.Tensor:
    """``weight`` after AdamW's step ``done + 1`` from the given moments (float64)."""
    param = torch.nn.Parameter(weight.clone().double())
    optimizer = torch.optim.AdamW([param], lr=LR, betas=BETAS, eps=EPS, weight_decay=0.1)
    optimizer.state[param] = {
        "step": torch.tensor(float(done), dtype=torch.float64),
        "exp_avg": exp_avg.clone().double(),
        "exp_avg_sq": exp_avg_sq.clone().double(),
    }
    param.grad = grad.clone().double()
    optimizer.step()
    return param.detach()


def _case(done: int, flip: int = 10, seed: int = 0):
    """A state after ``done`` steps, then one step's reference gradient with near-zero
    entries and the engine's: the same plus noise, the first ``flip`` of the other sign."""
    g = torch.Generator().manual_seed(seed)
    weight = 0.02 * torch.randn(1000, generator=g, dtype=torch.float64)
    before = [torch.randn(1000, generator=g, dtype=torch.float64) for _ in range(done)]
    ref_grad = torch.randn(1000, generator=g, dtype=torch.float64)
    ref_grad[:flip] = 1e-7 * torch.rand(flip, generator=g, dtype=torch.float64)
    ref_grad[flip : 2 * flip] = 1e-8 * torch.randn(flip, generator=g, dtype=torch.float64)
    grad = ref_grad + 1e-9 * torch.randn(1000, generator=g, dtype=torch.float64)
    grad[:flip] = -ref_grad[:flip]  # near-zero entries with the other sign
    return (*_state(weight, before), grad, ref_grad)


def _gap(exp_avg, exp_avg_sq, done, grad, ref_grad):
    return adam_update_gap(
        grad, ref_grad, exp_avg, exp_avg_sq, step=done + 1, lr=LR, betas=BETAS, eps=EPS
    )


@pytest.mark.parametrize("done", [0, 1, 2])
def test_sign_flips_of_near_zero_gradients_pass(done: int) -> None:
    """From any state the gap is the update's difference exactly: nothing is left over."""
    weight, m, v, grad, ref_grad = _case(done)
    out, ref = _step(weight, m, v, done, grad), _step(weight, m, v, done, ref_grad)
    if done == 0:  # the plain relative rule would fail this correct first step
        assert (out - ref).norm().item() / ref.norm().item() > 1e-4
    error = weight_error(out, ref, _gap(m, v, done, grad, ref_grad), sign_flips(grad, ref_grad))
    assert error.rel <= 1e-12
    assert error.sign_flips == 10
    assert error.max_abs <= 2 * LR * (1 + 1e-9)


def test_the_first_step_gap_is_within_the_sign_bound() -> None:
    """At the first step (moments zero) ``|u(a) - u(b)| <= min(2, 2 |a - b| / (|b| + eps))``
    (tolerances.py): a flip near zero is allowed its 2 lr, a clear gradient almost nothing."""
    _, m, v, grad, ref_grad = _case(0)
    gap = _gap(m, v, 0, grad, ref_grad)
    bound = LR * torch.clamp(2 * (grad - ref_grad).abs() / (ref_grad.abs() + EPS), max=2.0)
    assert (gap <= bound * (1 + 1e-9)).all()
    assert gap[:10].min() > LR and gap[100:].max() < 1e-6 * LR  # flips near eps: over lr


@pytest.mark.parametrize("done", [0, 2])
def test_a_wrong_entry_with_a_clear_gradient_fails(done: int) -> None:
    weight, m, v, grad, ref_grad = _case(done)
    out, ref = _step(weight, m, v, done, grad), _step(weight, m, v, done, ref_grad)
    out[500] += 0.5 * LR  # an update gone wrong where the gradient is far from zero
    error = weight_error(out, ref, _gap(m, v, done, grad, ref_grad))
    assert error.rel > 1e-4


def test_a_flipped_entry_that_moved_too_far_fails() -> None:
    weight, m, v, grad, ref_grad = _case(0)
    out, ref = _step(weight, m, v, 0, grad), _step(weight, m, v, 0, ref_grad)
    out[3] += 2 * LR  # on top of the flip's own 2 lr: more than the update can explain
    error = weight_error(out, ref, _gap(m, v, 0, grad, ref_grad))
    assert error.rel > 1e-4


def test_identical_gradients_allow_nothing() -> None:
    weight, m, v, _, ref_grad = _case(1)
    ref = _step(weight, m, v, 1, ref_grad)
    moved = ref.clone()
    moved[0] += 1e-6
    error = weight_error(moved, ref, _gap(m, v, 1, ref_grad, ref_grad))
    assert error.sign_flips == 0 and error.rel == pytest.approx(1e-6 / ref.norm().item())


def test_shapes_that_differ_fail() -> None:
    zeros = torch.zeros
    assert weight_error(zeros(3), zeros(4), zeros(3)).rel == math.inf
    assert sign_flips(zeros(3), zeros(4)) == 0
