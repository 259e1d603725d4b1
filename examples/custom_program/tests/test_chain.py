"""The example chain: planned at a generous and at the tightest budget, run on the CPU
engine from its placement, it gives bit-identical results that match plain autograd."""

from __future__ import annotations

import pytest
import torch
from dataflow_resolver_matmul_chain import build_program, initial_values
from dataflow_resolver_matmul_chain.reference import reference_gradients
from dataflow_resolver_matmul_chain.resolver import build

from dataflow import Engine, minimal_budget, place, plan

LAYERS = 5


DEVICES = ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)]


def _run(program, budget_bytes: int, values, device: str = "cpu"):
    planned = plan(program, budget_bytes)
    placement = place(planned)
    assert placement.arena_bytes <= budget_bytes
    if device == "cuda":  # the CUDA libraries' own workspace is part of the budget
        from dataflow import runtime_reserve_bytes

        budget_bytes += runtime_reserve_bytes("cuda")
    with Engine("torch", budget_bytes=budget_bytes, device=device) as engine:
        engine.load(placement, build(placement.plan.program), initial=values)
        result = engine.run()
        return result, {name: engine.fetch(name) for name in program.final_locations}


@pytest.mark.parametrize("device", DEVICES)
def test_generous_and_tight_budgets_agree_bit_for_bit(device: str) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    program = build_program(LAYERS, dim=24, batch=40)
    values = initial_values(program, seed=3)
    generous_bytes = plan(program, 2**40).sim.fast_peak_bytes
    tight_bytes = minimal_budget(program)
    assert tight_bytes < generous_bytes // 2
    generous, generous_out = _run(program, generous_bytes, values, device)
    tight, tight_out = _run(program, tight_bytes, values, device)
    assert tight.fast_peak_bytes <= tight_bytes < generous.fast_peak_bytes
    assert sum(t.size_bytes for t in tight.steps[0].transfers) > 0
    reference = reference_gradients(values, LAYERS)
    for name, expected in reference.items():
        assert torch.equal(generous_out[name], tight_out[name]), name
        # fp32 against CPU autograd; cuBLAS sums in another order than the CPU does
        rtol, atol = (1e-5, 1e-6) if device == "cpu" else (1e-4, 1e-5)
        torch.testing.assert_close(tight_out[name].cpu(), expected, rtol=rtol, atol=atol)


def test_the_resolver_is_registered_through_the_entry_point() -> None:
    from dataflow import resolvers

    spec = resolvers().get("matmul-chain")
    program = build_program(2, 4, 4)
    assert spec.build(program)(program.tasks[0]).__class__.__name__ == "TanhMatmul"
