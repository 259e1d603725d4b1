"""``dataflow kernels list``: every kernel variant, by op, in the order they are preferred."""

from __future__ import annotations

import json
from typing import Any

import click

from dataflow.plugins import Status, get_plugin_manager
from dataflow.registry import DuplicateNameError, KernelRegistry, KernelVariant, UnknownNameError


@click.group("kernels")
def kernels_group() -> None:
    """Inspect the kernel variants the installed plugins register."""


@kernels_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--op", "op", metavar="NAME", help="Only the variants of op NAME.")
@click.option(
    "--device",
    "device",
    metavar="DEVICE",
    help="Only variants that run on DEVICE (cpu, cuda, or any device a plugin names).",
)
def list_command(as_json: bool, op: str | None, device: str | None) -> None:
    """List each kernel variant: op, name, distribution, devices, whether it is
    deterministic, its priority and what it is. Within an op, variants come in the order
    they are preferred (highest priority first): with --device, the first of each op is
    the one `dataflow_training.step.ops.load_ops` picks for that device. DATAFLOW_KERNELS
    (OP=NAME,...) puts a variant first wherever it runs."""
    manager = get_plugin_manager()
    try:
        registry = manager.kernels()
    except DuplicateNameError as exc:
        raise click.ClickException(str(exc)) from None
    if device is not None and registry.names():
        devices = sorted({name for variant in registry for name in variant.devices})
        if device not in devices:
            raise click.BadParameter(
                f"no kernel variant runs on {device!r}; devices named: {', '.join(devices)}",
                param_hint="--device",
            )
    ops = sorted({variant.op for variant in registry}) if op is None else [op]
    rows = []
    for name in ops:
        try:
            variants = registry.for_op(name, device=device)
        except UnknownNameError as exc:
            raise click.BadParameter(_unknown_op(name, registry, exc), param_hint="--op") from None
        except ValueError as exc:  # a DATAFLOW_KERNELS pin that names no variant
            raise click.ClickException(str(exc)) from None
        rows += [_as_dict(registry, variant) for variant in variants]
    if as_json:
        click.echo(json.dumps({"variants": rows}, indent=2))
    else:
        _print_table(rows, device)
    broken = sorted({r.distribution for r in manager.reports() if r.status is Status.BROKEN})
    if broken:
        click.echo(
            f"warning: broken plugins, not loaded (their variants are missing): "
            f"{', '.join(broken)}; see `dataflow plugins list`",
            err=True,
        )


def _unknown_op(op: str, registry: KernelRegistry, exc: UnknownNameError) -> str:
    if registry.names():
        return str(exc)
    return (
        f"no kernel op named {op!r}: no kernel variants are registered at all; install a "
        "kernel package (pip install dataflow-kernels-torch) and see `dataflow plugins list`"
    )


def _as_dict(registry: KernelRegistry, variant: KernelVariant) -> dict[str, Any]:
    return {
        "op": variant.op,
        "name": variant.name,
        "distribution": registry.distribution_of(variant.key),
        "devices": list(variant.devices),
        "deterministic": variant.deterministic,
        "priority": variant.priority,
        "description": variant.description,
    }


def _print_table(rows: list[dict[str, Any]], device: str | None) -> None:
    if not rows:
        click.echo(
            "no kernel variants registered; install a kernel package "
            "(pip install dataflow-kernels-torch) and see `dataflow plugins list`"
        )
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    title = "dataflow kernel variants" + (f" on {device}" if device else "")
    table = Table(title=title)
    for column in ("Op", "Variant", "Distribution", "Devices", "Deterministic", "Priority"):
        table.add_column(column, overflow="fold")
    table.add_column("Description", overflow="fold", ratio=1)
    for index, row in enumerate(rows):
        last_of_op = index + 1 == len(rows) or rows[index + 1]["op"] != row["op"]
        table.add_row(
            escape(row["op"]),
            escape(row["name"]),
            escape(row["distribution"]),
            escape(", ".join(row["devices"])),
            "[green]yes[/]" if row["deterministic"] else "[yellow]no[/]",
            str(row["priority"]),
            escape(row["description"] or "-"),
            end_section=last_of_op,
        )
    Console().print(table)
