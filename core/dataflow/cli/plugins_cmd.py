"""``dataflow plugins list``: every plugin, its distribution, hooks, registered names, status."""

from __future__ import annotations

import json
from typing import Any

import click

from dataflow.cli.errors import Failure
from dataflow.plugins import PluginReport, Status, get_plugin_manager, hook_names


@click.group("plugins")
def plugins_group() -> None:
    """Inspect the installed plugins."""


@plugins_group.command("list")
@click.option("--json", "as_json", is_flag=True, help="Print JSON instead of a table.")
@click.option("--hook", "hook", metavar="NAME", help="Only plugins that implement hook NAME.")
def list_command(as_json: bool, hook: str | None) -> None:
    """List each plugin: distribution, version, entry point, hooks, names it registers,
    and whether it is ok, broken (and why) or disabled by the allowlist."""
    if hook is not None and hook not in hook_names():
        raise click.BadParameter(
            f"unknown hook {hook!r}; known hooks: {', '.join(hook_names())}",
            param_hint="--hook",
        )
    manager = get_plugin_manager()
    reports = [r for r in manager.reports() if hook is None or hook in r.hooks]
    conflicts = [str(conflict) for conflict in manager.conflicts()]
    unmatched = [
        f"the allowlist names {name!r}, but no installed distribution has a dataflow entry point"
        f" by that name"
        for name in manager.unmatched_allow
    ]
    if as_json:
        payload = {
            "plugins": [_as_dict(report) for report in reports],
            "conflicts": conflicts,
            "warnings": unmatched,
        }
        click.echo(json.dumps(payload, indent=2))
    else:
        _print_table(reports, hook)
        for line in unmatched:
            click.echo(f"warning: {line}", err=True)
        for line in conflicts:
            click.echo(f"conflict: {line}")
    if conflicts:
        raise Failure(
            f"{len(conflicts)} name conflict(s) among the installed plugins"
            + ("" if as_json else ", listed above")
            + f": {conflicts[0]}"
        )


def _as_dict(report: PluginReport) -> dict[str, Any]:
    return {
        "name": report.name,
        "distribution": report.distribution,
        "version": report.version,
        "entry_point": report.entry_point,
        "hooks": list(report.hooks),
        "registers": {kind: list(names) for kind, names in report.registers.items()},
        "status": report.status.value,
        "reason": report.reason,
    }


_STYLE = {Status.OK: "green", Status.BROKEN: "bold red", Status.DISABLED: "yellow"}


def _print_table(reports: list[PluginReport], hook: str | None) -> None:
    if not reports:
        click.echo(f"no plugin implements {hook}" if hook else "no plugins")
        return
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    table = Table(title="dataflow plugins")
    for column in ("Distribution", "Entry point", "Hooks", "Registers"):
        table.add_column(column, overflow="fold")
    # A status (a broken plugin's reason) is what a reader looks for: keep it on one line
    # when it can be, however long the lists of registered names beside it are.
    longest = max(len(report.status_text) for report in reports)
    table.add_column("Status", overflow="fold", min_width=min(longest, 72))
    for report in reports:
        registers = "\n".join(
            f"{kind}: {', '.join(names)}" for kind, names in report.registers.items() if names
        )
        table.add_row(
            f"{escape(report.distribution)}\n[dim]{escape(report.version or '')}[/]",
            escape(report.entry_point or "-"),
            escape("\n".join(report.hooks) or "-"),
            escape(registers or "-"),
            f"[{_STYLE[report.status]}]{escape(report.status_text)}[/]",
        )
    Console().print(table)
