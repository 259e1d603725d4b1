"""``dataflow validate PROGRAM.json``: print every structural problem, exit 1 if any."""

from __future__ import annotations

import sys

import click

from dataflow.schema import Program, SchemaError, validate


def load_program(path: str) -> Program:
    """Read a program for a CLI command; a malformed file exits 1 with every fault listed."""
    try:
        return Program.from_json(path)
    except SchemaError as exc:
        click.echo(str(exc), err=True)
        sys.exit(1)


@click.command("validate")
@click.argument("program_path", metavar="PROGRAM.json", type=click.Path(dir_okay=False))
def validate_command(program_path: str) -> None:
    """Check PROGRAM.json and print every problem found, naming task and object."""
    program = load_program(program_path)
    problems = validate(program)
    if not problems:
        click.echo(
            f"{program_path}: ok ({len(program.tasks)} tasks, {len(program.objects)} objects)"
        )
        return
    click.echo(f"{program_path}: {len(problems)} problem(s)", err=True)
    for problem in problems:
        click.echo(f"  - [{problem.code}] {problem.message}", err=True)
    sys.exit(1)
