"""Who may ask ``dataflow serve`` for work, and how much it reads: the checks every request
passes before anything is computed (``Guard``).

- **Host.** A loopback server answers only requests whose ``Host`` header is a loopback
  name (``localhost``, ``127.0.0.1``, ``[::1]`` or the address it is bound to) with its own
  port. A page on another site that re-points its own name at 127.0.0.1 (DNS rebinding)
  sends its own name as ``Host`` and is refused.
- **Origin.** A browser names the page that made a request in ``Origin`` (and, in new
  browsers, says in ``Sec-Fetch-Site`` whether it is the same origin). An ``Origin``, when
  present, must be the server's own (``http://`` and the ``Host``); a ``POST`` whose
  ``Sec-Fetch-Site`` is not ``same-origin`` (or ``none``: typed by the user) is refused. So
  another web page in the user's browser cannot make the server work (cross-site request
  forgery). Clients that are not browsers (curl, scripts) send neither and pass.
- **Token.** A server that listens beyond loopback (``--expose``) cannot know the names
  it is reached by, so it takes any ``Host`` and asks for a token instead (a loopback
  server given a token asks for both):
  ``Authorization: Bearer TOKEN`` on every request, or ``?token=TOKEN`` in the address of
  the page (whose script then sends the header). A browser never adds that header by
  itself, so a foreign page cannot borrow the user's access.
- **Body.** A ``POST`` must say its size in one ``Content-Length`` of digits, at most
  ``max_body_bytes``; a body that stops arriving for ``read_timeout_s`` is refused, so no
  thread waits for bytes that never come.

Each failed check raises ``Refused``: the HTTP status and one line saying why. ``Limits``
holds the bounds of one request: its body, its read timeout and its time limit.
"""

from __future__ import annotations

import hmac
import ipaddress
from http import HTTPStatus
from typing import Any
from urllib.parse import parse_qs, urlsplit

import attrs

from dataflow import format_size

#: how long one request may plan and simulate by default: enough for every shipped
#: preset's first request (its budget sweep) at the default shape: GPT-2 124M took 15 s,
#: Llama 3 8B 57 s, Qwen3 30B-A3B 397 s (``answer(run_of(...))`` on one core of the
#: development machine)
TIME_LIMIT_S = 600.0
#: the largest request body read by default: an uploaded program of an 8B model's step is
#: a few MiB; a measured timeline of a long step some tens of MiB
MAX_BODY_BYTES = 64 << 20
#: how long a request may go without sending a byte of its head or body
READ_TIMEOUT_S = 10.0
#: ``Host`` names of this machine, beside the address the server is bound to
LOOPBACK_NAMES = ("localhost", "127.0.0.1", "[::1]")
#: ``Sec-Fetch-Site`` values of a request the page itself made, or the user typed
OWN_SITES = ("same-origin", "none")


@attrs.frozen
class Limits:
    """What one request may take: ``time_limit_s`` of planning and simulating (then it is
    stopped, 503), ``read_timeout_s`` without a byte of its head or body arriving (then
    400, or the connection closed), and a body of ``max_body_bytes`` (413 beyond)."""

    time_limit_s: float = TIME_LIMIT_S
    read_timeout_s: float = READ_TIMEOUT_S
    max_body_bytes: int = MAX_BODY_BYTES


class Refused(Exception):
    """A request refused before any work: ``status`` and one line saying why."""

    def __init__(self, status: HTTPStatus, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


def is_loopback(host: str) -> bool:
    """Whether ``--host`` names this machine only (``localhost``, 127.0.0.0/8, ``::1``)."""
    if host.lower() == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:  # a name other than localhost may resolve anywhere
        return False


def host_and_port(text: str) -> tuple[str, int] | None:
    """``("localhost", 8800)`` of a ``Host`` header or an origin's authority (``[::1]``
    keeps its brackets; no port means 80), or None when it is not of that form."""
    name, colon, port = text.strip().lower().rpartition(":")
    if not colon or (name.startswith("[") and not name.endswith("]")):
        name, port = text.strip().lower(), "80"  # no port (or a bare IPv6 address)
    if not name or not port.isascii() or not port.isdigit():
        return None
    return name, int(port)


@attrs.frozen
class Guard:
    """The checks of one bound server: ``bound_host`` and ``port`` are where it listens;
    ``token`` (None: none asked) is the bearer token every request must carry (required
    of a server bound beyond loopback)."""

    bound_host: str
    port: int
    token: str | None = None
    max_body_bytes: int = MAX_BODY_BYTES

    @property
    def checks_host(self) -> bool:
        """Whether ``Host`` must be a loopback name: when bound to loopback (a server
        bound beyond it is reached by names it cannot know, and asks for its token)."""
        return is_loopback(self.bound_host)

    def check_caller(self, method: str, path: str, headers: Any) -> None:
        """Raise ``Refused`` unless the request's Host, Origin and token may ask."""
        host = self._host(headers)
        origin = headers.get("Origin")
        if origin is not None:
            parts = urlsplit(origin)
            if parts.scheme != "http" or host_and_port(parts.netloc) != host:
                raise Refused(
                    HTTPStatus.FORBIDDEN,
                    f"a request from another web page (Origin {origin}) is refused: "
                    f"only the page this server serves may ask it",
                )
        site = headers.get("Sec-Fetch-Site")
        if method == "POST" and site is not None and site not in OWN_SITES:
            raise Refused(
                HTTPStatus.FORBIDDEN,
                f"a request from another web page (Sec-Fetch-Site {site}) is refused: "
                f"only the page this server serves may ask it",
            )
        if self.token is not None:
            self._check_token(path, headers)

    def _host(self, headers: Any) -> tuple[str, int] | None:
        text = headers.get("Host")
        if not self.checks_host:  # the token stands in for the Host check
            return host_and_port(text or "")
        if text is None:
            raise Refused(HTTPStatus.FORBIDDEN, "a request without a Host header is refused")
        host = host_and_port(text)
        names = {*LOOPBACK_NAMES, self._bound_name()}
        if host is None or host[0] not in names or host[1] != self.port:
            raise Refused(
                HTTPStatus.FORBIDDEN,
                f"Host {text!r} is refused: this server answers to "
                f"{', '.join(f'{name}:{self.port}' for name in sorted(names))} only",
            )
        return host

    def _bound_name(self) -> str:
        return f"[{self.bound_host}]" if ":" in self.bound_host else self.bound_host.lower()

    def _check_token(self, path: str, headers: Any) -> None:
        scheme, _, given = (headers.get("Authorization") or "").partition(" ")
        if scheme.lower() != "bearer":
            given = (parse_qs(urlsplit(path).query).get("token") or [""])[0]
        if not given:
            raise Refused(
                HTTPStatus.UNAUTHORIZED,
                "this server needs its token: send 'Authorization: Bearer TOKEN', or open "
                "the address with ?token=TOKEN that dataflow serve printed",
            )
        if not hmac.compare_digest(given.strip().encode(), self.token.encode()):
            raise Refused(HTTPStatus.UNAUTHORIZED, "wrong token")

    def read_body(self, headers: Any, rfile: Any) -> bytes:
        """The body of a POST, exactly ``Content-Length`` bytes, or ``Refused``: 411 when
        the length is not given, 400 when it is not one whole number or the body ends (or
        stops arriving: the socket's read timeout) before it, 413 when it is larger than
        ``max_body_bytes`` (nothing of it is read)."""
        if headers.get("Transfer-Encoding") is not None:
            raise Refused(
                HTTPStatus.LENGTH_REQUIRED,
                "a chunked body is not read: send the body whole with a Content-Length",
            )
        values = {value.strip() for value in headers.get_all("Content-Length") or ()}
        if not values:
            raise Refused(
                HTTPStatus.LENGTH_REQUIRED,
                "a POST needs a Content-Length header: the size of its JSON body in bytes",
            )
        if len(values) > 1:
            raise Refused(
                HTTPStatus.BAD_REQUEST,
                f"Content-Length given several times with different values: "
                f"{', '.join(sorted(values))}",
            )
        text = values.pop()
        if not text.isascii() or not text.isdigit():
            what = "negative" if text.startswith("-") else "not a whole number of bytes"
            raise Refused(HTTPStatus.BAD_REQUEST, f"Content-Length {text!r} is {what}")
        length = int(text)
        if length > self.max_body_bytes:
            raise Refused(
                HTTPStatus.REQUEST_ENTITY_TOO_LARGE,
                f"the body is {format_size(length)} ({length} bytes); this server reads at "
                f"most {format_size(self.max_body_bytes)} (dataflow serve --max-body)",
            )
        try:
            data = rfile.read(length)
        except TimeoutError:
            data = None
        if data is None or len(data) < length:
            got = "stopped arriving" if data is None else f"ended after {len(data)} bytes"
            raise Refused(
                HTTPStatus.BAD_REQUEST,
                f"the body {got}, short of its Content-Length of {length} bytes",
            )
        return data
