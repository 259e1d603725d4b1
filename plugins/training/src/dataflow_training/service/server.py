"""The socket side of ``dataflow serve-trainer``: listen, read a request, run its verb on
the ``ServedRun``, answer; one client at a time (docs/engine_service.md).

Why a client killed mid-``step`` loses nothing: a request is served only once its whole
frame has arrived, and a verb, once started, runs to its end whatever the client does;
only the answer is lost when the client is gone (the write fails and is let go). So a
``step`` either has not begun (the frame was cut short: nothing is run) or completes (the
state advances, and ``status`` says the step count); never half an update.

Signals: SIGTERM and SIGINT ask the server to stop after the verb under way (it checks
between requests, and while it waits for one, every ``POLL_S``); then it saves a
checkpoint when ``save_on_exit`` asks, closes the listener and removes its socket file.
"""

from __future__ import annotations

import os
import select
import signal
import socket
import stat
import sys
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any, TextIO

from dataflow.cli import one_line
from dataflow_training.service.protocol import (
    Disconnected,
    ProtocolError,
    parse_request,
    read_message,
    send_message,
)
from dataflow_training.service.served_run import ServedRun

#: how often a server waiting for a connection or a request looks for a stop signal
POLL_S = 0.2
#: how long a server waits for the rest of a frame whose first bytes came
FRAME_TIMEOUT_S = 60.0
#: the longest UNIX socket path (``sun_path`` less its terminating zero, on Linux)
MAX_SOCKET_PATH = 107


class ServeError(RuntimeError):
    """The server cannot start: the message names the option at fault."""


def unix_listener(path: Path) -> socket.socket:
    """A UNIX socket listening at ``path``, readable and writable by its owner alone
    (0600: made so, not changed after). A socket file a dead server left is replaced; one
    a live server answers on is refused."""
    if len(os.fsencode(str(path))) > MAX_SOCKET_PATH:
        raise ServeError(
            f"--socket: {path} is {len(os.fsencode(str(path)))} bytes long; a UNIX socket path "
            f"takes at most {MAX_SOCKET_PATH}: give a shorter --socket"
        )
    if path.exists() or path.is_symlink():
        if not stat.S_ISSOCK(path.lstat().st_mode):
            raise ServeError(f"--socket: {path} exists and is not a socket")
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            probe.connect(str(path))
        except OSError:  # nobody answers: a dead server's file
            path.unlink()
        else:
            raise ServeError(f"--socket: a server is listening on {path} already")
        finally:
            probe.close()
    # bound at a sibling name and renamed once it listens, so that a client which waits for
    # the file to appear never finds it before it accepts (a connect between bind and listen
    # is refused); a sibling name past the length limit binds in place
    staging = path.with_name(f".{path.name[:8]}.{os.getpid()}")
    if len(os.fsencode(str(staging))) > MAX_SOCKET_PATH:
        staging = path
    else:
        _remove_dead_staging(staging)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    previous = os.umask(0o177)
    try:
        staging.unlink(missing_ok=True)
        listener.bind(str(staging))
        listener.listen(1)
        if staging != path:
            os.rename(staging, path)
    except OSError as exc:
        listener.close()
        if staging != path:
            staging.unlink(missing_ok=True)
        raise ServeError(f"--socket: cannot listen on {path}: {exc.strerror}") from None
    finally:
        os.umask(previous)
    return listener


def _remove_dead_staging(staging: Path) -> None:
    """The staging sockets (``.NAME.PID`` beside the socket) of servers that died between
    their bind and their rename: a PID no process has any more. A live process's is left
    (another server starting at this path)."""
    stem = staging.name.rsplit(".", 1)[0]
    for left in staging.parent.glob(f"{stem}.*"):
        pid = left.name.rsplit(".", 1)[1]
        if not pid.isdigit() or not stat.S_ISSOCK(left.lstat().st_mode):
            continue
        try:
            os.kill(int(pid), 0)
        except ProcessLookupError:
            left.unlink(missing_ok=True)
        except PermissionError:  # a live process of another user
            pass


def tcp_listener(address: str) -> tuple[socket.socket, str]:
    """A TCP socket listening on ``HOST:PORT`` (port 0: a free one); and where it listens."""
    host, sep, port = address.rpartition(":")
    if not sep or not host or not port.isdigit() or int(port) > 65535:
        raise ServeError(f"--tcp: {address!r} is not HOST:PORT")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    listener = socket.socket(family, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        listener.bind((host, int(port)))
    except OSError as exc:
        listener.close()
        raise ServeError(f"--tcp: cannot listen on {address}: {exc.strerror}") from None
    listener.listen(1)
    bound = listener.getsockname()
    return listener, f"{bound[0]}:{bound[1]}"


class Server:
    """Serves ``served`` on ``listener`` until ``shutdown`` or a stop signal. ``token``:
    what every request's ``"token"`` must be (None: no token, a UNIX socket)."""

    def __init__(
        self,
        served: ServedRun,
        listener: socket.socket,
        *,
        token: str | None = None,
        save_on_exit: bool = False,
        socket_path: Path | None = None,
        log: TextIO | None = None,
    ) -> None:
        self.served, self.listener, self.token = served, listener, token
        self.save_on_exit, self.socket_path = save_on_exit, socket_path
        self.log = log or sys.stderr
        self.stop: str | None = None  # why the server stops (a signal's name, "shutdown")
        self.verbs: dict[str, Callable[[dict[str, Any]], Any]] = {
            "load": served.load,
            "step": served.step,
            "save": served.save,
            "restore": served.restore,
            "export_weights": served.export_weights,
            "profile_start": served.profile_start,
            "profile_stop": served.profile_stop,
            "status": served.status,
            "shutdown": self._shutdown,
        }

    def say(self, line: str) -> None:
        print(line, file=self.log, flush=True)

    def serve(self) -> str | None:
        """Serve until stopped; then save if asked and remove the socket. Returns the
        checkpoint saved on the way out (None: none)."""
        previous = {
            number: signal.signal(number, self._on_signal)
            for number in (signal.SIGTERM, signal.SIGINT)
        }
        saved = None
        try:
            while self.stop is None:
                if not _readable(self.listener):
                    continue
                connection, _ = self.listener.accept()
                with connection:
                    self._serve_connection(connection)
            saved = self.served.close(self.save_on_exit)
            if saved is not None:
                self.say(f"saved {saved} on the way out")
        finally:
            self.listener.close()
            if self.socket_path is not None:
                self.socket_path.unlink(missing_ok=True)
            for number, handler in previous.items():
                signal.signal(number, handler)
            self.say(f"stopped ({self.stop})")
        return saved

    def _on_signal(self, signum: int, _frame: Any) -> None:
        self.stop = self.stop or signal.Signals(signum).name

    def _serve_connection(self, connection: socket.socket) -> None:
        """Requests of one client, one after the other, until it goes or the server stops."""
        while self.stop is None:
            if not _readable(connection):
                continue
            connection.settimeout(FRAME_TIMEOUT_S)
            try:
                message = read_message(connection)
            except (Disconnected, TimeoutError, ConnectionError):
                return  # gone (or stalled) mid-frame: nothing of it is served
            except ProtocolError as exc:
                if not self._answer(connection, {"id": None, "ok": False, "error": str(exc)}):
                    return
                if exc.fatal:
                    return
                continue
            finally:
                connection.settimeout(None)
            answer, fatal = self._handle(message)
            if not self._answer(connection, answer) or fatal:
                return

    def _handle(self, message: dict[str, Any]) -> tuple[dict[str, Any], bool]:
        """The answer to a request, and whether the connection ends after it."""
        request_id = message.get("id") if isinstance(message.get("id"), (str, int)) else None
        try:
            request_id, verb, args = parse_request(message, self.verbs, self.token)
        except ProtocolError as exc:
            return {"id": request_id, "ok": False, "error": str(exc)}, exc.fatal
        try:
            result = self.verbs[verb](args)
        except ProtocolError as exc:
            error = str(exc) if str(exc).startswith(f"{verb}:") else f"{verb}: {exc}"
            return {"id": request_id, "ok": False, "error": one_line(error)}, False
        except (ValueError, LookupError, RuntimeError, OSError) as exc:
            return {"id": request_id, "ok": False, "error": one_line(f"{verb}: {exc}")}, False
        except Exception as exc:  # a fault of the server's own: said, and serving goes on
            traceback.print_exc(file=self.log)
            error = one_line(f"{verb}: internal error: {type(exc).__name__}: {exc}")
            return {"id": request_id, "ok": False, "error": error}, False
        return {"id": request_id, "ok": True, "result": result}, False

    def _answer(self, connection: socket.socket, answer: dict[str, Any]) -> bool:
        """Send ``answer``; False when the client is gone (the verb's work stands)."""
        try:
            send_message(connection, answer)
        except OSError:
            self.say(f"client gone before its answer (id {answer.get('id')!r}); its verb ran")
            return False
        return True

    def _shutdown(self, args: dict[str, Any]) -> dict[str, Any]:
        """Stop after this answer (``save``: a checkpoint first, whatever ``--save-on-exit``)."""
        unknown = sorted(set(args) - {"save"})
        if unknown:
            raise ProtocolError(f"args.{unknown[0]}: shutdown takes no such field (it takes: save)")
        save = args.get("save", False)
        if not isinstance(save, bool):
            raise ProtocolError("args.save: true or false")
        self.save_on_exit = self.save_on_exit or save
        self.stop = "shutdown"
        return {"stopping": True, "save": self.save_on_exit}


def _readable(sock: socket.socket) -> bool:
    """Whether ``sock`` has something to read (a connection, a frame, its end) within
    ``POLL_S``; a signal that lands while it waits counts as nothing."""
    try:
        ready, _, _ = select.select([sock], [], [], POLL_S)
    except InterruptedError:
        return False
    return bool(ready)
