"""The example chain: planned at a generous and at the tightest budget, run on the CPU
engine from its placement, it gives bit-identical results that match plain autograd."""

from __future__ import annotations

import torch
from dataflow_resolver_matmul_chain import build_program, initial_values
from dataflow_resolver_matmul_chain.reference import reference_gradients
from dataflow_resolver_matmul_chain.resolver import build

from dataflow.engine import Engine
from dataflow.planning import minimal_budget, plan
from dataflow.planning.placement import place

LAYERS = 5


def _run(program, budget_bytes: int, values):
    planned = plan(program, budget_bytes)
    placement = place(planned)
    assert placement.arena_bytes <= budget_bytes
    with Engine("torch", budget_bytes=budget_bytes, device="cpu") as engine:
        engine.load(planned, build(planned.program), initial=values, placement=placement)
        result = engine.run()
        return result, {name: engine.fetch(name) for name in program.final_locations}


def test_generous_and_tight_budgets_agree_bit_for_bit() -> None:
    program = build_program(LAYERS, dim=24, batch=40)
    values = initial_values(program, seed=3)
    generous_bytes = plan(program, 2**40).sim.fast_peak_bytes
    tight_bytes = minimal_budget(program)
    assert tight_bytes < generous_bytes // 2
    generous, generous_out = _run(program, generous_bytes, values)
    tight, tight_out = _run(program, tight_bytes, values)
    assert tight.fast_peak_bytes <= tight_bytes < generous.fast_peak_bytes
    assert sum(t.size_bytes for t in tight.steps[0].transfers) > 0
    reference = reference_gradients(values, LAYERS)
    for name, expected in reference.items():
        assert torch.equal(generous_out[name], tight_out[name]), name
        torch.testing.assert_close(tight_out[name], expected, rtol=1e-5, atol=1e-6)


def test_the_resolver_is_registered_through_the_entry_point() -> None:
    from dataflow.plugins import resolvers

    spec = resolvers().get("matmul-chain")
    program = build_program(2, 4, 4)
    assert spec.build(program)(program.tasks[0]).__class__.__name__ == "TanhMatmul"
