"""Entry-point module of dataflow-viewer: adds ``dataflow report`` and ``dataflow serve``;
bokeh and the planner load only when one of them runs."""

from __future__ import annotations

from dataflow import hookimpl


@hookimpl
def dataflow_cli_commands() -> list:
    from dataflow_viewer.cli import report_command, serve_command

    return [report_command, serve_command]
