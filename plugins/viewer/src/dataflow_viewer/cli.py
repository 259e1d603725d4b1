"""``dataflow report`` and ``dataflow serve`` (added by the viewer plugin)."""

from __future__ import annotations

import click

from dataflow.cli import Failure, OutputFile, one_line


@click.command("report")
@click.argument("folder", metavar="RUN_OR_EXPORT_DIR", type=click.Path(file_okay=True))
@click.option(
    "-o",
    "--output",
    default="report.html",
    show_default=True,
    type=OutputFile(),
    help="the HTML file to write",
)
@click.option(
    "--measured",
    "measured_path",
    default=None,
    type=click.Path(exists=True, dir_okay=False),
    help="a measured timeline JSON to compare (default: the folder's own, if any)",
)
@click.option(
    "--sweep-points",
    default=6,
    show_default=True,
    type=click.IntRange(min=2),
    help="budgets in the budget sweep",
)
def report_command(folder: str, output: str, measured_path: str | None, sweep_points: int) -> None:
    """Write one self-contained HTML report (no network needed to view it) of an exported
    run: the plan's prediction beside the measured steps, where there are any."""
    from dataflow_viewer.bundle import read_run, read_timeline_file
    from dataflow_viewer.report import write_report
    from dataflow_viewer.run import ViewerError

    try:
        run = read_run(folder)
        if measured_path is not None:
            run = run.with_measured(read_timeline_file(measured_path))
    except ViewerError as exc:
        raise Failure(one_line(str(exc))) from None
    path = write_report(run, output, sweep_points)
    measured = "predicted and measured" if run.measured is not None else "prediction only"
    click.echo(f"wrote {path} ({measured}, {path.stat().st_size / 1e6:.1f} MB)")


@click.command("serve")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="interface to listen on (the default, loopback, is reachable from this machine only)",
)
@click.option("--port", default=0, type=click.IntRange(0, 65535), help="default: a free port")
@click.option("--verbose", is_flag=True, help="log every request to stderr")
def serve_command(host: str, port: int, verbose: bool) -> None:
    """Serve a page that plans and simulates a preset or an uploaded program at any
    budget, planner and training shape, with the report's panels (Ctrl-C stops it)."""
    from dataflow_viewer.server import make_server

    try:
        server = make_server(host, port, verbose=verbose)
    except OSError as exc:
        raise Failure(f"--host {host} --port {port}: cannot listen ({exc.strerror})") from None
    bound_host, bound_port = server.server_address[:2]
    click.echo(f"serving on http://{bound_host}:{bound_port}/ (Ctrl-C stops)")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
