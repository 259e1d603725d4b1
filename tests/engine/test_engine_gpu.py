"""The engine on CUDA: the example chain, planned and placed, at a generous and a tight
budget. Results match plain autograd and the allocator's own peak stays in the budget."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")

from dataflow_resolver_matmul_chain.reference import reference_gradients  # noqa: E402
from dataflow_resolver_matmul_chain.resolver import build  # noqa: E402

from dataflow.engine import Engine  # noqa: E402
from dataflow.planning import plan  # noqa: E402
from dataflow.planning.placement import place  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS = 6


def _run(budget_fraction: float):
    program = chain.build_program(LAYERS, 512, 2048)
    values = chain.initial_values(program)
    generous = plan(program, 10**12)
    budget = int(generous.sim.fast_peak_bytes * budget_fraction)
    planned = plan(program, budget)
    placement = place(planned)
    with Engine("torch", budget_bytes=budget, device="cuda") as engine:
        engine.load(planned, build(planned.program), initial=values, placement=placement)
        result = engine.run(steps=1)
        grads = {k: engine.fetch(k) for k in program.final_locations}
    return budget, result, grads, reference_gradients(values, LAYERS)


@pytest.mark.parametrize("fraction", [1.0, 0.5])
def test_chain_on_cuda_matches_autograd_within_budget(fraction: float) -> None:
    budget, result, grads, reference = _run(fraction)
    for name, expected in reference.items():
        got = grads[name]
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel < 1e-3, f"{name}: relative error {rel:.2e}"  # tf32-free fp32 matmuls
    # Engine.run raises BudgetBreachError itself on a breach; check the figure is real.
    assert 0 < result.allocator_peak_bytes <= budget
