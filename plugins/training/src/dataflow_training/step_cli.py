"""``dataflow lower`` (a family's real training step as a Program file, for ``plan``,
``simulate`` and ``trace``) and ``dataflow export`` (a training checkpoint as a folder
the family's public format loads, e.g. ``transformers``)."""

from __future__ import annotations

import click

from dataflow.cli.errors import Failure, one_line
from dataflow.cli.options import COUNT, OutputFile
from dataflow_training.cli import _check_seq_len, _family, _preset_config


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
    from pathlib import Path

    from dataflow_training.config import DtypePolicy, TrainConfig
    from dataflow_training.lowering import lower
    from dataflow_training.train_cli import default_family

    family_name = family_name or default_family(preset)
    family = _family(family_name)
    _check_seq_len(_preset_config(family, family_name, preset), preset, seq_len)
    train = TrainConfig(
        seq_len=seq_len, batch=batch, rounds=rounds, dtype=DtypePolicy.named(dtype), clip=clip
    )
    program = lower(family, preset, train).program
    path = Path(output)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(program.to_json())
    click.echo(f"wrote {output}: {program.name}, {len(program.tasks)} tasks")


@click.command("export")
@click.option("--hf", "hf_out", required=True, type=click.Path(file_okay=False), help="folder")
@click.option(
    "--from",
    "checkpoint",
    required=True,
    type=click.Path(exists=True, file_okay=False),
    help="a checkpoint folder (OUT/step_NNNNNN)",
)
def export_command(hf_out, checkpoint) -> None:
    """Write a training checkpoint as a Hugging Face model folder."""
    from dataflow_training.checkpoint import CheckpointError, read_checkpoint

    try:
        weights, _opt, manifest, _rng = read_checkpoint(checkpoint)
    except CheckpointError as exc:
        raise Failure(f"--from: {one_line(str(exc))}") from None
    family = _family(manifest["family"])
    if not hasattr(family, "export_hf"):
        raise Failure(f"family {manifest['family']!r} has no Hugging Face export (export_hf)")
    config = family.config(manifest["preset"], **manifest.get("overrides", {}))
    try:
        family.export_hf(config, weights, hf_out)
    except (ValueError, KeyError) as exc:
        raise Failure(f"--hf {hf_out}: {one_line(str(exc))}") from None
    click.echo(f"wrote {hf_out} from {checkpoint} (step {manifest['step']})")
