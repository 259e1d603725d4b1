"""Who may ask ``dataflow serve``, and what it reads: real requests over real sockets to a
real server thread, each refused (or answered) before any work."""

from __future__ import annotations

import json
import socket
import time

import pytest
from dataflow_viewer.guard import Limits
from dataflow_viewer.server import serve_in_thread

READ_TIMEOUT_S = 0.5
MAX_BODY_BYTES = 1 << 20
TOKEN = "a-token-of-thirty-two-characters"
#: a run refused for its field, at once: a request that gets this far was let in
ADMITTED = json.dumps({"nonsense": 1}).encode()
#: a path that is not there: a 404 is a request that was let in (the page takes long to
#: build the first time)
NOWHERE = "/nowhere"


def start(**options):
    limits = Limits(read_timeout_s=READ_TIMEOUT_S, max_body_bytes=MAX_BODY_BYTES)
    server, thread = serve_in_thread(limits=limits, warm_up=False, **options)
    return server, thread


def stop(server, thread) -> None:
    server.shutdown()
    server.server_close()
    thread.join(5)


@pytest.fixture(scope="module")
def server():
    server, thread = start()
    yield server
    stop(server, thread)


@pytest.fixture(scope="module")
def exposed():
    server, thread = start(host="0.0.0.0", token=TOKEN)  # as --expose --host 0.0.0.0
    yield server
    stop(server, thread)


def port(server) -> int:
    return server.server_address[1]


def get(server, http, *headers: str, path: str = NOWHERE):
    return http(server.server_address, [f"GET {path} HTTP/1.1", *headers])


def post(server, http, *headers: str, body: bytes = ADMITTED):
    sized = [f"Content-Length: {len(body)}"]
    return http(server.server_address, ["POST /api/run HTTP/1.1", *headers, *sized], body)


def read_to_end(connection: socket.socket) -> str:
    data = b""
    while chunk := connection.recv(1 << 16):
        data += chunk
    return data.decode()


def admitted(reply) -> bool:
    """Whether the request was let in: answered, or refused for its path or its field."""
    return reply.status == 200 or "no page" in reply.text or "no such field" in reply.text


# Host: only this machine's names, with this server's port


@pytest.mark.parametrize("name", ["127.0.0.1", "localhost", "LocalHost", "[::1]"])
def test_loopback_hosts_are_answered(server, http, name) -> None:
    host = f"Host: {name}:{port(server)}"
    assert admitted(get(server, http, host)) and admitted(post(server, http, host))


@pytest.mark.parametrize(
    "host",
    [
        "evil.example:{port}",  # a rebinding page's own name
        "evil.example",
        "127.0.0.1.nip.io:{port}",
        "127.0.0.1:{other}",  # another port of this machine
        "localhost",  # port 80
        "",
        None,  # no Host at all
    ],
)
def test_foreign_hosts_are_refused(server, http, host) -> None:
    head = [] if host is None else [f"Host: {host.format(port=port(server), other=1)}"]
    for reply in (get(server, http, *head), post(server, http, *head)):
        assert reply.status == 403, reply
        assert "Host" in reply.error and "\n" not in reply.error
    assert server.working == set()  # nothing was computed


# Origin: the page's own, or none (a program, not a browser)


@pytest.mark.parametrize(
    ("origin", "host"),
    [
        ("http://evil.example", "127.0.0.1"),
        ("null", "127.0.0.1"),  # a sandboxed frame, a file:// page
        ("http://localhost:{port}", "127.0.0.1"),  # another origin of this machine
        ("http://127.0.0.1:{other}", "127.0.0.1"),  # another server on this machine
        ("https://127.0.0.1:{port}", "127.0.0.1"),
    ],
)
def test_foreign_origins_are_refused(server, http, origin, host) -> None:
    headers = [
        f"Host: {host}:{port(server)}",
        f"Origin: {origin.format(port=port(server), other=1)}",
    ]
    for reply in (post(server, http, *headers), get(server, http, *headers)):
        assert reply.status == 403, reply
        assert "another web page" in reply.error
    assert server.working == set()


@pytest.mark.parametrize("site", ["cross-site", "same-site"])
def test_a_post_another_site_sent_is_refused(server, http, site) -> None:
    reply = post(server, http, f"Host: localhost:{port(server)}", f"Sec-Fetch-Site: {site}")
    assert reply.status == 403 and f"Sec-Fetch-Site {site}" in reply.error


def test_the_pages_own_requests_are_answered(server, http) -> None:
    host = f"localhost:{port(server)}"
    own = [f"Host: {host}", f"Origin: http://{host}", "Sec-Fetch-Site: same-origin"]
    reply = post(server, http, *own, body=json.dumps({"budget": "3MiB"}).encode())
    assert reply.status == 200 and json.loads(reply.text)["budget_bytes"] == 3 << 20
    # a link followed from another site opens the page (a navigation has no Origin)
    page = get(server, http, f"Host: {host}", "Sec-Fetch-Site: cross-site", path="/")
    assert page.status == 200 and 'id="controls"' in page.text


# Content-Length: one whole number, at most the limit, and the body arrives


@pytest.mark.parametrize(
    ("lengths", "status", "said"),
    [
        ([], 411, "needs a Content-Length"),
        (["abc"], 400, "'abc' is not a whole number"),
        (["-5"], 400, "'-5' is negative"),
        (["1e3"], 400, "not a whole number"),
        (["+5"], 400, "not a whole number"),
        (["5", "6"], 400, "several"),
        ([str(MAX_BODY_BYTES + 1)], 413, "at most 1 MiB"),
        ([str(10**30)], 413, "at most 1 MiB"),
    ],
)
def test_a_bad_content_length_is_refused_at_once(server, http, lengths, status, said) -> None:
    head = ["POST /api/run HTTP/1.1", f"Host: 127.0.0.1:{port(server)}"]
    reply = http(server.server_address, head + [f"Content-Length: {n}" for n in lengths], b"{}")
    assert reply.status == status and said in reply.error, reply
    assert reply.seconds < READ_TIMEOUT_S + 2  # answered without waiting for a body
    assert server.working == set()


def test_a_chunked_body_is_refused(server, http) -> None:
    head = ["POST /api/run HTTP/1.1", f"Host: 127.0.0.1:{port(server)}"]
    reply = http(server.server_address, [*head, "Transfer-Encoding: chunked"], b"2\r\n{}\r\n0\r\n")
    assert reply.status == 411 and "chunked" in reply.error


def test_a_body_too_large_is_refused_while_it_is_sent(server, http) -> None:
    body = b" " * (2 * MAX_BODY_BYTES)  # the client writes it all; the answer still comes
    reply = post(server, http, f"Host: 127.0.0.1:{port(server)}", body=body)
    assert reply.status == 413 and "2 MiB" in reply.error


def test_a_body_that_stops_short_is_refused_after_the_read_timeout(server) -> None:
    with socket.create_connection(server.server_address, timeout=30) as connection:
        head = f"POST /api/run HTTP/1.1\r\nHost: 127.0.0.1:{port(server)}\r\n"
        connection.sendall(f"{head}Content-Length: 100\r\n\r\n{{}}".encode())
        start = time.monotonic()
        answer = read_to_end(connection)  # the connection stays open meanwhile
        seconds = time.monotonic() - start
    assert answer.startswith("HTTP/1.0 400") and "stopped arriving" in answer
    assert READ_TIMEOUT_S * 0.8 < seconds < READ_TIMEOUT_S + 2


def test_a_body_that_ends_short_is_refused(server) -> None:
    with socket.create_connection(server.server_address, timeout=30) as connection:
        head = f"POST /api/run HTTP/1.1\r\nHost: 127.0.0.1:{port(server)}\r\n"
        connection.sendall(f"{head}Content-Length: 100\r\n\r\n{{}}".encode())
        connection.shutdown(socket.SHUT_WR)
        answer = read_to_end(connection)
    assert answer.startswith("HTTP/1.0 400") and "ended after 2 bytes" in answer


def test_a_silent_connection_is_closed_after_the_read_timeout(server) -> None:
    with socket.create_connection(server.server_address, timeout=30) as connection:
        connection.sendall(b"GET / HTTP/1.1\r\n")  # and never the rest of the head
        start = time.monotonic()
        assert connection.recv(1 << 16) == b""  # closed, its thread free
        assert time.monotonic() - start < READ_TIMEOUT_S + 2


@pytest.mark.parametrize(
    ("body", "said"), [(b"{not json", "not JSON"), (b"[1, 2]", "a JSON object"), (b"\xff", "JSON")]
)
def test_a_body_that_is_not_a_json_object_is_400(server, http, body, said) -> None:
    reply = post(server, http, f"Host: 127.0.0.1:{port(server)}", body=body)
    assert reply.status == 400 and said in reply.error


# An exposed server: any Host, and the token on every request


def test_an_exposed_server_wants_its_token(exposed, http) -> None:
    host = "Host: workstation.lan:1234"  # whatever name it was reached by
    for reply in (get(exposed, http, host), post(exposed, http, host)):
        assert reply.status == 401 and "needs its token" in reply.error
        assert "WWW-Authenticate: Bearer" in reply.head
    for wrong in ("Authorization: Bearer not-the-token", f"Authorization: Basic {TOKEN}"):
        assert post(exposed, http, host, wrong).status == 401
    assert get(exposed, http, host, path="/?token=wrong").status == 401
    assert exposed.working == set()


def test_a_server_beyond_loopback_needs_a_token() -> None:
    with pytest.raises(ValueError, match="needs a token"):
        start(host="0.0.0.0")


def test_a_loopback_server_with_a_token_wants_both(http) -> None:
    server, thread = start(token=TOKEN)
    try:
        bearer = f"Authorization: Bearer {TOKEN}"
        assert get(server, http, f"Host: evil.example:{port(server)}", bearer).status == 403
        assert get(server, http, f"Host: localhost:{port(server)}").status == 401
        assert admitted(get(server, http, f"Host: localhost:{port(server)}", bearer))
    finally:
        stop(server, thread)


def test_an_exposed_server_answers_with_its_token(exposed, http) -> None:
    host = "Host: workstation.lan:1234"
    assert admitted(get(exposed, http, host, path=f"{NOWHERE}?token={TOKEN}"))
    assert admitted(post(exposed, http, host, f"Authorization: Bearer {TOKEN}"))
    foreign = post(
        exposed, http, host, f"Authorization: Bearer {TOKEN}", "Origin: http://evil.example"
    )
    assert foreign.status == 403  # the token does not let another page in
