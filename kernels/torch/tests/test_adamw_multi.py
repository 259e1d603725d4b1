"""adamw_multi variants against the float64 AdamW (conftest.py) over several steps, on
lists that mix shapes and storage dtypes in one call, and the fast variants against the
reference variant.

Tolerances (``torch.testing.assert_close``, after the steps), by the dtype each tensor is
stored in, as in test_adamw.py: float32 rtol 1e-5, atol 1e-6; float64 rtol 1e-10, atol
1e-12; bfloat16 rtol 1e-2, atol 4e-3 (one unit in the last place at 0.5); a float32 param
with bfloat16 moments gets atol steps * lr * 2**-6. Fast against reference: float32 and
float64 rtol 1e-6, atol 1e-7; bfloat16 storage one unit in the last place (rtol 1e-2,
atol 4e-3).
"""

from __future__ import annotations

import pytest
import torch

HYPER = {"lr": 3e-3, "beta1": 0.9, "beta2": 0.95, "eps": 1e-8, "weight_decay": 0.1}
STEPS = 4
SHAPES = [(1,), (7, 13), (3000,), (5, 2, 9)]
BF16, F32, F64 = torch.bfloat16, torch.float32, torch.float64
#: (param, grad, state) storage dtypes
COMBOS = [
    (F32, F32, F32),
    (BF16, BF16, F32),
    (BF16, BF16, BF16),
    (F32, F32, BF16),
    (F32, BF16, F32),
]
TOLERANCE = {
    F32: {"rtol": 1e-5, "atol": 1e-6},
    F64: {"rtol": 1e-10, "atol": 1e-12},
    BF16: {"rtol": 1e-2, "atol": 4e-3},
}
AGREEMENT = {
    F32: {"rtol": 1e-6, "atol": 1e-7},
    F64: {"rtol": 1e-6, "atol": 1e-7},
    BF16: TOLERANCE[BF16],
}
DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def variants(manager, device):
    return [v.name for v in manager.kernels().for_op("adamw_multi", device=device)]


def make_lists(randn, device, combos):
    """One tensor per (shape, combo): every combo appears in the same call."""
    params, grads, exp_avgs, exp_avg_sqs = [], [], [], []
    for index, (param_dtype, grad_dtype, state_dtype) in enumerate(combos):
        shape = SHAPES[index % len(SHAPES)]
        params.append(randn(*shape, dtype=param_dtype, device=device))
        grads.append(randn(*shape, dtype=grad_dtype, device=device))
        exp_avgs.append(randn(*shape, dtype=state_dtype, device=device, scale=0.1))
        exp_avg_sqs.append((randn(*shape, device=device, scale=0.01) ** 2 + 1e-4).to(state_dtype))
    return params, grads, exp_avgs, exp_avg_sqs


def run(adamw_multi, randn, lists, float64_adamw=None):
    params, grads, exp_avgs, exp_avg_sqs = lists
    references = (
        [float64_adamw(*t) for t in zip(params, exp_avgs, exp_avg_sqs, strict=True)]
        if float64_adamw
        else []
    )
    for step in range(1, STEPS + 1):
        for grad in grads:
            grad.copy_(randn(*grad.shape, dtype=grad.dtype, device=str(grad.device)))
        adamw_multi(params, grads, exp_avgs, exp_avg_sqs, step=step, **HYPER)
        for reference, grad in zip(references, grads[: len(references)], strict=True):
            reference.step(grad, step, **HYPER)
    return references


@pytest.mark.parametrize("device", DEVICES)
def test_every_variant_matches_float64_adamw_on_mixed_lists(
    manager, kernel, randn, float64_adamw, device
):
    combos = COMBOS * 2 + ([(F64, F64, F64), (F64, F64, F32)] if device == "cpu" else [])
    for name in variants(manager, device):
        lists = make_lists(randn, device, combos)
        references = run(kernel("adamw_multi", name), randn, lists, float64_adamw)
        params, _, exp_avgs, exp_avg_sqs = lists
        for i, reference in enumerate(references):
            for label, got, want in (
                ("param", params[i], reference.param),
                ("exp_avg", exp_avgs[i], reference.exp_avg),
                ("exp_avg_sq", exp_avg_sqs[i], reference.exp_avg_sq),
            ):
                tolerance = dict(TOLERANCE[got.dtype])
                if label == "param" and exp_avgs[i].dtype == BF16 and got.dtype != BF16:
                    tolerance["atol"] = STEPS * HYPER["lr"] * 2**-6
                torch.testing.assert_close(
                    got.double(),
                    want,
                    **tolerance,
                    msg=lambda m, n=f"{name} {label}[{i}]": f"{n}: {m}",
                )


@pytest.mark.parametrize("device", DEVICES)
def test_fast_variants_match_the_reference(manager, kernel, randn, device) -> None:
    names = variants(manager, device)
    start = make_lists(randn, device, COMBOS)
    results = {}
    for name in names:
        lists = [[t.clone() for t in lst] for lst in start]
        seeded = torch.Generator().manual_seed(5)

        def draw(*shape, dtype, device, seeded=seeded):
            return torch.randn(shape, generator=seeded).to(dtype=dtype, device=device)

        run(kernel("adamw_multi", name), draw, lists)
        results[name] = lists
    for name in names:
        for got_list, want_list in zip(results[name], results["reference"], strict=True):
            for got, want in zip(got_list, want_list, strict=True):
                torch.testing.assert_close(
                    got, want, **AGREEMENT[got.dtype], msg=lambda m, n=name: f"{n}: {m}"
                )


def test_non_contiguous_views_are_updated_in_place(kernel, randn, float64_adamw) -> None:
    lists = [
        [t.mT for t in lst if t.dim() >= 2]
        for lst in make_lists(randn, "cpu", [(F32, F32, F32), (BF16, BF16, F32)] * 2)
    ]
    references = run(kernel("adamw_multi", "torch"), randn, lists, float64_adamw)
    for reference, param in zip(references, lists[0], strict=True):
        torch.testing.assert_close(param.double(), reference.param, **TOLERANCE[param.dtype])


def test_empty_lists_do_nothing(kernel) -> None:
    kernel("adamw_multi", "torch")([], [], [], [], step=1, **HYPER)


@pytest.mark.parametrize("name", ["torch", "reference"])
def test_bad_lists_are_named(kernel, randn, name) -> None:
    p, g, m, v = make_lists(randn, "cpu", [(F32, F32, F32), (F32, F32, F32)])
    with pytest.raises(ValueError, match="grads has 1 tensors, params 2"):
        kernel("adamw_multi", name)(p, g[:1], m, v, step=1, **HYPER)
    with pytest.raises(ValueError, match=r"exp_avgs\[1\] is \(7, 12\)"):
        kernel("adamw_multi", name)(p, g, [m[0], m[1][:, :12]], v, step=1, **HYPER)
    with pytest.raises(ValueError, match="step must be an int >= 1"):
        kernel("adamw_multi", name)(p, g, m, v, step=0, **HYPER)
