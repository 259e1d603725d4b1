"""``dataflow train --optimizer NAME --optimizer-arg K=V``: the options and their check
(a registered optimizer, arguments typed and known to it, a precision it can keep)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import click


def optimizer_options(command: Callable) -> Callable:
    """Add ``--optimizer`` and ``--optimizer-arg`` (repeatable) to ``command``."""
    command = click.option(
        "--optimizer-arg",
        "optimizer_args",
        multiple=True,
        metavar="NAME=VALUE",
        help="an argument of the optimizer (repeatable), typed by its spec: e.g. "
        "--optimizer lion --optimizer-arg beta2=0.98 (`dataflow plugins list --hook "
        "dataflow_optimizers`; docs/finetuning.md lists the builtins' arguments)",
    )(command)
    return click.option(
        "--optimizer",
        default="adamw",
        show_default=True,
        help="the registered optimizer: adamw, muon (Muon for blocks' 2-D weights, AdamW for "
        "the rest), lion, adafactor, or a plugin's (the dataflow_optimizers hook)",
    )(command)


def check_optimizer(rest: dict[str, Any], device: str) -> None:
    """Resolve ``rest``'s optimizer arguments to a typed dict (a resumed run's manifest
    gives them as one already) and check the optimizer against the precision; a problem
    is one line naming ``--optimizer`` or ``--optimizer-arg`` and what would work."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.step.optimizers import optimizer_spec
    from dataflow_training.step.precision import for_optimizer

    try:
        spec = optimizer_spec(rest["optimizer"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--optimizer") from None
    given = rest["optimizer_args"]
    try:
        if isinstance(given, dict):  # a resumed run's, typed already: still its optimizer's?
            for name in given:
                spec.argument(name)
        else:
            rest["optimizer_args"] = spec.parse_args(given)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--optimizer-arg") from None
    policy = for_optimizer(
        rest["precision"],
        spec.name,
        device=device,
        dtype=rest["dtype"],
        states=rest["optimizer_states"],
    )
    try:
        policy.optimizer_policy(optimizer=spec.name, args=rest["optimizer_args"])
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--optimizer") from None
