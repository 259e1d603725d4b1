"""One error path for every ``dataflow`` command.

Whatever goes wrong ends as one line on stderr that names the option, field, task, object
or file at fault, and, where the error knows it, what would work (the budget that fits,
the known names). Exit codes: 2 for a usage error (a bad option or argument, caught before
any work), 1 for a failure (the work was tried and cannot be done), 130 for Ctrl-C. A
traceback is printed only with ``--debug`` (or ``DATAFLOW_DEBUG=1``), above the same line.

Commands raise ``click.BadParameter`` / ``click.UsageError`` for usage errors and
``Failure`` (or let a library error through) for failures; ``report`` turns each into its
line.
"""

from __future__ import annotations

import errno
import sys
import traceback

import click

USAGE_EXIT = 2
FAILURE_EXIT = 1
INTERRUPT_EXIT = 130

#: Library errors whose message is written for a user: shown as they are, on one line.
#: Anything else is a bug and says so (with the hint to rerun with --debug).
_USER_FACING = (ValueError, LookupError, RuntimeError, click.ClickException)


class Failure(click.ClickException):
    """The command was understood but cannot do what was asked: one line, exit 1."""

    exit_code = FAILURE_EXIT


def one_line(text: str) -> str:
    """``text`` on one line: a listing (``head:`` then ``  - item`` lines) becomes
    ``head: item; item``, other line breaks become spaces."""
    lines = [line.strip() for line in str(text).splitlines() if line.strip()]
    if not lines:
        return ""
    head, items = lines[0], [line.removeprefix("- ").strip() for line in lines[1:]]
    if not items:
        return head
    if all(line.startswith("- ") for line in lines[1:]):
        return f"{head} {'; '.join(items)}"
    return " ".join([head, *items])


def describe(exc: BaseException) -> str:
    """The one line that stands for ``exc``."""
    if isinstance(exc, click.UsageError):
        message = one_line(exc.format_message())
        if exc.ctx is not None:
            message += f" (see '{exc.ctx.command_path} --help')"
        return message
    if isinstance(exc, click.ClickException):
        return one_line(exc.format_message())
    if isinstance(exc, OSError) and exc.filename is not None:
        reason = exc.strerror or str(exc)
        return f"{exc.filename}: {reason}"
    if isinstance(exc, _USER_FACING) and str(exc):
        return message_of(exc)
    return (
        f"internal error: {type(exc).__name__}: {message_of(exc)}; this is a bug of "
        "dataflow or of a plugin: rerun with --debug for the traceback and report it"
    )


def message_of(exc: BaseException) -> str:
    """``str(exc)`` on one line (a KeyError's message unquoted)."""
    if isinstance(exc, KeyError) and len(exc.args) == 1 and isinstance(exc.args[0], str):
        return one_line(exc.args[0])
    return one_line(str(exc))


def plugin_failure(what: str, exc: BaseException) -> Failure:
    """A plugin's own error while doing ``what`` (``planner 'x' failed on FILE``), named."""
    return Failure(f"{what}: {type(exc).__name__}: {message_of(exc)}")


def exit_code_of(exc: BaseException) -> int:
    if isinstance(exc, click.ClickException):
        return exc.exit_code
    if isinstance(exc, KeyboardInterrupt | click.Abort):
        return INTERRUPT_EXIT
    return FAILURE_EXIT


def report(exc: BaseException, *, debug: bool) -> int:
    """Print ``exc`` as its one line (after its traceback when ``debug``); its exit code."""
    if isinstance(exc, OSError) and exc.errno == errno.EPIPE:
        return FAILURE_EXIT  # the reader went away (``dataflow ... | head``): nothing to say
    if isinstance(exc, KeyboardInterrupt | click.Abort):
        click.echo("interrupted", err=True)
        return INTERRUPT_EXIT
    if isinstance(exc, click.exceptions.NoArgsIsHelpError):  # `dataflow` alone: its help
        click.echo(exc.format_message())
        return 0
    if debug and not isinstance(exc, click.UsageError):
        traceback.print_exception(exc, file=sys.stderr)
    click.echo(f"error: {describe(exc)}", err=True)
    return exit_code_of(exc)
