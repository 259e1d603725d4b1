"""What trains, as ``dataflow train`` and ``dataflow predict`` take it: ``--lora`` with its
``--lora-*`` options, and ``--freeze`` (docs/finetuning.md), and their check."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click

#: the ``--lora*`` options after ``--lora`` itself (each needs ``--lora RANK``)
LORA_FIELDS = ("lora_alpha", "lora_dropout", "lora_targets", "lora_base")


def finetune_options(command: Callable) -> Callable:
    """Add ``--lora``, ``--lora-alpha``, ``--lora-dropout``, ``--lora-base``,
    ``--lora-targets`` and ``--freeze`` (repeatable) to ``command``."""
    options = [
        click.option(
            "--lora",
            type=click.IntRange(min=1),
            default=None,
            metavar="RANK",
            help="train LoRA adapters of this rank on a frozen base (docs/finetuning.md)",
        ),
        click.option(
            "--lora-alpha",
            type=click.FloatRange(min=0, min_open=True),
            default=None,
            help="LoRA's alpha: the adapters are scaled by alpha / rank  [default: 2 x rank]",
        ),
        click.option(
            "--lora-dropout",
            type=float,
            default=0.0,
            show_default=True,
            help="dropout on the adapters' input (the base sees it whole), a probability in [0, 1)",
        ),
        click.option(
            "--lora-base",
            type=click.Choice(["bf16", "int8", "nf4"]),
            default=None,
            help="how the frozen base's projections are stored: bf16, int8 (per row) or nf4 "
            "(4-bit NormalFloat, blocks of 64)  [default: the run's parameter dtype]",
        ),
        click.option(
            "--lora-targets",
            default=None,
            metavar="NAMES",
            callback=lambda ctx, param, value: tuple(value.split(",")) if value else (),
            help="comma-separated linears that get adapters, e.g. q_proj,v_proj  [default: "
            "every attention and MLP projection: q,k,v,o,gate,up,down_proj; GPT-2's "
            "c_attn,c_proj,c_fc]",
        ),
        click.option(
            "--freeze",
            multiple=True,
            metavar="PATTERN",
            help="parameters that do not train (repeatable): embed, head, layers.N, "
            "layers.A-B[.GLOB], or a glob over LAYER.PARAM names such as '*.self_attn.*' "
            "(docs/finetuning.md)",
        ),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def check_lora(rest: dict[str, Any]) -> Any:
    """The ``LoraConfig`` (``step.lora``) the ``--lora*`` options of ``rest`` make (None
    without ``--lora``), or a one-line usage error naming the option at fault."""
    # the step modules load when the command runs, not when `dataflow` lists its commands
    from dataflow_training.step.lora import LoraConfig

    if rest["lora"] is None:
        given = [f"--{n.replace('_', '-')}" for n in LORA_FIELDS if rest[n]]
        if given:
            raise click.UsageError(f"{', '.join(given)} needs --lora RANK")
        return None
    try:
        return LoraConfig(rest["lora"], *(rest[n] for n in LORA_FIELDS))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--lora") from None
