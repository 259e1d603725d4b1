"""The builtin optimizers' updates on their own: Muon's batched Newton-Schulz equals the
iteration matrix by matrix and orthogonalizes; every update keeps bfloat16 weights and
state close to its float32 run (``--precision bf16-plain``); the precision a run of each
gets; on CUDA (``gpu``, skipped here), every update equals its CPU run."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("dataflow_kernels_torch")  # the isolated training plugin has none

from dataflow_kernels_torch.adamw_multi import adamw_multi  # noqa: E402
from dataflow_training.optim.builtins import OPTIMIZERS  # noqa: E402
from dataflow_training.optim.muon import newton_schulz  # noqa: E402
from dataflow_training.step.precision import for_optimizer  # noqa: E402

SPECS = {spec.name: spec for spec in OPTIMIZERS if spec.name != "adamw_compensated"}
SHAPES = ((16, 8), (8, 16), (16, 8), (8,))  # two matrices of one shape: one batch
ROLES = ("block", "block", "block", "block")


def _run(
    name: str, dtype: torch.dtype, device: str = "cpu", steps: int = 3, tensors: bool = False
) -> list:
    """The weights after ``steps`` updates from seeded weights and gradients; ``tensors``:
    lr and step handed as 0-d device tensors, as a replayed CUDA graph hands them."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(0)
    params = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
    shapes = {
        f.name: [f.shape(s, r) for s, r in zip(SHAPES, ROLES, strict=True)] for f in spec.state
    }
    kept = {f.name: dtype if f.dtype is None else getattr(torch, f.dtype) for f in spec.state}
    states = {
        name: [torch.zeros(s, device=device, dtype=kept[name]) for s in field_shapes]
        for name, field_shapes in shapes.items()
    }
    lr = torch.tensor(1e-2, device=device) if tensors else 1e-2
    policy = {"lr": lr, "weight_decay": 0.1, **spec.defaults()}
    for step in range(1, steps + 1):
        grads = [torch.randn(s, generator=g).to(device, dtype) for s in SHAPES]
        count = torch.tensor(float(step), device=device) if tensors else step
        spec.update(
            {"adamw_multi": adamw_multi}, params, grads, states, step=count, policy=policy,
            weight_decay=0.1, roles=list(ROLES),
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


@pytest.mark.parametrize("name", sorted(SPECS))
def test_lr_and_step_as_device_tensors_give_the_same_update(name: str) -> None:
    """What a replayed CUDA graph hands the update: nothing is read back, the same result."""
    for t, n in zip(
        _run(name, torch.float32, tensors=True), _run(name, torch.float32), strict=True
    ):
        torch.testing.assert_close(t, n, rtol=1e-6, atol=1e-7)


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


@pytest.mark.gpu
@pytest.mark.parametrize("name", ["lion", "muon", "adafactor", "adamw_int8"])
def test_each_update_replays_in_a_cuda_graph(name: str) -> None:
    """Captured once, replayed with a new lr and step written into their tensors: the
    same weights as eager updates with those values (nothing read back, nothing baked)."""
    spec = SPECS[name]
    g = torch.Generator().manual_seed(0)
    shapes = {
        f.name: [f.shape(s, r) for s, r in zip(SHAPES, ROLES, strict=True)] for f in spec.state
    }

    kept = {f.name: getattr(torch, f.dtype or "float32") for f in spec.state}
    ops = {"adamw_multi": adamw_multi}

    def tensors():
        params = [torch.randn(s, generator=g).cuda() for s in SHAPES]
        states = {
            n: [torch.zeros(s, device="cuda", dtype=kept[n]) for s in ss]
            for n, ss in shapes.items()
        }
        return params, states

    params, states = tensors()
    grads = [torch.randn(s, generator=g).cuda() for s in SHAPES]
    eager = ([p.clone() for p in params], {n: [t.clone() for t in ts] for n, ts in states.items()})
    lr, step = torch.tensor(1e-2, device="cuda"), torch.tensor(1.0, device="cuda")
    kwargs = {"weight_decay": 0.1, "roles": list(ROLES)}
    policy = {"lr": lr, "weight_decay": 0.1, **spec.defaults()}
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm-up on a side stream, as capture wants
        warm = (
            [p.clone() for p in params],
            {n: [t.clone() for t in ts] for n, ts in states.items()},
        )
        spec.update(ops, warm[0], grads, warm[1], step=step, policy=policy, **kwargs)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        spec.update(ops, params, grads, states, step=step, policy=policy, **kwargs)
    for count, rate in ((1, 1e-2), (2, 5e-3), (3, 2e-3)):
        if count > 1:
            lr.fill_(rate)
            step.fill_(count)
        graph.replay()
        spec.update(
            ops, eager[0], grads, eager[1], step=count,
            policy={**policy, "lr": rate}, **kwargs,
        )  # fmt: skip
    torch.cuda.synchronize()
    for replayed, expected in zip(params, eager[0], strict=True):
        torch.testing.assert_close(replayed, expected, rtol=1e-5, atol=1e-6)
