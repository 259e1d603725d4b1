"""``dataflow export`` (added by the training plugin), in one of three modes:

- ``--preset P [step options] --budget B -o DIR``: a planned training step as a bundle
  (docs/exporting_runs.md): the step ``dataflow train`` would run with the same options,
  priced by the profiling pass through its disk cache (``--pricing profile``; ``auto``
  takes it where a CUDA device is present) or by the ``--hw`` entry's roofline, planned
  as ``dataflow predict`` plans a cell, placed, simulated; ``--perfetto FILE`` also
  writes its Perfetto trace;
- ``--hf OUT --from CHECKPOINT``: a training checkpoint as a Hugging Face model folder
  (``--merge``: a LoRA run's adapters folded into its weights, ``drive.peft_export``);
- ``--peft OUT --from CHECKPOINT``: a LoRA run's adapters as PEFT's folder.
"""

from __future__ import annotations

import inspect
from pathlib import Path
from typing import Any

import attrs
import click

from dataflow import format_size, write_bundle
from dataflow.cli import BUDGET, COUNT, Device, Failure, OutputFile, one_line, write_perfetto
from dataflow_training.cli.predict_cli import measured_pricing
from dataflow_training.cli.verify_cli import _family, check_preset
from dataflow_training.drive.export import ExportError, export_cell
from dataflow_training.plan.hardware import HardwareError, hardware
from dataflow_training.plan.predict import Cell

PRICINGS = ("auto", "profile", "roofline")


@click.command("export")
@click.option("--preset", default=None, help="export a planned step of this preset (-o DIR)")
@click.option("--family", "family_name", default=None, help="default: the preset's family")
@click.option("--batch", default=8, show_default=True, type=COUNT)
@click.option("--seq-len", default=64, show_default=True, type=COUNT)
@click.option(
    "--vocab-size", default=None, type=COUNT, help="the model's vocabulary (default: the preset's)"
)
@click.option("--ga-rounds", "rounds", default=None, type=COUNT, help="accumulation rounds")
@click.option(
    "--tokens-step", default=None, type=COUNT, help="tokens per step (instead of --ga-rounds)"
)
@click.option("--dtype", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16"]))
@click.option("--clip", default=1.0, show_default=True, type=click.FloatRange(min=0))
@click.option("--budget", "budget_bytes", type=BUDGET, default=None, metavar="SIZE")
@click.option("--backing", "backing_bytes", type=BUDGET, default=None, metavar="SIZE")
@click.option("--recompute/--no-recompute", default=True, show_default=True)
@click.option("--pricing", default="auto", show_default=True, type=click.Choice(PRICINGS))
@click.option("--hw", default="h200", show_default=True, help="hardware entry (roofline)")
@click.option("--hw-file", "hw_files", multiple=True, type=click.Path(exists=True, dir_okay=False))
@click.option("--device", default=None, type=Device(), help="for --pricing profile")
@click.option(
    "--graph/--no-graph",
    default=True,
    show_default=True,
    help="profiled tasks timed as CUDA graph replays (as dataflow train replays steps)",
)
@click.option("--perfetto", "perfetto_out", default=None, type=OutputFile(), metavar="FILE")
@click.option("-o", "--output", "out_dir", default=None, type=click.Path(file_okay=False))
@click.option("--hf", "hf_out", default=None, type=click.Path(file_okay=False), help="folder")
@click.option(
    "--from",
    "checkpoint",
    default=None,
    type=click.Path(exists=True, file_okay=False),
    help="with --hf: a checkpoint folder (OUT/step_NNNNNN), or a run's OUT (its latest)",
)
@click.option(
    "--max-shard-size",
    "max_shard_bytes",
    type=BUDGET,
    default=None,
    metavar="SIZE",
    help="with --hf: shards of at most SIZE and their model.safetensors.index.json "
    "(default: one model.safetensors, as transformers writes up to 50GB)",
)
@click.option(
    "--peft",
    "peft_out",
    default=None,
    type=click.Path(file_okay=False),
    help="a LoRA run's adapters as PEFT's folder (adapter_model.safetensors and "
    "adapter_config.json); with --from",
)
@click.option(
    "--merge",
    is_flag=True,
    help="with --hf: fold a LoRA run's adapters into the weights (W + alpha/rank * B A)",
)
@click.option(
    "--no-tokenizer",
    is_flag=True,
    help="with --hf: write the weights and config only, not the run's tokenizer",
)
def export_command(
    preset,
    out_dir,
    hf_out,
    checkpoint,
    max_shard_bytes,
    peft_out,
    merge,
    no_tokenizer,
    **step: Any,
) -> None:
    """Write a planned training step as a bundle (--preset ... -o DIR), a training
    checkpoint as a Hugging Face model folder with its tokenizer (--hf OUT --from
    CHECKPOINT, --merge for a LoRA run's), or a LoRA run's adapters as PEFT's (--peft OUT
    --from CHECKPOINT)."""
    if merge and hf_out is None:
        raise click.UsageError("--merge goes with --hf OUT --from CHECKPOINT")
    if peft_out is not None:
        if hf_out is not None or preset is not None or out_dir is not None:
            raise click.UsageError("--peft OUT --from CHECKPOINT is a mode of its own")
        if checkpoint is None:
            raise click.UsageError("--peft and --from go together")
        _export_peft(peft_out, checkpoint)
        return
    if hf_out is not None or checkpoint is not None:
        if preset is not None or out_dir is not None:
            raise click.UsageError("--hf/--from and --preset/-o are two modes; give one")
        if hf_out is None or checkpoint is None:
            raise click.UsageError("--hf and --from go together")
        _export_hf(hf_out, checkpoint, max_shard_bytes, tokenizer=not no_tokenizer, merge=merge)
        return
    if max_shard_bytes is not None or no_tokenizer or merge:
        raise click.UsageError("--max-shard-size and --no-tokenizer go with --hf")
    if preset is None or out_dir is None:
        raise click.UsageError(
            "give --preset P ... -o DIR (a bundle) or --hf OUT --from CHECKPOINT"
        )
    click.echo(export_bundle(preset, out_dir, **step))


def _rounds(batch: int, seq_len: int, rounds: int | None, tokens_step: int | None) -> int:
    if rounds is not None and tokens_step is not None:
        raise click.UsageError("give --ga-rounds or --tokens-step, not both")
    if tokens_step is None:
        return rounds or 1
    t_round = batch * seq_len
    if tokens_step % t_round:
        raise click.BadParameter(
            f"{tokens_step} is not a multiple of the {t_round} tokens a round "
            f"(--batch {batch} x --seq-len {seq_len})",
            param_hint="--tokens-step",
        )
    return tokens_step // t_round


def export_bundle(
    preset: str,
    out_dir: str,
    *,
    family_name: str | None,
    batch: int,
    seq_len: int,
    vocab_size: int | None,
    rounds: int | None,
    tokens_step: int | None,
    dtype: str,
    clip: float,
    budget_bytes: int | None,
    backing_bytes: int | None,
    recompute: bool,
    pricing: str,
    hw: str,
    hw_files: tuple[str, ...],
    device: str | None,
    graph: bool,
    perfetto_out: str | None,
) -> str:
    """Write the bundle; return the line that says what was written."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.options import TrainOptions

    if budget_bytes is None:
        raise click.UsageError("--budget SIZE is needed with --preset (the fast-memory budget)")
    family_name, family, config = check_preset(preset, family_name, seq_len)
    rounds = _rounds(batch, seq_len, rounds, tokens_step)
    if vocab_size == getattr(config, "vocab_size", None):
        vocab_size = None  # the preset's own
    try:
        entry = hardware(hw, hw_files)
    except HardwareError as exc:
        raise click.BadParameter(one_line(str(exc)), param_hint="--hw") from None
    options = TrainOptions(
        family=family_name,
        preset=preset,
        steps=1,
        out=out_dir,
        batch=batch,
        rounds=rounds,
        seq_len=seq_len,
        dtype=dtype,
        clip=clip or None,
        overrides={} if vocab_size is None else {"vocab_size": vocab_size},
    )
    t_round = batch * seq_len
    cell = Cell(
        preset,
        t_round,
        seq_len,
        t_round * rounds,
        budget_bytes,
        backing_bytes,
        vocab_size=vocab_size,
    )
    priced: dict[str, Any] = {}
    cache = None
    if pricing == "profile" or (pricing == "auto" and _cuda_present()):
        priced, cache = measured_pricing(family, device, graph)
    try:
        bundle = export_cell(
            family,
            family_name,
            cell,
            entry,
            options.train_config(family),
            recompute=recompute,
            pricing=_pricing_label(priced, cache),
            **priced,
        )
    except ExportError as exc:
        raise Failure(f"--budget {format_size(budget_bytes)}: {exc}") from None
    if cache is not None and cache.misses:  # measured now: say so
        summary = attrs.evolve(bundle.summary, pricing="profiled")
        bundle = attrs.evolve(bundle, summary=summary)
    write_bundle(out_dir, bundle)
    summary = bundle.summary
    line = (
        f"wrote {out_dir}: {bundle.program.name}, {summary.step_s:.4g} s/step, "
        f"{summary.tok_s:,.0f} tok/s, fast peak {format_size(summary.fast_peak_bytes)} of "
        f"{format_size(budget_bytes)} (priced by {summary.pricing})"
    )
    if perfetto_out is not None:
        line += "\n" + write_perfetto(out_dir, perfetto_out)
    return line


def _cuda_present() -> bool:
    # torch loads when the command runs, not when `dataflow` lists its commands
    import torch

    return torch.cuda.is_available()


def _pricing_label(priced: dict[str, Any], cache: Any) -> str:
    if not priced:
        return "roofline"
    return "profiled" if cache is None else "profile cache"


def _read_from(checkpoint: str, option: str = "--from") -> tuple[str, Any, dict[str, Any]]:
    """(the checkpoint folder, its weights, its manifest) of ``--from`` (a checkpoint, or
    a run's folder: its latest)."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.checkpoint import (
        MANIFEST_FILE,
        CheckpointError,
        latest_checkpoint,
        read_checkpoint,
    )

    if not (Path(checkpoint) / MANIFEST_FILE).exists():  # a run's --out folder: its latest
        latest = latest_checkpoint(checkpoint)
        if latest is None:
            raise Failure(
                f"--from: {checkpoint} is neither a checkpoint (no {MANIFEST_FILE}) nor a "
                "run's folder with step_NNNNNN checkpoints in it"
            )
        checkpoint = str(latest)
    try:
        weights, _opt, manifest, _rng = read_checkpoint(checkpoint, weights_only=True)
    except CheckpointError as exc:
        raise Failure(f"--from: {one_line(str(exc))}") from None
    return checkpoint, weights, manifest


def _export_peft(peft_out: str, checkpoint: str) -> None:
    """``--peft OUT --from CHECKPOINT``: a LoRA run's adapters as PEFT's folder."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.peft_export import PeftExportError, lora_of, write_peft

    checkpoint, weights, manifest = _read_from(checkpoint)
    family = _family(manifest["family"])
    config = family.config(manifest["preset"], **manifest.get("overrides", {}))
    try:
        write_peft(peft_out, weights, lora_of(manifest, checkpoint), family, config)
    except (PeftExportError, ValueError) as exc:
        raise Failure(f"--peft {peft_out}: {one_line(str(exc))}") from None
    click.echo(
        f"wrote {peft_out} (adapter_model.safetensors, adapter_config.json) from "
        f"{checkpoint} (step {manifest['step']})"
    )


def _export_hf(
    hf_out: str,
    checkpoint: str,
    max_shard_bytes: int | None = None,
    *,
    tokenizer: bool = True,
    merge: bool = False,
) -> None:
    """``--hf OUT --from CHECKPOINT``: the weights and config (a LoRA run's adapters
    folded in with ``merge``), then the run's tokenizer (found and checked before
    anything is written)."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.peft_export import PeftExportError, adapted, lora_of, merged

    checkpoint, weights, manifest = _read_from(checkpoint)
    if merge:
        try:
            weights = merged(weights, lora_of(manifest, checkpoint))
        except PeftExportError as exc:
            raise Failure(f"--merge: {one_line(str(exc))}") from None
    elif adapted(weights):
        raise Failure(
            f"--hf {hf_out}: {checkpoint} holds LoRA adapters; give --merge to fold them "
            "into the weights, or export them with --peft OUT --from CHECKPOINT"
        )
    family = _family(manifest["family"])
    if not hasattr(family, "export_hf"):
        raise Failure(f"family {manifest['family']!r} has no Hugging Face export (export_hf)")
    hf_tokenizer = _run_tokenizer(manifest, Path(checkpoint)) if tokenizer else None
    config = family.config(manifest["preset"], **manifest.get("overrides", {}))
    shards = {}
    if max_shard_bytes is not None:
        if "max_shard_bytes" not in inspect.signature(family.export_hf).parameters:
            raise Failure(f"--max-shard-size: family {manifest['family']!r} writes no shards")
        shards["max_shard_bytes"] = max_shard_bytes
    try:
        family.export_hf(config, weights, hf_out, **shards)
    except (ValueError, KeyError) as exc:
        raise Failure(f"--hf {hf_out}: {one_line(str(exc))}") from None
    files = sorted(p.name for p in Path(hf_out).glob("*.safetensors"))
    what = f" ({files[0]})" if len(files) == 1 else ""
    if len(files) > 1:
        what = f" ({len(files)} shards and their index)"
    if hf_tokenizer is not None:
        hf_tokenizer.write(Path(hf_out))
        what += f" and the {hf_tokenizer.what}"
    elif tokenizer:
        what += " without a tokenizer (the run's data recorded none)"
    click.echo(f"wrote {hf_out}{what} from {checkpoint} (step {manifest['step']})")


def _run_tokenizer(manifest: dict[str, Any], checkpoint: Path) -> Any:
    """The checkpoint's run's tokenizer ready to write (None: the run recorded none)."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.tokenizer import HFTokenizer, TokenizerError

    try:
        return HFTokenizer.of_checkpoint(manifest, checkpoint)
    except TokenizerError as exc:
        raise Failure(f"--hf: {exc}") from None
