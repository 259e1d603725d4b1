"""Plan the example chain at several budgets, run each on the engine, check the numbers.

    python -m dataflow_resolver_matmul_chain.run --layers 8 --dim 256 --batch 512

For every budget (the no-offload peak, the fractions of it in ``FRACTIONS`` that can
work, and last the smallest budget that plans, from ``minimal_budget``) it prints the predicted and measured makespan and the largest difference from the
plain-autograd reference. Exit 1 if any result differs from the generous budget's.
"""

from __future__ import annotations

import sys

import click
import torch

from dataflow import Engine, PlanningError, format_size, minimal_budget, place, plan
from dataflow_resolver_matmul_chain.chain import build_program, initial_values
from dataflow_resolver_matmul_chain.reference import reference_gradients
from dataflow_resolver_matmul_chain.resolver import build

FRACTIONS = (1.0, 0.75, 0.5, 0.35, 0.25)


def run_at(program, budget_bytes: int, device: str, values) -> tuple[object, dict]:
    planned = plan(program, budget_bytes)
    placement = place(planned)
    with Engine("torch", budget_bytes=budget_bytes, device=device) as engine:
        engine.load(placement, build(placement.plan.program), initial=values)
        result = engine.run()
        outputs = {obj: engine.fetch(obj) for obj in program.final_locations}
    return (planned, result), outputs


@click.command()
@click.option("--layers", default=4, show_default=True)
@click.option("--dim", default=64, show_default=True)
@click.option("--batch", default=128, show_default=True)
@click.option("--device", default="cpu", show_default=True)
def main(layers: int, dim: int, batch: int, device: str) -> None:
    program = build_program(layers, dim, batch)
    values = initial_values(program)
    reference = reference_gradients(values, layers)
    peak = plan(program, 2**62).sim.fast_peak_bytes  # the no-pressure plan's peak
    smallest = minimal_budget(program)
    budgets = sorted({int(peak * f) for f in FRACTIONS if peak * f > smallest} | {smallest})
    baseline = None
    failed = False
    print(f"{'budget':>12} {'predicted':>12} {'measured':>12} {'moved':>10} {'max |err|':>10}")
    for budget in reversed(budgets):
        try:
            (planned, result), outputs = run_at(program, budget, device, values)
        except PlanningError as exc:  # a packing that does not fit: said, and the run goes on
            print(f"{format_size(budget):>12} {exc}")
            continue
        error = max((outputs[k] - reference[k]).abs().max().item() for k in reference)
        baseline = baseline or outputs
        same = all(torch.equal(outputs[k], baseline[k]) for k in outputs)
        failed |= not same
        moved = planned.sim.h2d.bytes + planned.sim.d2h.bytes
        print(
            f"{format_size(budget):>12} {planned.sim.makespan_us:>10.0f}us "
            f"{result.makespan_us:>10.0f}us {format_size(moved):>10} {error:>10.2e}"
            f"{'' if same else '  DIFFERS from the generous budget'}"
        )
    sys.exit(1 if failed else 0)


if __name__ == "__main__":
    main()
