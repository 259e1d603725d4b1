"""``dataflow verify``: the correctness ladder as a command (added by the training plugin).

Every option is checked before any check runs: counts >= 1, a budget > 0 that the step
can be planned into, an installed family and one of its presets, a sequence length the
preset's model takes, a device that exists. Progress goes to stderr level by level; the
table of checks to stdout; exit 1 when a check fails.
"""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import attrs
import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from dataflow import families, format_size, minimal_budget
from dataflow.cli import BUDGET, COUNT, Device, Failure, lookup, one_line, plugin_failure
from dataflow_training.check.verify_checks import YARDSTICK_FACTOR, YARDSTICK_LOSS_SCALES
from dataflow_training.cli.train_defaults import default_family
from dataflow_training.drive.progress import LevelPrinter
from dataflow_training.plan.compiled_step import available_host_bytes
from dataflow_training.step.config import STATE_CHOICES, parse_order
from dataflow_training.step.lowering import lower
from dataflow_training.step.precision import CHOICES as PRECISIONS
from dataflow_training.step.precision import precision as precision_of

#: Config fields under which a family may declare the longest sequence its model takes.
MAX_SEQ_LEN_FIELDS = ("max_seq_len", "n_positions", "max_position_embeddings")


def budget_option(help_text: str):
    """``--budget SIZE`` into ``budget_bytes`` (None when not given)."""
    return click.option(
        "--budget", "budget_bytes", type=BUDGET, default=None, metavar="SIZE", help=help_text
    )


class Order(click.ParamType):
    """One ``TrainConfig.order``: round, layer or layer:K."""

    name = "ORDER"

    def convert(self, value: Any, param: Any, ctx: Any) -> str:

        try:
            parse_order(value)
        except ValueError as exc:
            self.fail(str(exc), param, ctx)
        return str(value)


def order_option(default: str | None = "round", more: str = "") -> Any:
    """``--order round|layer|layer:K``: ``TrainConfig.order`` (``default`` None: the
    step search's, ``more`` said in the help)."""
    return click.option(
        "--order",
        type=Order(),
        default=default,
        show_default=default is not None,
        help="the step's task order: each round through every layer (round), every round "
        "through each layer (layer: weights read once a step; for models larger than the "
        "budget), or that in groups of K rounds (layer:K: less host memory for activations)" + more,
    )


def optimizer_states_option(default: str | None = None) -> Any:
    """``--optimizer-states fp32|bf16|int8``: the dtype of the optimizer's state
    (``config.optimizer_states``); with ``--precision`` an expert pin."""
    return click.option(
        "--optimizer-states",
        "optimizer_states",
        type=click.Choice(list(STATE_CHOICES)),
        default=default,
        show_default=default is not None,
        help="expert pin: the dtype of AdamW's two moments, a plain update (bf16 halves "
        "their memory and their traffic over the host link; int8 keeps them block-wise "
        "quantized, 2.03 B/param for both, AdamW only; fp32 keeps them exact); "
        "--precision names the whole policy",
    )


def precision_option(default: str | None, help_text: str) -> Any:
    """``--precision auto|bf16|bf16-plain|mixed|fp32``: the whole dtype policy
    (``step.precision``)."""
    choices = PRECISIONS if default == "auto" else PRECISIONS[1:]
    return click.option(
        "--precision",
        type=click.Choice(choices),
        default=default,
        show_default=default is not None,
        help="bf16: bf16 weights, grads, activations and AdamW moments, the update's "
        "rounding compensated (10 B/param); bf16-plain: the same uncompensated (8); mixed: "
        "bf16 compute with fp32 master weights and moments (16); fp32: everything float32 "
        f"(16). {help_text}",
    )


@click.command("verify")
@click.option("--family", "family_name", required=True, help="an installed model family")
@click.option("--preset", required=True, help="one of the family's presets")
@click.option("--device", default="cpu", show_default=True, type=Device(), help="cpu or cuda")
@click.option(
    "--dtype", "policy", default="fp32", show_default=True, type=click.Choice(["fp32", "bf16"])
)
@precision_option(
    None,
    "The step level runs the policy's update and state (its dtype is --dtype's). Default: "
    "--dtype with a plain update and fp32 moments.",
)
@click.option(
    "--steps",
    default=3,
    show_default=True,
    type=COUNT,
    help="consecutive training steps compared (on CUDA the second on are graph replays)",
)
@click.option(
    "--rounds", default=2, show_default=True, type=COUNT, help="accumulation rounds per step"
)
@click.option("--batch", default=2, show_default=True, type=COUNT)
@click.option("--seq-len", default=16, show_default=True, type=COUNT)
@budget_option("fast-memory budget for the step runs (e.g. 2GiB; default: unbounded)")
@click.option("--seed", default=0, show_default=True)
@order_option()
@click.option(
    "--yardstick/--no-yardstick",
    default=True,
    show_default=True,
    help="with --dtype bf16: also compute each step's gradients by plain bf16 autograd of "
    f"the family's reference model ({len(YARDSTICK_LOSS_SCALES)} times, the loss scaled "
    "differently), and let a gradient check pass within "
    f"{YARDSTICK_FACTOR:g} x their largest error against float64 where this is above the "
    "flat tolerance (what bf16 itself loses on the tensor). Costs "
    f"{len(YARDSTICK_LOSS_SCALES)} more bf16 forwards and backwards of the whole model per "
    "step on --device, with its memory there beside the run's. --no-yardstick: the flat "
    "tolerance alone",
)
@click.option(
    "--all",
    "show_all",
    is_flag=True,
    help="list every check (default: the failed ones and, per level, the closest to its tolerance)",
)
@click.option(
    "--json",
    "json_path",
    type=click.Path(dir_okay=False, writable=True),
    default=None,
    help="also write every check to this file as JSON (level, name, max_abs, rel, "
    "tolerance, abs_tolerance, yardstick, effective_tolerance, ok), failed or not",
)
@click.option(
    "--levels",
    default="op,task,step",
    show_default=True,
    callback=lambda ctx, param, value: _levels(value),
    help="which levels run, comma-separated (e.g. step: a full-size preset's step checks "
    "alone, its op and task checks being the same kernels at any size)",
)
@click.option(
    "--resolver",
    default="torch",
    show_default=True,
    help="the registered resolver that runs the engine's tasks in the step level: torch "
    "(eager), torch-compiled (each block kind's math compiled), or auto (what `dataflow "
    "train` runs: torch-compiled on CUDA, torch elsewhere)",
)
def verify_command(
    family_name,
    preset,
    device,
    policy,
    steps,
    rounds,
    batch,
    seq_len,
    budget_bytes,
    seed,
    order,
    yardstick,
    show_all,
    json_path,
    levels,
    resolver,
    precision,
) -> None:
    """Compare ops, tasks and whole training steps against the family's reference."""

    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.check.verify import verify

    family = _family(family_name)
    config = _preset_config(family, family_name, preset)
    _check_seq_len(config, preset, seq_len)
    policy = _policy_of(precision, policy)
    if json_path is not None:
        _check_writable(json_path)
    if "step" in levels:
        _check_host_memory(family, config, preset, device)
    if budget_bytes is not None:
        _check_budget(
            family,
            preset,
            policy,
            budget_bytes,
            batch=batch,
            seq_len=seq_len,
            rounds=rounds,
            order=order,
            precision=precision,
        )
    checks = verify(
        family_name,
        preset,
        device=device,
        policy=policy,
        steps=steps,
        rounds=rounds,
        batch=batch,
        seq_len=seq_len,
        budget_bytes=budget_bytes,
        seed=seed,
        progress=LevelPrinter(),
        order=order,
        yardstick=yardstick,
        levels=levels,
        resolver=resolver,
        precision=precision,
    )
    if json_path is not None:
        _write_checks(json_path, checks)
    shown = checks if show_all else _verify_summary(checks)
    title = (
        "every check"
        if show_all
        else "failed checks and, per level, the closest to its tolerance (--all: every check)"
    )
    table = Table("level", "check", "max |diff|", "rel error", "tolerance", "", title=title)
    for check in shown:
        table.add_row(
            check.level,
            check.name,
            f"{check.max_abs:.2e}",
            f"{check.rel:.2e}",
            _tolerance_cell(check),
            "[green]ok" if check.ok else "[red]FAIL",
        )
    # a report written to a file keeps each check's name on one line (rich takes 80
    # columns where there is no terminal, and the names are longer than its column)
    console = Console(width=None if sys.stdout.isatty() else 200)
    console.print(table)
    failed = [check for check in checks if not check.ok]
    console.print(f"{len(checks) - len(failed)} passed, {len(failed)} failed")
    if failed:
        names = ", ".join(f"{check.level} {check.name}" for check in failed[:3])
        more = f" and {len(failed) - 3} more" if len(failed) > 3 else ""
        raise Failure(f"{len(failed)} of {len(checks)} checks failed: {names}{more}")


def _policy_of(precision: str | None, dtype: str) -> str:
    """The dtype policy (tolerances, weights) of ``--precision``'s weights where it is
    given, ``--dtype`` otherwise; a ``--dtype`` given beside it must agree."""
    if precision is None:
        return dtype
    ctx = click.get_current_context()
    given = ctx.get_parameter_source("policy") is not ParameterSource.DEFAULT
    try:
        chosen = precision_of(precision, dtype=dtype if given else None)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--precision") from None
    return "fp32" if chosen.dtype.param == "float32" else "bf16"


def _levels(text: str) -> tuple[str, ...]:
    """``--levels``: known level names, at least one."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.check.verify import check_levels

    named = tuple(dict.fromkeys(part.strip() for part in text.split(",") if part.strip()))
    try:
        check_levels(named)
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--levels") from None
    return named


def _check_writable(path: str) -> None:
    """``--json``'s folder exists and takes a file, checked before any check runs."""

    folder = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(folder) or not os.access(folder, os.W_OK):
        raise click.BadParameter(
            f"cannot write {path}: no such writable folder", param_hint="--json"
        )


def _write_checks(path: str, checks: list) -> None:
    """Every check as one JSON record (``--json``), written before the table, so that a
    failed run leaves it too."""

    rows = [
        attrs.asdict(c) | {"effective_tolerance": c.effective_tolerance, "ok": c.ok} for c in checks
    ]
    try:
        with open(path, "w") as out:
            json.dump(rows, out, indent=0)
    except OSError as error:
        raise Failure(f"--json: cannot write {path}: {error.strerror}") from None


def _verify_summary(checks: list) -> list:
    """The failed checks, and each level's passing check nearest its tolerance, in the
    ladder's order."""
    closest: dict[str, Any] = {}
    for check in checks:
        if check.ok:
            best = closest.get(check.level)
            if best is None or _closeness(check) > _closeness(best):
                closest[check.level] = check
    keep = {id(c) for c in closest.values()}
    return [c for c in checks if not c.ok or id(c) in keep]


def _closeness(check: Any) -> float:
    tolerance = check.effective_tolerance
    return check.rel / tolerance if tolerance else 0.0


def _tolerance_cell(check: Any) -> str:
    """``5e-02``; ``5e-02 or 2 x 4.1e-02`` where the yardstick raised it; with ``or
    |diff| <= ...`` where an absolute tolerance also applies."""
    cell = f"{check.tolerance:.0e}"
    if check.effective_tolerance > check.tolerance:
        cell += f" or {YARDSTICK_FACTOR:g} x {check.yardstick:.1e}"
    if check.abs_tolerance:
        cell += f" or |diff| <= {check.abs_tolerance:.0e}"
    return cell


def _family(name: str) -> Any:

    spec = lookup(families(), name, "--family")
    try:
        return spec.load()
    except Exception as exc:  # the family plugin's own failure: name it
        raise plugin_failure(f"family {name!r} cannot be loaded", exc) from exc


def _preset_config(family: Any, family_name: str, preset: str) -> Any:
    presets = getattr(family, "presets", None)
    if presets is not None and preset not in presets:
        raise click.BadParameter(
            f"{family_name} has no preset {preset!r}; known: {', '.join(presets)}",
            param_hint="--preset",
        )
    try:
        return family.config(preset)
    except (KeyError, ValueError) as exc:
        raise click.BadParameter(one_line(str(exc)), param_hint="--preset") from exc


def _check_seq_len(config: Any, preset: str, seq_len: int) -> None:
    for field in MAX_SEQ_LEN_FIELDS:
        longest = getattr(config, field, None)
        if isinstance(longest, int) and seq_len > longest:
            raise click.BadParameter(
                f"{seq_len} is longer than preset {preset!r} takes ({field} = {longest}); "
                f"give at most {longest}",
                param_hint="--seq-len",
            )


def check_preset(preset: str, family_name: str | None, seq_len: int) -> tuple[str, Any, Any]:
    """The checks a command that lowers a preset runs on ``--preset``, ``--family`` and
    ``--seq-len``: the family (default: the one installed family that has the preset)
    loads and has the preset, whose model takes ``seq_len``. Returns ``(family name,
    family, config)``; a bad option raises ``click.BadParameter`` naming it."""
    family_name = family_name or default_family(preset)
    family = _family(family_name)
    config = _preset_config(family, family_name, preset)
    _check_seq_len(config, preset, seq_len)
    return family_name, family, config


def _check_host_memory(family: Any, config: Any, preset: str, device: str) -> None:
    """Fail before any check runs when the step level would need more host memory than is
    available (``verify.step_host_bytes``: about that on the CPU, at least that on CUDA):
    it would be killed for memory after minutes of work rather than fail."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.check.verify import (
        CPU_STEP_BYTES_PER_PARAM,
        CUDA_STEP_BYTES_PER_PARAM,
        model_params,
        step_host_bytes,
    )

    available = available_host_bytes()
    need = step_host_bytes(family, config, device)
    if available is None or need <= available:
        return
    params = model_params(family, config)
    if device == "cpu":
        what = (
            f"the step level on the CPU needs about {format_size(need)} of host memory "
            f"({params:,} parameters at about {CPU_STEP_BYTES_PER_PARAM} bytes each: a "
            "float64 reference with its AdamW state beside the engine's run)"
        )
        hint = "Run it with --device cuda on a larger host, or"
    else:
        what = (
            f"the step level's float64 reference alone needs at least {format_size(need)} "
            f"of host memory ({params:,} parameters at {CUDA_STEP_BYTES_PER_PARAM} bytes "
            "each: its weights, gradients and AdamW state, and each step's gradients and "
            "weights)"
        )
        hint = "Run it on a host with more memory, or"
    raise Failure(
        f"--preset {preset}: {what}; this host has {format_size(available)} available. "
        f"{hint} the op and task levels alone (--levels op,task)"
    )


def _check_budget(family: Any, preset: str, policy: str, budget_bytes: int, **shape: Any) -> None:
    """Fail before any check runs when the step cannot be planned into ``budget_bytes``."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.check.verify import follows_routing, step_config

    train = step_config(policy, **shape)  # precision, if any, in shape
    keep = follows_routing(family)  # as step_checks lowers it
    program = lower(family, preset, train, keep_grads=True, keep_aux_temp=keep).program
    smallest = minimal_budget(program)
    if budget_bytes < smallest:
        raise Failure(
            f"--budget {format_size(budget_bytes)} is too small for this step "
            f"({program.name}): the smallest budget that works is {format_size(smallest)} "
            f"({smallest} bytes)"
        )
