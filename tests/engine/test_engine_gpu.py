"""The engine on CUDA: the example chain, planned and placed, at a generous and a tight
budget. Results match plain autograd and the allocator's own peak stays in the budget."""

from __future__ import annotations

import pytest

torch = pytest.importorskip("torch")
chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")

from dataflow_resolver_matmul_chain.reference import reference_gradients  # noqa: E402
from dataflow_resolver_matmul_chain.resolver import build  # noqa: E402

from dataflow.engine import Engine  # noqa: E402
from dataflow.planning import minimal_budget, place, plan  # noqa: E402

pytestmark = pytest.mark.gpu
LAYERS = 6


def _run(tightest: bool):
    from dataflow.engine.backends.torch_cuda import runtime_reserve_bytes

    program = chain.build_program(LAYERS, 1024, 4096)  # 16 MiB activations
    values = chain.initial_values(program)
    reserve = runtime_reserve_bytes("cuda")  # cuBLAS keeps a workspace per stream
    objects_bytes = (
        minimal_budget(program) if tightest else plan(program, 2**40).sim.fast_peak_bytes
    )
    budget = objects_bytes + reserve
    planned = plan(program, objects_bytes)
    placement = place(planned)
    with Engine("torch", budget_bytes=budget, device="cuda") as engine:
        engine.load(placement, build(placement.plan.program), initial=values)
        result = engine.run(steps=1)
        grads = {k: engine.fetch(k) for k in program.final_locations}
    return budget, result, grads, reference_gradients(values, LAYERS)


@pytest.mark.parametrize("tightest", [False, True], ids=["generous", "tightest"])
def test_chain_on_cuda_matches_autograd_within_budget(tightest: bool) -> None:
    torch.backends.cuda.matmul.allow_tf32 = False
    budget, result, grads, reference = _run(tightest)
    for name, expected in reference.items():
        got = grads[name]
        rel = ((got - expected).norm() / expected.norm()).item()
        assert rel < 1e-4, f"{name}: relative error {rel:.2e}"  # fp32 on both sides
    # Engine.run raises BudgetBreachError itself on a breach; check the figure is real.
    assert 0 < result.allocator_peak_bytes <= budget
    assert result.fast_peak_bytes <= budget
    if tightest:
        assert sum(t.size_bytes for t in result.steps[0].transfers) > 0


def test_the_slow_pool_is_page_locked_at_its_exact_size() -> None:
    """The pool is registered, not taken from torch's pinned allocator (which rounds up to
    a power of two): its bytes are pinned, copies from it are asynchronous and can be
    captured, and dropping the pool unlocks them."""
    import gc

    from dataflow.engine.backends.torch_storage import SlowPool
    from dataflow.schema import Obj

    objects = [Obj(id=f"x{i}", size_bytes=3 * 2**20 + 7, role="activation") for i in range(3)]
    pool = SlowPool(objects, torch.device("cuda"))
    assert pool.arena.is_pinned() and pool.arena.numel() == pool.total_bytes
    source = pool.view("x1")
    source.fill_(5)
    target = torch.empty(source.numel(), dtype=torch.uint8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        target.copy_(source, non_blocking=True)
    graph.replay()
    torch.cuda.synchronize()
    assert int(target.min()) == int(target.max()) == 5
    arena = pool.arena
    del pool, source, graph
    gc.collect()
    assert not arena.is_pinned()
