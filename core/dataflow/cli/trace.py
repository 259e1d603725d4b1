"""``dataflow trace PLANNED.json --resolver NAME``: predicted and measured, side by side.

Simulates the annotated program, runs it on the engine with the named resolver (an
installed plugin) on seeded random values, and writes one Chrome trace with two
processes: the prediction above the measurement. Open it in Perfetto.
"""

from __future__ import annotations

import sys

import click

from dataflow.cli.options import size_callback
from dataflow.cli.validate import load_program
from dataflow.extras import MissingExtraError, require_torch
from dataflow.units import format_size


def random_initial(program, seed: int):
    """Seeded random start values for every object that exists at start."""
    import torch

    from dataflow.engine.backends.torch_storage import torch_dtype

    generator = torch.Generator().manual_seed(seed)
    values = {}
    for obj in program.objects:
        if not program.exists_at_start(obj.id):
            continue
        if obj.tensor is None:
            values[obj.id] = torch.randint(
                0, 256, (obj.size_bytes,), generator=generator, dtype=torch.uint8
            )
        elif torch_dtype(obj.tensor.dtype).is_floating_point:
            values[obj.id] = torch.randn(obj.tensor.shape, generator=generator).to(
                torch_dtype(obj.tensor.dtype)
            )
        else:
            values[obj.id] = torch.zeros(obj.tensor.shape, dtype=torch_dtype(obj.tensor.dtype))
    return values


@click.command("trace")
@click.argument("program_path", metavar="PLANNED.json", type=click.Path(dir_okay=False))
@click.option(
    "--resolver",
    "resolver_name",
    required=True,
    help="name of an installed resolver (see `dataflow plugins list`)",
)
@click.option(
    "--budget",
    "budget_bytes",
    callback=size_callback,
    default=None,
    help="fast-memory budget (default: the program's)",
)
@click.option("--device", default="cpu", show_default=True, help="cpu or cuda")
@click.option("--steps", default=1, show_default=True, help="steps to run; the last is traced")
@click.option("--seed", default=0, show_default=True, help="seed of the random start values")
@click.option("-o", "--output", default="trace.json", show_default=True, type=click.Path())
def trace_command(
    program_path: str,
    resolver_name: str,
    budget_bytes: int | None,
    device: str,
    steps: int,
    seed: int,
    output: str,
) -> None:
    """Write the predicted and the measured timeline of PLANNED.json into one trace."""
    try:
        require_torch("dataflow trace")
    except MissingExtraError as exc:
        raise click.ClickException(str(exc)) from None
    from dataflow.engine import Engine, EngineRunError
    from dataflow.plugins import resolvers
    from dataflow.registry import UnknownNameError
    from dataflow.sim import simulate

    program = load_program(program_path)
    try:
        spec = resolvers().get(resolver_name)
    except UnknownNameError as exc:
        raise click.ClickException(str(exc)) from None
    predicted = simulate(program, budget_bytes=budget_bytes)
    if not predicted.valid:
        click.echo(f"{program_path}: the simulator says it cannot run: {predicted.error}", err=True)
        sys.exit(1)
    with Engine("torch", budget_bytes=budget_bytes, device=device) as engine:
        engine.load(
            program,
            spec.build(program),
            initial=random_initial(program, seed),
            resolver_name=resolver_name,
        )
        engine.predicted = predicted
        try:
            result = engine.run(steps=steps)
        except EngineRunError as exc:
            click.echo(f"{program_path}: {exc}", err=True)
            sys.exit(1)
    result.to_chrome_trace(output)
    click.echo(
        f"predicted {predicted.makespan_us:.0f} us, measured {result.makespan_us:.0f} us "
        f"(x{result.measured_over_predicted:.2f}); fast peak {format_size(result.fast_peak_bytes)}"
        f"; wrote {output}"
    )
