"""The ``dataflow`` command group.

Builtin subcommands are listed in ``BUILTIN_COMMANDS`` as ``module:attribute`` and imported
only when used, so ``dataflow --help`` stays fast. Plugins add subcommands through the
``dataflow_cli_commands`` hook; those load when the group lists or looks up commands.
"""

from __future__ import annotations

import importlib

import click

import dataflow

#: name -> "module:attribute" of a click command; one file per command under dataflow.cli.
BUILTIN_COMMANDS: dict[str, str] = {
    "validate": "dataflow.cli.validate:validate_command",
    "kernels": "dataflow.cli.kernels_cmd:kernels_group",
    "plan": "dataflow.cli.plan:plan_command",
    "plugins": "dataflow.cli.plugins_cmd:plugins_group",
    "simulate": "dataflow.cli.simulate:simulate_command",
    "trace": "dataflow.cli.trace:trace_command",
}


class DataflowGroup(click.Group):
    """Builtins imported lazily; plugin commands added from the plugin manager on demand."""

    def _plugin_commands(self) -> dict[str, click.Command]:
        if not hasattr(self, "_plugin_cache"):
            from dataflow.plugins import plugin_cli_commands

            self._plugin_cache = {
                command.name: command
                for command in plugin_cli_commands()
                if command.name not in BUILTIN_COMMANDS
            }
        return self._plugin_cache

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*BUILTIN_COMMANDS, *self._plugin_commands()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in BUILTIN_COMMANDS:
            module, _, attribute = BUILTIN_COMMANDS[name].partition(":")
            return getattr(importlib.import_module(module), attribute)
        return self._plugin_commands().get(name)


@click.group(cls=DataflowGroup, context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(dataflow.__version__, prog_name="dataflow")
def cli() -> None:
    """Train models bigger than the GPU: plan, simulate and run Programs."""


def main() -> None:
    cli()
