"""``dataflow report`` and ``dataflow serve`` (added by the viewer plugin)."""

from __future__ import annotations

import secrets

import click

from dataflow.cli import BUDGET, Failure, OutputFile, one_line
from dataflow_viewer.guard import READ_TIMEOUT_S, TIME_LIMIT_S


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


#: the shortest token ``--token`` takes (a generated one has 43 characters)
MIN_TOKEN_CHARS = 16


@click.command("serve")
@click.option(
    "--host",
    default="127.0.0.1",
    show_default=True,
    help="interface to listen on; the default, loopback, is reachable from this machine "
    "only, and any other needs --expose",
)
@click.option("--port", default=0, type=click.IntRange(0, 65535), help="default: a free port")
@click.option(
    "--expose",
    is_flag=True,
    help="allow a --host beyond loopback (0.0.0.0: every interface); every request then "
    "needs the token (--token, else a random one, printed)",
)
@click.option(
    "--token",
    default=None,
    envvar="DATAFLOW_SERVE_TOKEN",
    help=f"the token requests must carry (Authorization: Bearer TOKEN, or ?token=TOKEN in "
    f"the page's address); at least {MIN_TOKEN_CHARS} characters; asked for on loopback "
    "too when given [env: DATAFLOW_SERVE_TOKEN]",
)
@click.option(
    "--time-limit",
    "time_limit_s",
    default=TIME_LIMIT_S,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="a request that plans and simulates longer is stopped and answered 503; a "
    "request's work also stops when its client disconnects",
)
@click.option(
    "--max-body",
    "max_body_bytes",
    default="64MiB",
    show_default=True,
    type=BUDGET,
    metavar="SIZE",
    help="the largest request body read (an uploaded program and timeline); larger is 413",
)
@click.option(
    "--read-timeout",
    "read_timeout_s",
    default=READ_TIMEOUT_S,
    show_default=True,
    type=click.FloatRange(min=0, min_open=True),
    metavar="SECONDS",
    help="a request that sends no byte of its head or body for this long is refused",
)
@click.option("--verbose", is_flag=True, help="log every request to stderr")
def serve_command(
    host: str,
    port: int,
    expose: bool,
    token: str | None,
    time_limit_s: float,
    max_body_bytes: int,
    read_timeout_s: float,
    verbose: bool,
) -> None:
    """Serve a page that plans and simulates a preset or an uploaded program at any
    budget, planner and training shape, with the report's panels (Ctrl-C stops it).

    It answers only requests to its loopback address from its own page or from programs
    (not other web pages), reads bodies of a bounded size, and stops a request's work at
    --time-limit or when its client goes. See docs/exporting_runs.md, "The viewer"."""
    from dataflow_viewer.guard import Limits, is_loopback
    from dataflow_viewer.server import make_server

    host = host.strip("[]")
    if not expose and not is_loopback(host):
        raise click.BadParameter(
            f"{host} is not a loopback address; the page has no login, so serving beyond "
            "this machine needs --expose (every request then needs a token)",
            param_hint="--host",
        )
    if token is not None and len(token) < MIN_TOKEN_CHARS:
        raise click.BadParameter(
            f"a token of {len(token)} characters is too easy to guess; give at least "
            f"{MIN_TOKEN_CHARS}, or leave --token out for a random one",
            param_hint="--token",
        )
    if expose and token is None:
        token = secrets.token_urlsafe(32)
    limits = Limits(time_limit_s, read_timeout_s, max_body_bytes)
    try:
        server = make_server(host, port, verbose=verbose, token=token, limits=limits)
    except OSError as exc:
        why = exc.strerror or one_line(str(exc))
        raise Failure(f"--host {host} --port {port}: cannot listen ({why})") from None
    bound_host, bound_port = server.server_address[:2]
    address = f"[{bound_host}]" if ":" in bound_host else bound_host
    query = "" if token is None else f"?token={token}"
    click.echo(f"serving on http://{address}:{bound_port}/{query} (Ctrl-C stops)")
    if token is not None:
        click.echo("every request needs the token: Authorization: Bearer TOKEN, or ?token=TOKEN")
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
