"""Running the ``dataflow`` command in tests, and checking that an error is one clean line.

``invoke(*args)`` runs ``dataflow ARGS...`` in-process (click's CliRunner: stdout and
stderr apart); ``assert_one_line_error(result, code, *culprits)`` checks the error path
every command shares: exit ``code`` (2 usage, 1 failure), exactly one ``error:`` line on
stderr that names every culprit, and no traceback. Plugin authors use both for the
subcommands they add.
"""

from __future__ import annotations

from typing import Any

USAGE_EXIT, FAILURE_EXIT = 2, 1


def invoke(*args: Any) -> Any:
    """``dataflow ARGS...`` in this process; a click ``Result``."""
    from click.testing import CliRunner

    from dataflow.cli.main import cli

    return CliRunner().invoke(cli, [str(arg) for arg in args])


def assert_one_line_error(result: Any, code: int, *culprits: str) -> str:
    """Exit ``code``, one ``error:`` line on stderr naming every culprit, no traceback;
    returns the line."""
    assert "Traceback" not in result.output, result.output
    assert result.exit_code == code, (result.exit_code, result.output)
    lines = result.stderr.splitlines()
    assert len(lines) == 1 and lines[0].startswith("error: "), result.stderr
    for culprit in culprits:
        assert culprit in lines[0], (culprit, lines[0])
    return lines[0]
