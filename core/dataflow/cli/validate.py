"""``dataflow validate PROGRAM.json``: print every structural problem, exit 1 if any."""

from __future__ import annotations

import click

from dataflow.cli.errors import Failure, one_line
from dataflow.schema import Program, SchemaError, validate
from dataflow.schema.program_file import not_regular


class ProgramFile(click.Path):
    """A program file that exists and is a regular file: a directory, a device, a FIFO or
    a socket is a usage error before anything opens it (a FIFO would block the reader, a
    device feed it forever). Its size and content are the reader's to check."""

    def __init__(self) -> None:
        super().__init__(exists=True, dir_okay=False)

    def convert(self, value, param, ctx):
        path = super().convert(value, param, ctx)
        try:
            problem = not_regular(path)
        except OSError as exc:
            self.fail(f"{path}: {exc.strerror or exc}", param, ctx)
        if problem is not None:
            self.fail(f"{path}: {problem}", param, ctx)
        return path


#: The PROGRAM.json argument of every command that reads a program.
PROGRAM_FILE = ProgramFile()


def load_program(path: str) -> Program:
    """Read a program for a CLI command; a malformed file is a ``Failure`` listing every
    fault on one line."""
    try:
        return Program.from_json(path)
    except SchemaError as exc:
        raise Failure(one_line(str(exc))) from exc


@click.command("validate")
@click.argument("program_path", metavar="PROGRAM.json", type=PROGRAM_FILE)
def validate_command(program_path: str) -> None:
    """Check PROGRAM.json and print every problem found, naming task and object."""
    program = load_program(program_path)
    problems = validate(program)
    if not problems:
        click.echo(
            f"{program_path}: ok ({len(program.tasks)} tasks, {len(program.objects)} objects)"
        )
        return
    for problem in problems:
        click.echo(f"  - [{problem.code}] {problem.message}")
    raise Failure(f"{program_path}: {len(problems)} problem(s), listed above")
