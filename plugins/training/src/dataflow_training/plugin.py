"""Entry-point module of dataflow-training: adds ``dataflow verify``."""

from __future__ import annotations

from dataflow import hookimpl


@hookimpl
def dataflow_cli_commands() -> list:
    from dataflow_training.cli import verify_command

    return [verify_command]
