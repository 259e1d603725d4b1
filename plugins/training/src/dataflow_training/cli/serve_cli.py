"""``dataflow serve-trainer --out RUN``: the persistent trainer (added by the training
plugin; docs/engine_service.md). It claims the run folder, listens on a UNIX socket in it
(0600) or, with ``--tcp HOST:PORT``, on a TCP port that every request must name
``--token`` on, and serves ``load``, ``step``, ``save``, ``restore``, ``export_weights``,
``profile_start``/``profile_stop``, ``status`` and ``shutdown`` until ``shutdown`` or
SIGTERM. Every failure to start is one line.
"""

from __future__ import annotations

from pathlib import Path

import click

from dataflow.cli import Failure

#: the shortest token ``--tcp`` accepts (a token is all that guards the port)
MIN_TOKEN_CHARS = 16
TOKEN_ENV = "DATAFLOW_SERVE_TOKEN"


@click.command("serve-trainer")
@click.option(
    "--out",
    required=True,
    type=click.Path(file_okay=False),
    help="the run folder: checkpoints, metrics.jsonl, exports and (by default) the socket",
)
@click.option(
    "--socket",
    "socket_path",
    default=None,
    type=click.Path(dir_okay=False),
    help="the UNIX socket to listen on (default: OUT/trainer.sock)",
)
@click.option(
    "--tcp",
    default=None,
    metavar="HOST:PORT",
    help="listen on TCP instead (port 0: a free one); needs --token",
)
@click.option(
    "--token",
    default=None,
    envvar=TOKEN_ENV,
    help=f"what every request must carry as its token (with --tcp; or ${TOKEN_ENV})",
)
@click.option(
    "--save-on-exit",
    is_flag=True,
    help="write a checkpoint when the server stops (shutdown, SIGTERM, Ctrl-C)",
)
def serve_trainer_command(out, socket_path, tcp, token, save_on_exit) -> None:
    """Keep one compiled training step and its weights alive between calls, served on a
    local socket (one client at a time): load, step, save, restore, export_weights,
    profile_start, profile_stop, status, shutdown. A token-batch step, or an update kind a
    plugin registers (load's kind: rl, with the RL example installed)."""
    if tcp is not None:
        if socket_path is not None:
            raise click.UsageError("--socket and --tcp: one of them")
        if token is None:
            raise Failure(
                f"--tcp needs --token (or ${TOKEN_ENV}): a TCP port is open to every user of "
                "this host, and beyond it off loopback"
            )
        if len(token) < MIN_TOKEN_CHARS:
            raise Failure(f"--token: at least {MIN_TOKEN_CHARS} characters")
    elif token is not None:
        token = None  # the socket's 0600 guards it; a token from the environment is unused
    # torch loads when the command runs, not when `dataflow` lists its commands
    from dataflow_training.drive.run_folder import RunFolder, RunFolderError
    from dataflow_training.service.protocol import SOCKET_NAME
    from dataflow_training.service.served_run import ServedRun
    from dataflow_training.service.server import (
        ServeError,
        Server,
        tcp_listener,
        unix_listener,
    )

    folder_path = Path(out)
    try:
        folder = RunFolder.claim(folder_path, resume=True, overwrite=False, say=click.echo)
    except (RunFolderError, OSError) as exc:
        raise Failure(str(exc)) from None
    try:
        try:
            if tcp is not None:
                listener, where = tcp_listener(tcp)
                unix = None
            else:
                unix = Path(socket_path) if socket_path else folder_path / SOCKET_NAME
                listener, where = unix_listener(unix), str(unix)
        except ServeError as exc:
            raise Failure(str(exc)) from None
        server = Server(
            ServedRun(folder_path),
            listener,
            token=token,
            save_on_exit=save_on_exit,
            socket_path=unix,
        )
        scheme = "tcp" if tcp is not None else "unix"
        click.echo(f"serving {folder_path} on {scheme}:{where} (one client at a time)")
        server.serve()
    finally:
        folder.release()
