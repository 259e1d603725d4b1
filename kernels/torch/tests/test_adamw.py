"""AdamW variants against a float64 AdamW (conftest.py) and against torch.optim.AdamW.

Every test starts from random, non-zero moments (exp_avg_sq positive) and runs several
steps with fresh random gradients. Tolerances (``torch.testing.assert_close``), after the
steps, by the dtype each tensor is stored in:

- float32: rtol 1e-5, atol 1e-6 against float64; rtol 1e-6, atol 1e-7 between the fused
  and the reference variant and against torch.optim.AdamW
- bfloat16: rtol 1e-2, atol 4e-3 (one bfloat16 unit in the last place at 0.5: a moment
  that cancels to a small value keeps the rounding error of its larger terms), against
  float64 rounded to the storage dtypes after each step, and between the two variants;
  a float32 param with bfloat16 moments: atol 5 steps * lr * 2**-6 (about 2.3e-4)
"""

from __future__ import annotations

import math

import pytest
import torch

DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]
VARIANTS = ["torch", "torch-reference"]
HYPER = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
SHAPES = [(1,), (7, 13), (3, 5, 17)]
STEPS = 5


def initial_state(randn, shape, device, param_dtype, state_dtype):
    param = randn(*shape, dtype=param_dtype, device=device)
    exp_avg = randn(*shape, dtype=state_dtype, device=device, scale=0.1)
    exp_avg_sq = (randn(*shape, device=device, scale=0.01) ** 2 + 1e-4).to(state_dtype)
    return param, exp_avg, exp_avg_sq


def run_steps(float64_adamw, adamw, randn, param, exp_avg, exp_avg_sq, grad_dtype, first_step=1):
    """``STEPS`` steps of ``adamw`` in place; returns the float64 reference after them."""
    reference = float64_adamw(param, exp_avg, exp_avg_sq)
    for step in range(first_step, first_step + STEPS):
        grad = randn(*param.shape, dtype=grad_dtype, device=str(param.device))
        adamw(param, grad, exp_avg, exp_avg_sq, step=step, **HYPER)
        reference.step(grad, step, **HYPER)
    return reference


#: Against float64, by storage dtype.
TOLERANCE = {
    torch.float32: {"rtol": 1e-5, "atol": 1e-6},
    torch.bfloat16: {"rtol": 1e-2, "atol": 4e-3},
}
#: Between two float32 implementations of the same formula.
FLOAT32_AGREEMENT = {"rtol": 1e-6, "atol": 1e-7}


#: A float32 param with bfloat16 moments: where kernel and reference round a moment to
#: neighbouring bfloat16 values, the next update differs by up to about lr * 2**-6; over
#: the steps that adds up to this absolute tolerance on the param.
PARAM_ATOL_WITH_BF16_STATES = STEPS * HYPER["lr"] * 2**-6


def assert_matches(reference, param, exp_avg, exp_avg_sq) -> None:
    for name, got, want in (
        ("param", param, reference.param),
        ("exp_avg", exp_avg, reference.exp_avg),
        ("exp_avg_sq", exp_avg_sq, reference.exp_avg_sq),
    ):
        tolerance = TOLERANCE[got.dtype]
        if name == "param" and torch.bfloat16 in (exp_avg.dtype, exp_avg_sq.dtype):
            tolerance = {**tolerance, "atol": max(tolerance["atol"], PARAM_ATOL_WITH_BF16_STATES)}
        torch.testing.assert_close(
            got.double(), want, **tolerance, msg=lambda m, n=name: f"{n}: {m}"
        )


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("shape", SHAPES)
@pytest.mark.parametrize("first_step", [1, 100])
def test_float32_matches_float64_adamw(
    float64_adamw, kernel, randn, device, name, shape, first_step
) -> None:
    state = initial_state(randn, shape, device, torch.float32, torch.float32)
    reference = run_steps(
        float64_adamw, kernel("adamw", name), randn, *state, torch.float32, first_step
    )
    assert_matches(reference, *state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize(
    ("param_dtype", "state_dtype", "grad_dtype"),
    [
        (torch.float32, torch.bfloat16, torch.float32),  # bfloat16 moments, float32 master
        (torch.float32, torch.bfloat16, torch.bfloat16),
        (torch.bfloat16, torch.bfloat16, torch.bfloat16),  # all bfloat16: fused on cpu/cuda
        (torch.bfloat16, torch.float32, torch.bfloat16),
    ],
)
def test_lower_precision_storage_matches_float64_adamw(
    float64_adamw, kernel, randn, device, name, param_dtype, state_dtype, grad_dtype
) -> None:
    state = initial_state(randn, (9, 31), device, param_dtype, state_dtype)
    reference = run_steps(float64_adamw, kernel("adamw", name), randn, *state, grad_dtype)
    for tensor, dtype in zip(state, (param_dtype, state_dtype, state_dtype), strict=True):
        assert tensor.dtype == dtype  # updated in place, storage dtype kept
    assert_matches(reference, *state)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("name", VARIANTS)
def test_matches_torch_optim_adamw(kernel, randn, device, name) -> None:
    """torch.optim.AdamW (single-tensor path), resumed from the same non-zero state."""
    param, exp_avg, exp_avg_sq = initial_state(randn, (11, 6), device, *[torch.float32] * 2)
    optim_param = torch.nn.Parameter(param.clone())
    optimizer = torch.optim.AdamW(
        [optim_param],
        lr=HYPER["lr"],
        betas=(HYPER["beta1"], HYPER["beta2"]),
        eps=HYPER["eps"],
        weight_decay=HYPER["weight_decay"],
        foreach=False,
        fused=False,
    )
    optimizer.state[optim_param] = {
        "step": torch.tensor(3.0),
        "exp_avg": exp_avg.clone(),
        "exp_avg_sq": exp_avg_sq.clone(),
    }
    adamw = kernel("adamw", name)
    for step in range(4, 4 + STEPS):
        grad = randn(11, 6, device=device)
        optim_param.grad = grad.clone()
        optimizer.step()
        adamw(param, grad, exp_avg, exp_avg_sq, step=step, **HYPER)
    state = optimizer.state[optim_param]
    torch.testing.assert_close(param, optim_param.detach(), **FLOAT32_AGREEMENT)
    torch.testing.assert_close(exp_avg, state["exp_avg"], **FLOAT32_AGREEMENT)
    torch.testing.assert_close(exp_avg_sq, state["exp_avg_sq"], **FLOAT32_AGREEMENT)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_the_reference_variant(kernel, randn, device, dtype) -> None:
    from dataflow_kernels_torch.adamw import fused_applies

    fused_state = initial_state(randn, (4, 257), device, dtype, dtype)
    assert fused_applies(fused_state[0], fused_state[0], *fused_state[1:])
    reference_state = [t.clone() for t in fused_state]
    for step in range(1, 1 + STEPS):
        grad = randn(4, 257, dtype=dtype, device=device)
        kernel("adamw", "torch")(*fused_state[:1], grad, *fused_state[1:], step=step, **HYPER)
        kernel("adamw", "torch-reference")(
            *reference_state[:1], grad, *reference_state[1:], step=step, **HYPER
        )
    tolerance = FLOAT32_AGREEMENT if dtype == torch.float32 else TOLERANCE[dtype]
    for fused, plain in zip(fused_state, reference_state, strict=True):
        torch.testing.assert_close(fused, plain, **tolerance)


def test_fused_applies_only_to_one_dense_dtype(randn) -> None:
    from dataflow_kernels_torch.adamw import fused_applies

    p, m, v = initial_state(randn, (4, 6), "cpu", torch.float32, torch.float32)
    assert fused_applies(p, p.clone(), m, v)
    assert not fused_applies(p, p.clone(), m.bfloat16(), v.bfloat16())
    assert not fused_applies(p, p.bfloat16(), m, v)
    assert not fused_applies(p.T, p.T.clone(), m.T, v.T)  # not contiguous
    assert fused_applies(p.double(), p.double(), m.double(), v.double())


def test_non_contiguous_views_are_updated_in_place(float64_adamw, kernel, randn) -> None:
    """A view into a larger buffer (as the training plugin packs objects) takes the
    reference path and writes through the view."""
    p, m, v = (t.T for t in initial_state(randn, (5, 8), "cpu", torch.float32, torch.float32))
    reference = run_steps(float64_adamw, kernel("adamw", "torch"), randn, p, m, v, torch.float32)
    assert_matches(reference, p, m, v)


@pytest.mark.parametrize("name", VARIANTS)
def test_zero_weight_decay_and_first_step_bias_correction(kernel, randn, name) -> None:
    """From zero moments, step 1 moves each entry by lr * sign(grad) (bias correction
    undoes the (1 - beta) factors), up to eps."""
    param = randn(40)
    grad = randn(40)
    exp_avg, exp_avg_sq = torch.zeros(40), torch.zeros(40)
    before = param.clone()
    hyper = {**HYPER, "weight_decay": 0.0}
    kernel("adamw", name)(param, grad, exp_avg, exp_avg_sq, step=1, **hyper)
    moved = before - param
    expected = hyper["lr"] * grad / (grad.abs() + hyper["eps"])
    torch.testing.assert_close(moved, expected, rtol=1e-5, atol=1e-8)
    assert math.isclose(float(moved.abs().max()), hyper["lr"], rel_tol=1e-4)


@pytest.mark.parametrize("name", VARIANTS)
@pytest.mark.parametrize("step", [0, -1, 1.0, True])
def test_step_must_be_a_positive_int(kernel, randn, name, step) -> None:
    p, m, v = initial_state(randn, (3,), "cpu", torch.float32, torch.float32)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        kernel("adamw", name)(p, randn(3), m, v, step=step, **HYPER)


@pytest.mark.parametrize("name", VARIANTS)
def test_shape_mismatch_is_named(kernel, randn, name) -> None:
    p, m, v = initial_state(randn, (3, 4), "cpu", torch.float32, torch.float32)
    with pytest.raises(ValueError, match=r"exp_avg has shape \(4, 3\), param \(3, 4\)"):
        kernel("adamw", name)(p, randn(3, 4), m.T.contiguous(), v, step=1, **HYPER)


@pytest.mark.parametrize("name", VARIANTS)
def test_hyperparameters_are_keyword_only(kernel, randn, name) -> None:
    p, m, v = initial_state(randn, (3,), "cpu", torch.float32, torch.float32)
    with pytest.raises(TypeError):
        kernel("adamw", name)(p, randn(3), m, v, 1, 1e-3, 0.9, 0.95, 1e-8, 0.1)
