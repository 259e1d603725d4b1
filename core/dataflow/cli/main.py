"""The ``dataflow`` command group.

Builtin subcommands are listed in ``BUILTIN_COMMANDS`` as ``module:attribute`` and imported
only when used, so ``dataflow --help`` stays fast. Plugins add subcommands through the
``dataflow_cli_commands`` hook (``plugin_commands``); those load when the group lists or
looks up commands. The dependency runs one way: the CLI asks ``dataflow.plugins`` for the
records, ``dataflow.plugins`` knows nothing of the CLI.

Every error of every subcommand, plugin ones included, goes through ``DataflowGroup.main``
to ``dataflow.cli.errors.report``: one line, exit 2 (usage) or 1 (failure), a traceback
only with ``--debug``.
"""

from __future__ import annotations

import importlib
import os
import sys
import warnings
from collections.abc import Sequence
from typing import Any

import click

import dataflow
from dataflow.cli.errors import report

#: name -> "module:attribute" of a click command; one file per command under dataflow.cli.
BUILTIN_COMMANDS: dict[str, str] = {
    "validate": "dataflow.cli.validate:validate_command",
    "kernels": "dataflow.cli.kernels_cmd:kernels_group",
    "perfetto": "dataflow.cli.perfetto:perfetto_command",
    "plan": "dataflow.cli.plan:plan_command",
    "plugins": "dataflow.cli.plugins_cmd:plugins_group",
    "simulate": "dataflow.cli.simulate:simulate_command",
    "trace": "dataflow.cli.trace:trace_command",
}

DEBUG_FLAG = "--debug"
DEBUG_ENV = "DATAFLOW_DEBUG"


def plugin_commands() -> list[click.Command]:
    """Subcommands that plugins add to ``dataflow``, by name. A name used twice, or one
    that clashes with a builtin subcommand, is a ``click.ClickException`` naming both."""
    from dataflow.plugins import get_plugin_manager
    from dataflow.registry import DuplicateNameError

    try:
        registry = get_plugin_manager().cli_commands()
    except DuplicateNameError as exc:
        raise click.ClickException(str(exc)) from exc
    for entry in registry.entries():
        if entry.name in BUILTIN_COMMANDS:
            clash = DuplicateNameError(
                "command", entry.name, dataflow.DISTRIBUTION, entry.distribution
            )
            raise click.ClickException(f"{clash} (the builtin command wins)")
    return list(registry)


def split_debug(args: Sequence[str]) -> tuple[list[str], bool]:
    """``args`` without ``--debug`` (accepted anywhere before ``--``), and whether it was
    there or ``DATAFLOW_DEBUG`` is set."""
    args = list(args)
    end = args.index("--") if "--" in args else len(args)
    kept = [arg for arg in args[:end] if arg != DEBUG_FLAG] + args[end:]
    return kept, len(kept) != len(args) or bool(os.environ.get(DEBUG_ENV))


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    click.echo(f"warning: {message}", err=True)


class DataflowGroup(click.Group):
    """Builtins imported lazily; plugin commands added from the plugin manager on demand;
    one error path for all of them."""

    def _plugin_commands(self) -> dict[str, click.Command]:
        """The plugin commands of the default plugin manager (kept while it stays the
        default)."""
        from dataflow.plugins import get_plugin_manager

        manager = get_plugin_manager()
        cached = getattr(self, "_plugin_cache", None)
        if cached is None or cached[0] is not manager:
            commands = {
                command.name: command
                for command in plugin_commands()
                if command.name not in BUILTIN_COMMANDS
            }
            self._plugin_cache = cached = (manager, commands)
        return cached[1]

    def list_commands(self, ctx: click.Context) -> list[str]:
        return sorted({*BUILTIN_COMMANDS, *self._plugin_commands()})

    def get_command(self, ctx: click.Context, name: str) -> click.Command | None:
        if name in BUILTIN_COMMANDS:
            module, _, attribute = BUILTIN_COMMANDS[name].partition(":")
            return getattr(importlib.import_module(module), attribute)
        return self._plugin_commands().get(name)

    def main(
        self,
        args: Sequence[str] | None = None,
        prog_name: str | None = None,
        complete_var: str | None = None,
        standalone_mode: bool = True,
        **extra: Any,
    ) -> Any:
        """Run the command; every error becomes one line (``dataflow.cli.errors``). In
        standalone mode exits with the code, otherwise returns it."""
        args, debug = split_debug(sys.argv[1:] if args is None else args)
        show_warning = warnings.showwarning
        warnings.showwarning = _show_warning
        try:
            result = super().main(
                args, prog_name or "dataflow", complete_var, standalone_mode=False, **extra
            )
            code = result if isinstance(result, int) else 0
        except SystemExit as exc:  # a command's own sys.exit(code)
            code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        except (Exception, KeyboardInterrupt) as exc:
            code = report(exc, debug=debug)
        finally:
            warnings.showwarning = show_warning
        if standalone_mode:
            sys.exit(code)
        return code


@click.group(
    "dataflow", cls=DataflowGroup, context_settings={"help_option_names": ["-h", "--help"]}
)
@click.version_option(dataflow.__version__, prog_name="dataflow")
@click.option(
    DEBUG_FLAG,
    is_flag=True,
    expose_value=False,
    help=f"on an error, print the traceback too (also: {DEBUG_ENV}=1); works anywhere",
)
def cli() -> None:
    """Train models bigger than the GPU: plan, simulate and run Programs.

    Errors are one line; exit code 2 is a usage error (a bad option), 1 a failure.
    """


def main() -> None:
    cli()
