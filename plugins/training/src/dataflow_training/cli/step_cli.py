"""``dataflow lower``: a family's real training step as a Program file, for ``plan``,
``simulate`` and ``trace``."""

from __future__ import annotations

from pathlib import Path

import click

from dataflow.cli import COUNT, OutputFile
from dataflow_training.cli.verify_cli import check_preset
from dataflow_training.step.config import DtypePolicy, TrainConfig
from dataflow_training.step.lowering import lower


@click.command("lower")
@click.option("--preset", required=True, help="a family preset, e.g. gpt2_124m")
@click.option("--family", "family_name", default=None, help="default: the preset's family")
@click.option("--batch", default=8, show_default=True, type=COUNT)
@click.option("--seq-len", default=64, show_default=True, type=COUNT)
@click.option("--ga-rounds", "rounds", default=1, show_default=True, type=COUNT)
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16"]))
@click.option("--clip", default=None, type=click.FloatRange(min=0, min_open=True))
@click.option("-o", "--output", required=True, type=OutputFile(), help="program JSON to write")
def lower_command(preset, family_name, batch, seq_len, rounds, dtype, clip, output) -> None:
    """Write one training step of a family preset as a bare Program (JSON)."""

    _, family, _ = check_preset(preset, family_name, seq_len)
    train = TrainConfig(
        seq_len=seq_len, batch=batch, rounds=rounds, dtype=DtypePolicy.named(dtype), clip=clip
    )
    program = lower(family, preset, train).program
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(program.to_json())
    click.echo(f"wrote {output}: {program.name}, {len(program.tasks)} tasks")
