"""``dataflow trace PLANNED.json --resolver NAME``: predicted and measured, side by side.

Simulates the annotated program, runs it on the engine with the named resolver (an
installed plugin; ``synthetic`` runs any program by its task costs) on seeded random
values, and writes one Chrome trace with two processes: the prediction above the
measurement of the last step. Open it in Perfetto. With ``--bundle DIR`` (a bundle of
this program, from ``dataflow export``) the measured timeline of the steps is written
beside it (``measured_timeline.json``) and its summary gets the measured step.
``--value NAME=VALUE`` (repeatable) and ``--values FILE.json`` give the run's per-run
values (``ctx.values``; the engine adds ``step``); a task that reads one not given fails
with one line naming the value and the task.

Every step gets fresh inputs: each object that exists at start and has no final location
(the step's data) is drawn anew from ``(seed, step)``; the others (weights, optimizer
state) carry over from the step before, as in training.
"""

from __future__ import annotations

import click

from dataflow.cli.errors import Failure, plugin_failure
from dataflow.cli.options import (
    BUDGET,
    COUNT,
    Device,
    OutputFile,
    lookup,
    run_values,
    value_options,
    write_to,
)
from dataflow.cli.validate import PROGRAM_FILE, load_program
from dataflow.extras import MissingExtraError, require_torch
from dataflow.units import format_size


def random_values(program, seed: int, objects=None):
    """Seeded random values for ``objects`` (default: every object that exists at start)."""
    import torch

    from dataflow.engine.backends.torch_storage import torch_dtype

    generator = torch.Generator().manual_seed(seed)
    values = {}
    for obj in program.objects:
        if not program.exists_at_start(obj.id) or (objects is not None and obj.id not in objects):
            continue
        if obj.tensor is None:  # raw bytes: a random pattern, repeated (cheap for big ones)
            pattern = torch.randint(
                0, 256, (min(obj.size_bytes, 1 << 16),), generator=generator, dtype=torch.uint8
            )
            values[obj.id] = pattern.repeat(-(-obj.size_bytes // pattern.numel()))[
                : obj.size_bytes
            ].clone()
        elif torch_dtype(obj.tensor.dtype).is_floating_point:
            values[obj.id] = torch.randn(obj.tensor.shape, generator=generator).to(
                torch_dtype(obj.tensor.dtype)
            )
        else:
            values[obj.id] = torch.zeros(obj.tensor.shape, dtype=torch_dtype(obj.tensor.dtype))
    return values


def step_inputs(program) -> set[str]:
    """The objects each step is fed afresh: they exist at start, and no final location
    says where they must end (so a step may consume them)."""
    return {
        obj.id
        for obj in program.objects
        if program.exists_at_start(obj.id) and obj.id not in program.final_locations
    }


@click.command("trace")
@click.argument("program_path", metavar="PLANNED.json", type=PROGRAM_FILE)
@click.option(
    "--resolver",
    "resolver_name",
    required=True,
    help="name of an installed resolver (see `dataflow plugins list`); "
    "`synthetic` runs any program by its task costs",
)
@click.option(
    "--budget",
    "budget_bytes",
    type=BUDGET,
    default=None,
    metavar="SIZE",
    help="fast-memory budget (default: the program's)",
)
@click.option("--device", default="cpu", show_default=True, type=Device(), help="cpu or cuda")
@click.option(
    "--steps", default=1, show_default=True, type=COUNT, help="steps to run; the last is traced"
)
@click.option("--seed", default=0, show_default=True, help="seed of the random start values")
@click.option(
    "-o", "--output", default="trace.json", show_default=True, type=OutputFile(), metavar="OUT"
)
@click.option(
    "--bundle",
    "bundle_dir",
    default=None,
    type=click.Path(file_okay=False, exists=True),
    metavar="DIR",
    help="a bundle of PLANNED.json (dataflow export): write the measured timeline beside it",
)
@value_options
def trace_command(
    program_path: str,
    resolver_name: str,
    budget_bytes: int | None,
    device: str,
    steps: int,
    seed: int,
    output: str,
    bundle_dir: str | None,
    value_pairs: tuple[tuple[str, object], ...],
    values_file: str | None,
) -> None:
    """Write the predicted and the measured timeline of PLANNED.json into one trace."""
    values = run_values(value_pairs, values_file)
    try:
        require_torch("dataflow trace")
    except MissingExtraError as exc:
        raise Failure(str(exc)) from None
    from dataflow.cli.simulate import bare_hint
    from dataflow.engine import Engine, ResolverError
    from dataflow.plugins import resolvers
    from dataflow.sim import simulate

    spec = lookup(resolvers(), resolver_name, "--resolver")
    program = load_program(program_path)
    bundle = None if bundle_dir is None else _bundle_of(bundle_dir, program, program_path)
    predicted = simulate(program, budget_bytes=budget_bytes)
    if not predicted.valid:
        raise Failure(
            f"{program_path}: the simulator says it cannot run: {predicted.error}"
            f"{bare_hint(program)}"
        )
    try:
        resolver = spec.build(program)
    except Exception as exc:  # the resolver plugin's own failure: name it
        raise plugin_failure(
            f"resolver {resolver_name!r} cannot be built for {program_path}", exc
        ) from exc
    fed = step_inputs(program)
    with Engine("torch", budget_bytes=budget_bytes, device=device) as engine:
        try:
            engine.load(
                program,
                resolver,
                initial=random_values(program, seed),
                resolver_name=resolver_name,
            )
        except ResolverError as exc:
            raise Failure(
                f"{program_path}: {exc}; `--resolver synthetic` runs any program by its task costs"
            ) from exc
        engine.predicted = predicted
        result = engine.run(
            steps=steps,
            values=values,
            feed=lambda step: random_values(program, seed + step, fed),
        )
    result.to_chrome_trace(write_to(output))
    if bundle is not None:
        _write_measured(bundle_dir, bundle, result, device)
        click.echo(f"wrote {bundle_dir}/measured_timeline.json ({steps} step(s))")
    click.echo(
        f"predicted {predicted.makespan_us:.0f} us, measured {result.makespan_us:.0f} us "
        f"(x{result.measured_over_predicted:.2f}); fast peak {format_size(result.fast_peak_bytes)}"
        f"; wrote {output}"
    )


def _bundle_of(folder: str, program, program_path: str):
    """The bundle in ``folder``, which must be of ``program``."""
    from dataflow.bundle import BundleError, read_bundle

    try:
        bundle = read_bundle(folder)
    except BundleError as exc:
        raise Failure(f"--bundle: {exc}") from None
    if bundle.program != program:
        raise Failure(
            f"--bundle {folder}: its program.json is not {program_path} (trace the bundle's "
            f"own program: dataflow trace {folder}/program.json ...)"
        )
    return bundle


def _write_measured(folder: str, bundle, result, device: str) -> None:
    """The measured timeline of ``result``'s steps beside the bundle, and the measured
    step in its summary."""
    import attrs

    from dataflow.bundle import Measured, measured_timeline, write_bundle

    steps = [result.to_timeline(step) for step in range(len(result.steps))]
    timeline = measured_timeline(
        bundle.program, steps, bundle.timeline, metadata={"device": device}
    )
    step_s = result.makespan_us / 1e6
    tokens = bundle.summary.tokens_step
    measured = Measured(
        step_s=step_s,
        steps=len(steps),
        device=device,
        fast_peak_bytes=result.fast_peak_bytes,
        tok_s=tokens / step_s if tokens and step_s > 0 else None,
        allocator_peak_bytes=result.allocator_peak_bytes,
    )
    summary = attrs.evolve(bundle.summary, measured=measured)
    write_bundle(folder, attrs.evolve(bundle, summary=summary, measured=timeline))
