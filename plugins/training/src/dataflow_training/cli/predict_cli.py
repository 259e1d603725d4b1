"""``dataflow predict`` and ``dataflow measure`` (added by the training plugin).

Both take one grid (a preset; lists of T_round, sequence lengths and budgets; tokens per
step; a backing budget) and print one row per cell, as a table and, with ``--json``, as
``{"rows": [...]}``. ``predict`` simulates (instant with the roofline; ``--measured``
prices by the profiling pass through its disk cache); ``predict --ranks 1,2,8`` predicts
each cell as a member of data-parallel fleets of those sizes, the all-reduce priced on
the hardware entry's collective link; ``measure`` also runs each cell on the engine and
prints the measured step beside the prediction.
"""

from __future__ import annotations

import functools
import json
import sys
from pathlib import Path
from typing import Any

import click
from click.core import ParameterSource
from rich.console import Console
from rich.table import Table

from dataflow import format_size, parse_size, resolvers
from dataflow.cli import COUNT, Device, Failure, OutputFile, one_line
from dataflow_training.cli.finetune_options import check_lora, finetune_options
from dataflow_training.cli.optimizer_options import check_optimizer, optimizer_options
from dataflow_training.cli.predict_search import search_command
from dataflow_training.cli.train_defaults import default_device, default_family
from dataflow_training.cli.verify_cli import _family, optimizer_states_option, precision_option
from dataflow_training.drive.measure import measure
from dataflow_training.plan.hardware import HardwareError, hardware
from dataflow_training.plan.predict import Tuning, default_jobs, grid, predict, predict_fleet
from dataflow_training.step.config import ORDER_FORMS, parse_order
from dataflow_training.step.freezing import FreezeError
from dataflow_training.step.lora import LoraError
from dataflow_training.step.precision import precision


class IntList(click.ParamType):
    """``8192,32768``: whole numbers >= 1."""

    name = "N,N,..."

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        try:
            items = tuple(int(item) for item in str(value).split(","))
        except ValueError:
            self.fail(f"{value!r} is not a comma-separated list of whole numbers", param, ctx)
        if not items or min(items) < 1:
            self.fail(f"{value!r}: every entry must be >= 1", param, ctx)
        return items


class SizeList(click.ParamType):
    """``16,8,4``: sizes; a bare number is GiB (``512MiB`` for others)."""

    name = "SIZE,SIZE,..."

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[int, ...]:
        if isinstance(value, tuple):
            return value
        sizes = []
        for item in str(value).split(","):
            item = item.strip()
            try:
                size = parse_size(f"{item}GiB" if _bare_number(item) else item)
            except ValueError as exc:
                self.fail(one_line(str(exc)), param, ctx)
            if size < 1:
                self.fail(f"{item!r}: a budget must be > 0", param, ctx)
            sizes.append(size)
        return tuple(sizes)


class OrderList(click.ParamType):
    """Comma-separated ``TrainConfig.order`` values."""

    name = "ORDER,..."

    def convert(self, value: Any, param: Any, ctx: Any) -> tuple[str, ...]:

        if isinstance(value, tuple):
            return value
        orders = tuple(part.strip() for part in str(value).split(","))
        try:
            for order in orders:
                parse_order(order)
        except ValueError:
            self.fail(f"{value!r}: each order is one of {ORDER_FORMS}", param, ctx)
        return orders


def _bare_number(text: str) -> bool:
    try:
        float(text)
    except ValueError:
        return False
    return True


def _grid_options(command: Any, search: bool = False) -> Any:
    """The grid's options; with ``search`` (``predict``) the shape options are optional:
    without ``--t-round`` the step search chooses the shape."""
    shape = "" if not search else " (without --t-round: searched)"
    options = [
        click.option("--preset", required=True, help="a family preset, e.g. gpt2_124m"),
        click.option("--family", "family_name", default=None, help="default: the preset's"),
        click.option("--hw", default="h200", show_default=True, help="hardware table entry"),
        click.option(
            "--hw-file",
            "hw_files",
            multiple=True,
            type=click.Path(exists=True, dir_okay=False),
            help="a TOML file of more hardware entries (repeatable)",
        ),
        click.option(
            "--t-round",
            "t_rounds",
            required=not search,
            type=IntList(),
            help="tokens/round"
            + (" (without it: the step search, as dataflow train's)" if search else ""),
        ),
        click.option(
            "--tokens-step",
            required=not search,
            type=COUNT,
            help="tokens per optimizer step" + shape,
        ),
        click.option("--budget", "budgets", required=True, type=SizeList(), help="GiB each"),
        click.option("--seq-len", "seq_lens", required=not search, type=IntList(), help=shape),
        click.option(
            "--vocab-size",
            default=None,
            type=COUNT,
            help="the model's vocabulary (default: the preset's), as dataflow train --vocab-size",
        ),
        click.option("--backing", default=None, type=SizeList(), help="pinned host budget, GiB"),
        click.option(
            "--dtype", default="bf16", show_default=True, type=click.Choice(["bf16", "fp32"])
        ),
        optimizer_states_option("fp32"),
        precision_option(None, "Default: the plain update of --dtype and --optimizer-states."),
        click.option(
            "--order",
            "orders",
            default=None if search else "round",
            show_default=not search,
            type=OrderList(),
            help="the step's task order(s), e.g. round,layer,layer:4 (TrainConfig.order)"
            + (" [default: round; searched without --t-round]" if search else ""),
        ),
        click.option(
            "--recompute/--no-recompute",
            default=True,
            show_default=True,
            help="plan with the recompute planner (else PressureFit alone)",
        ),
        click.option("--json", "json_out", default=None, type=OutputFile(), help="rows as JSON"),
    ]
    for option in reversed(options):
        command = option(command)
    return command


def _setup(preset: str, family_name: str | None, hw_name: str, hw_files: tuple, backing: Any):
    family_name = family_name or default_family(preset)
    family = _family(family_name)
    presets = getattr(family, "presets", None)
    if presets is not None and preset not in presets:
        raise click.BadParameter(
            f"{family_name} has no preset {preset!r}; known: {', '.join(presets)}",
            param_hint="--preset",
        )
    try:
        hw = hardware(hw_name, hw_files)
    except HardwareError as exc:
        raise click.BadParameter(one_line(str(exc)), param_hint="--hw") from None
    if backing is not None and len(backing) != 1:
        raise click.BadParameter("give one backing budget", param_hint="--backing")
    return family, hw, backing[0] if backing else None


def _cells(preset, t_rounds, seq_lens, budgets, tokens_step, backing, orders, vocab_size):
    return grid(preset, t_rounds, seq_lens, budgets, tokens_step, backing, orders, vocab_size)


@click.command("predict")
@functools.partial(_grid_options, search=True)
@click.option("--measured", is_flag=True, help="price tasks by the profiling pass (its cache)")
@click.option("--device", default=None, type=Device(), help="for --measured; default cuda")
@click.option(
    "--ranks",
    "ranks",
    default=None,
    type=IntList(),
    help="predict each cell as one member of fleets of these sizes, e.g. 1,2,8",
)
@click.option(
    "--scope",
    default="nvlink",
    show_default=True,
    type=click.Choice(["nvlink", "network"]),
    help="with --ranks: the ranks share one host (nvlink) or are on several (network)",
)
@click.option(
    "--pack-documents",
    is_flag=True,
    help="a grid (--t-round) of dataflow train --pack-documents' step: each round's "
    "segments, priced as the dense step's work",
)
@click.option(
    "--jobs",
    default=None,
    type=click.IntRange(min=1),
    help="cells planned at once, each in its own process [default: the CPUs this may use]",
)
@click.option(
    "--vocab-pieces",
    default=None,
    type=click.IntRange(min=1),
    help="the vocabulary tables in N row pieces, as dataflow train --vocab-pieces  [default: "
    "searched without --t-round, else 1]",
)
@click.option(
    "--expert-shards",
    default=None,
    type=click.IntRange(min=1),
    help="each layer's routed experts in N shards, as dataflow train --expert-shards  "
    "[default: searched without --t-round, else the preset's]",
)
@finetune_options
@optimizer_options
def predict_command(
    preset,
    family_name,
    hw,
    hw_files,
    t_rounds,
    tokens_step,
    budgets,
    seq_lens,
    vocab_size,
    backing,
    orders,
    dtype,
    optimizer_states,
    precision,
    recompute,
    json_out,
    measured,
    device,
    ranks,
    scope,
    pack_documents,
    jobs,
    **trains,
) -> None:
    """Predict a grid of training steps from the simulator: one row per cell (with
    --ranks, one per cell and fleet size). Without --t-round: the step search of
    dataflow train, its choice and runner-up. What trains (--freeze, --lora) and by which
    optimizer (--optimizer) as dataflow train takes them."""
    policy = _policy_fields(precision, dtype, optimizer_states)
    tuning = _tuning(trains, policy, device or default_device())

    if t_rounds is None:
        if ranks is not None or pack_documents:
            which = "--ranks" if ranks is not None else "--pack-documents"
            raise click.UsageError(f"{which} predicts a grid: give --t-round too")
        source = click.get_current_context().get_parameter_source("hw")
        priced_by_hw = source is not ParameterSource.DEFAULT
        if not priced_by_hw and device is None and not measured and default_device() == "cpu":
            # profiling a large model's tasks on a CPU takes many minutes and its memory:
            # with no GPU here and no --device, the prediction is for the --hw entry's
            priced_by_hw = True
            click.echo(
                f"predict: no CUDA device here: the search is priced for the hardware entry "
                f"'{hw}' (--hw); --device cpu prices it for this CPU by measurement",
                err=True,
            )
        search_command(
            preset, family_name, hw if priced_by_hw else None,
            hw_files, tokens_step, budgets, seq_lens, vocab_size, backing, orders, policy,
            recompute, json_out, measured_pricing if measured else None, device, tuning,
        )  # fmt: skip
        return
    missing = [
        name for name, v in (("--tokens-step", tokens_step), ("--seq-len", seq_lens)) if v is None
    ]
    if missing:
        raise click.UsageError(f"a grid (--t-round) needs {' and '.join(missing)} too")
    orders = orders or ("round",)
    family, entry, backing = _setup(preset, family_name, hw, hw_files, backing)
    options: dict[str, Any] = {"recompute": recompute, "dtype": dtype, "states": optimizer_states}
    options["segments"] = pack_documents
    options["precision"] = precision
    options["tuning"] = tuning
    if ranks is not None:
        _check_scope(entry, scope)
    if measured:
        options |= _measured_pricing(family, device)
    cells = _cells(preset, t_rounds, seq_lens, budgets, tokens_step, backing, orders, vocab_size)
    try:
        if ranks is None:
            rows = predict(family, cells, entry, jobs=jobs or default_jobs(), **options)
        else:
            rows = predict_fleet(family, cells, entry, ranks, scope=scope, **options)
    except (FreezeError, LoraError) as exc:  # a pattern or a target the model lacks
        raise Failure(one_line(str(exc))) from None
    if ranks is None:
        _print_predicted(rows, _predicted_for(entry.name, measured, device), preset)
    else:
        _print_fleet(rows, entry.name, preset, scope)
    _write(json_out, rows, "predict")


def _policy_fields(name: str | None, dtype: str, states: str) -> dict[str, Any]:
    """``TrainOptions``' precision fields: ``--precision`` with the pins given beside it
    (refused in one line where they differ from its own), or without it the plain update
    of ``--dtype`` and ``--optimizer-states``."""
    if _checked_precision(name) is None:
        return {"dtype": dtype, "optimizer_states": states}
    return {"precision": name, **_given_pins()}


def _tuning(trains: dict[str, Any], policy: dict[str, Any], device: str) -> Tuning:
    """What trains and by which optimizer (``plan.predict.Tuning``), from ``--freeze``,
    the ``--lora*`` options and ``--optimizer``/``--optimizer-arg``, checked as ``dataflow
    train`` checks them (one line naming the option at fault)."""
    lora = check_lora(trains)
    rest = {"precision": "auto", "dtype": None, "optimizer_states": None} | policy
    rest |= {"optimizer": trains["optimizer"], "optimizer_args": trains["optimizer_args"]}
    check_optimizer(rest, device)
    return Tuning(
        freeze=trains["freeze"],
        lora=lora,
        optimizer=rest["optimizer"],
        optimizer_args=rest["optimizer_args"],
        vocab_pieces=trains["vocab_pieces"],
        expert_shards=trains["expert_shards"],
    )


def _checked_precision(name: str | None) -> str | None:
    """``--precision`` where given, refused in one line when a ``--dtype`` or
    ``--optimizer-states`` given beside it differs from its own."""
    if name is None:
        return None
    pins = _given_pins()
    try:
        precision(name, dtype=pins.get("dtype"), states=pins.get("optimizer_states"))
    except ValueError as exc:
        raise click.BadParameter(str(exc), param_hint="--precision") from None
    return name


def _given_pins() -> dict[str, str]:
    """``--dtype`` and ``--optimizer-states`` where the command line gives them (their
    defaults are the plain update's, not pins beside ``--precision``)."""
    ctx = click.get_current_context()
    return {
        key: ctx.params[key]
        for key in ("dtype", "optimizer_states")
        if ctx.get_parameter_source(key) is not ParameterSource.DEFAULT
    }


def _check_scope(entry: Any, scope: str) -> None:

    try:
        entry.collective_link(2, scope)
    except HardwareError as exc:
        raise click.BadParameter(one_line(str(exc)), param_hint="--scope") from None


def _print_fleet(rows: list[dict[str, Any]], hw: str, preset: str, scope: str) -> None:
    table = Table(
        "seq", "T_round", "budget", "ranks", "s/step", "tok/s a rank", "fleet tok/s",
        "all-reduce ms", "exposed ms", "hidden ms", "scaling eff",
        title=f"{preset} fleets predicted for hardware entry {hw} ({scope})",
    )  # fmt: skip
    for row in rows:
        if not row["feasible"]:
            table.add_row(*_cell_columns(row), str(row["ranks"]), f"[red]{row['reason']}")
            continue
        efficiency = row["scaling_efficiency"]
        table.add_row(
            *_cell_columns(row),
            str(row["ranks"]),
            f"{row['step_s']:.4f}",
            f"{row['tok_s']:,.0f}",
            f"{row['fleet_tok_s']:,.0f}",
            f"{row['allreduce_s'] * 1e3:.2f}",
            f"{row['allreduce_exposed_s'] * 1e3:.2f}",
            f"{row['allreduce_hidden_s'] * 1e3:.2f}",
            "-" if efficiency is None else f"{efficiency:.3f}",
        )
    Console(width=200).print(table)


def _measured_pricing(family: Any, device: str | None) -> dict[str, Any]:
    return measured_pricing(family, device)[0]


def measured_pricing(
    family: Any, device: str | None, graph: bool = False
) -> tuple[dict[str, Any], Any]:
    """``plan_cell``'s options that price by the profiling pass through its disk cache on
    ``device`` (timed as graph replays with ``graph``), and that cache (None when off)."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.plan.profile import ProfileCache, profile_program

    device = device or default_device()
    graph = graph and device.startswith("cuda")
    cache = ProfileCache.for_device(device, "torch", graph=graph, family=family)

    def measure(step: Any) -> dict:
        build = resolvers().get("torch").build(step)
        return profile_program(step, build, device=device, cache=cache, graph=graph)

    options: dict[str, Any] = {"measure": measure}
    if device.startswith("cuda"):
        # torch loads when the command runs, not when `dataflow` lists its commands
        from dataflow import runtime_reserve_bytes

        options["reserve_bytes"] = runtime_reserve_bytes(device)
    return options, cache


@click.command("measure")
@_grid_options
@click.option("--steps", default=5, show_default=True, type=COUNT, help="steps run per cell")
@click.option("--warmup", default=2, show_default=True, type=click.IntRange(min=0))
@click.option("--device", default=None, type=Device(), help="default: cuda when present")
@click.option("--seed", default=0, show_default=True)
@click.option(
    "--resolver",
    default="auto",
    show_default=True,
    help="the registered resolver that runs the tasks; auto: torch-compiled on CUDA, torch "
    "elsewhere (as dataflow train)",
)
def measure_command(
    preset,
    family_name,
    hw,
    hw_files,
    t_rounds,
    tokens_step,
    budgets,
    seq_lens,
    vocab_size,
    backing,
    orders,
    dtype,
    optimizer_states,
    precision,
    recompute,
    json_out,
    steps,
    warmup,
    device,
    seed,
    resolver,
) -> None:
    """Run a grid of training steps on the engine, each beside its prediction."""
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.run import resolver_for

    if warmup >= steps:
        raise click.BadParameter(
            f"--warmup {warmup} leaves no measured step of --steps {steps}", param_hint="--warmup"
        )
    family, entry, backing = _setup(preset, family_name, hw, hw_files, backing)
    cells = _cells(preset, t_rounds, seq_lens, budgets, tokens_step, backing, orders, vocab_size)
    device = device or default_device()
    try:
        resolver = resolver_for(resolver, device)
    except ValueError as exc:
        raise click.BadParameter(
            str(exc).removeprefix("--resolver "), param_hint="--resolver"
        ) from None

    def label(seq_len: int, t_round: int, budget_bytes: int) -> str:
        return f"seq {seq_len} T_round {t_round} budget {format_size(budget_bytes)}"

    def progress(row: dict[str, Any]) -> None:
        what = f"{row['ratio']:.3f}" if row["feasible"] else row["reason"]
        click.echo(
            f"{label(row['seq_len'], row['t_round'], row['budget_bytes'])}: {what}", err=True
        )

    def on_event(cell: Any, line: str) -> None:  # a cell's planning and steps, as they end
        click.echo(f"{label(cell.seq_len, cell.t_round, cell.budget_bytes)}: {line}", err=True)

    rows = measure(
        family,
        cells,
        entry,
        device=device,
        steps=steps,
        warmup=warmup,
        recompute=recompute,
        dtype=dtype,
        states=optimizer_states,
        precision=_checked_precision(precision),
        seed=seed,
        resolver=resolver,
        progress=progress,
        on_event=on_event,
    )
    _print_measured(rows, preset, device)
    _write(json_out, rows, "measure")


def _write(path: str | None, rows: list[dict[str, Any]], command: str) -> None:
    if path is None:
        return
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    document = {"command": " ".join(["dataflow", command, *sys.argv[2:]]), "rows": rows}
    out.write_text(json.dumps(document, indent=1) + "\n")
    click.echo(f"wrote {path}: {len(rows)} rows", err=True)


def _cell_columns(row: dict[str, Any]) -> list[str]:
    budget = format_size(row["budget_bytes"])
    kind, group = parse_order(row.get("order", "round"))
    if kind != "round":
        budget += " (layers)" if group is None else f" (layers, {group} rounds a group)"
    return [str(row["seq_len"]), str(row["t_round"]), budget]


def _predicted_for(hw: str, measured: bool, device: str | None) -> str:
    """What ``dataflow predict``'s figures are for: the hardware entry, or (``--measured``)
    tasks timed on the device with the entry's links."""
    if measured:
        return f"tasks measured on {device or default_device()}, links of hardware entry {hw}"
    return f"predicted for hardware entry {hw}, not measured here"


def _print_predicted(rows: list[dict[str, Any]], predicted_for: str, preset: str) -> None:
    table = Table(
        "seq", "T_round", "budget", "s/step", "tok/s", "eff TF/s", "hw TF/s", "fast peak",
        "backing peak", "h2d GB", "d2h GB", "link % h2d/d2h", "recompute %", "idle %",
        "recomputed", title=f"{preset} ({predicted_for})",
    )  # fmt: skip
    for row in rows:
        if not row["feasible"]:
            table.add_row(*_cell_columns(row), f"[red]infeasible: {row['reason']}")
            continue
        table.add_row(
            *_cell_columns(row),
            f"{row['step_s']:.4f}",
            f"{row['tok_s']:,.0f}",
            f"{row['effective_tflops']:.1f}",
            f"{row['hardware_tflops']:.1f}",
            format_size(row["fast_peak_bytes"]),
            format_size(row["backing_peak_bytes"]),
            f"{row['h2d_gb']:.2f}",
            f"{row['d2h_gb']:.2f}",
            f"{row['h2d_link_pct']:.0f}/{row['d2h_link_pct']:.0f}",
            f"{row['recompute_pct']:.1f}",
            f"{row['compute_idle_pct']:.1f}",
            _recomputed(row),
        )
    Console(width=200).print(table)


def _recomputed(row: dict[str, Any]) -> str:
    if not row["recomputed_units"]:
        return "none"
    layers = ",".join(row["recomputed_layers"])
    text = f"blocks {layers}: {row['recomputed_units']} units of {row['rounds']} rounds"
    partial = row.get("partial_units", 0)
    return text + (f" ({partial} partial)" if partial else "")


def _print_measured(rows: list[dict[str, Any]], preset: str, device: str) -> None:
    table = Table(
        "seq", "T_round", "budget", "predicted s", "measured s", "ratio", "tok/s",
        "allocator peak", "recomputed", title=f"{preset} on {device} (predicted from tasks "
        "and links measured there)",
    )  # fmt: skip
    for row in rows:
        if not row["feasible"]:
            table.add_row(*_cell_columns(row), f"[red]infeasible: {row['reason']}")
            continue
        peak = row["allocator_peak_bytes"]
        table.add_row(
            *_cell_columns(row),
            f"{row['predicted_step_s']:.4f}",
            f"{row['measured_step_s']:.4f}",
            f"{row['ratio']:.3f}",
            f"{row['measured_tok_s']:,.0f}",
            format_size(peak) if peak is not None else "-",
            _recomputed(row),
        )
    Console(width=200).print(table)
