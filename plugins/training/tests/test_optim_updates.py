"""The builtin optimizers' updates on their own: Muon's batched Newton-Schulz equals the
iteration matrix by matrix and orthogonalizes; every update keeps bfloat16 weights and
state close to its float32 run (``--precision bf16-plain``); the precision a run of each
gets; on CUDA (``gpu``, skipped here), every update equals its CPU run."""

from __future__ import annotations

import pytest
import torch
from dataflow_kernels_torch.adamw_multi import adamw_multi
from dataflow_training.optim.builtins import OPTIMIZERS
from dataflow_training.optim.muon import newton_schulz
from dataflow_training.step.precision import for_optimizer

SPECS = {spec.name: spec for spec in OPTIMIZERS if spec.name != "adamw_compensated"}
SHAPES = ((16, 8), (8, 16), (16, 8), (8,))  # two matrices of one shape: one batch
ROLES = ("block", "block", "block", "block")


def _run(name: str, dtype: torch.dtype, device: str = "cpu", steps: int = 3) -> list:
    spec = SPECS[name]
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
    shapes = {
        f.name: [f.shape(s, r) for s, r in zip(SHAPES, ROLES, strict=True)] for f in spec.state
    }
    states = {
        name: [torch.zeros(s, device=device, dtype=dtype) for s in field_shapes]
        for name, field_shapes in shapes.items()
    }
    policy = {"lr": 1e-2, "weight_decay": 0.1, **spec.defaults()}
    for step in range(1, steps + 1):
        grads = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
        spec.update(
            {"adamw_multi": adamw_multi}, params, grads, states, step=step, policy=policy, weight_decay=0.1,
            roles=list(ROLES),
        )  # fmt: skip
    return [p.float().cpu() for p in params]


def test_batched_newton_schulz_is_the_iteration_matrix_by_matrix() -> None:
    g = torch.randn(3, 32, 12, generator=torch.Generator().manual_seed(1))
    batched = newton_schulz(g, 5)
    one_by_one = torch.stack([newton_schulz(m.unsqueeze(0), 5)[0] for m in g])
    torch.testing.assert_close(batched, one_by_one, rtol=1e-5, atol=1e-6)
    singular = torch.linalg.svdvals(batched)  # the quintic lands them near 1, not on it
    assert singular.min() > 0.5 and singular.max() < 1.5
    assert torch.linalg.svdvals(g).max() / torch.linalg.svdvals(g).min() > 1.5  # g was not


@pytest.mark.parametrize("name", sorted(SPECS))
def test_bfloat16_weights_and_state_follow_the_float32_update(name: str) -> None:
    exact, rounded = _run(name, torch.float32), _run(name, torch.bfloat16)
    start = _run(name, torch.float32, steps=0)
    for e, r, s in zip(exact, rounded, start, strict=True):
        assert (e - s).abs().max() > 1e-3  # the updates moved the weights
        torch.testing.assert_close(r, e, rtol=2e-2, atol=2e-2)


def test_each_optimizer_gets_a_precision_it_can_keep() -> None:
    assert for_optimizer("auto", "adamw", device="cuda").name == "bf16"
    assert for_optimizer("auto", "lion", device="cuda").name == "bf16-plain"
    assert for_optimizer("auto", "muon", device="cpu").name == "fp32"
    assert for_optimizer("auto", "muon", device="cuda", dtype="fp32").name == "fp32"
    policy = for_optimizer("auto", "adafactor", device="cuda").optimizer_policy("adafactor")
    assert policy.state_dtypes == {"row": "bfloat16", "col": "bfloat16", "variance": "bfloat16"}
    with pytest.raises(ValueError, match="--optimizer muon has no compensated update"):
        for_optimizer("mixed", "muon").optimizer_policy("muon")


@pytest.mark.gpu
@pytest.mark.parametrize("name", sorted(SPECS))
def test_each_update_on_cuda_equals_its_cpu_run(name: str) -> None:
    torch.testing.assert_close(
        _run(name, torch.float32, "cuda"), _run(name, torch.float32), rtol=1e-4, atol=1e-5
    )
