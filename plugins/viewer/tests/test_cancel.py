"""A request's work stops when its client leaves or its time is up: a real slow request
(GPT-2 tiny at 64 rounds: about a minute of planning and simulating) to a real server
thread over a real socket, and the worker thread seen to end."""

from __future__ import annotations

import json
import socket
import time

import pytest
from dataflow_viewer.guard import Limits
from dataflow_viewer.server import DEFAULTS, serve_in_thread

#: a request whose work takes about a minute (the budget sweep of 64 rounds)
SLOW = json.dumps({**DEFAULTS, "rounds": 64}).encode()
#: how soon after its client leaves (or its time is up) a worker must have ended
STOPS_WITHIN_S = 3.0
TIME_LIMIT_S = 2.0
#: how late past the limit the answer may come on a loaded machine (see its test)
LOADED_STOP_S = 10.0


@pytest.fixture(scope="module")
def server():
    server, thread = serve_in_thread(limits=Limits(time_limit_s=TIME_LIMIT_S))
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def send_slow(server) -> socket.socket:
    connection = socket.create_connection(server.server_address, timeout=60)
    head = f"POST /api/run HTTP/1.1\r\nHost: 127.0.0.1:{server.server_address[1]}\r\n"
    connection.sendall(f"{head}Content-Length: {len(SLOW)}\r\n\r\n".encode() + SLOW)
    return connection


def the_worker(server):
    """The worker thread of the one request in flight, once it has started."""
    deadline = time.monotonic() + 120  # the server warms up first
    while not server.working:
        assert time.monotonic() < deadline, "the request's work did not start"
        time.sleep(0.01)
    (worker,) = server.working
    return worker


def ended_within(worker, seconds: float) -> float:
    """How long ``worker`` took to end (failing past ``seconds``)."""
    start = time.monotonic()
    worker.join(seconds)
    assert not worker.is_alive(), f"the work still runs {seconds} s on"
    return time.monotonic() - start


def test_the_work_stops_when_the_client_leaves(server) -> None:
    connection = send_slow(server)
    worker = the_worker(server)
    time.sleep(0.5)  # well into the lowering and planning
    assert worker.is_alive()
    connection.close()
    assert ended_within(worker, STOPS_WITHIN_S) < STOPS_WITHIN_S
    assert worker.cancelled and worker.error is None
    assert server.working == set()


def test_the_work_stops_at_the_time_limit(server, http) -> None:
    sent = time.monotonic()
    connection = send_slow(server)
    worker = the_worker(server)
    started = time.monotonic()  # the limit counts from the work's start
    answer = b""
    while chunk := connection.recv(1 << 16):
        answer += chunk
    connection.close()
    answered = time.monotonic()
    assert answer.startswith(b"HTTP/1.0 503"), answer[:200]
    assert b"time limit of 2 s (dataflow serve --time-limit)" in answer
    assert answered - sent >= TIME_LIMIT_S
    # the answer comes once the worker has taken the stop, which it does at its next Python
    # instruction: on a loaded 2-core CI machine (two test processes) that took up to 5.5 s
    # more (a fresh-clone run, 2026-12-05), so the bound here is looser than STOPS_WITHIN_S
    assert answered - started < TIME_LIMIT_S + LOADED_STOP_S
    ended_within(worker, STOPS_WITHIN_S)
    assert worker.cancelled
    # the server goes on answering on its workers: a quick request after the stopped ones
    head = ["POST /api/run HTTP/1.1", f"Host: 127.0.0.1:{server.server_address[1]}"]
    quick = json.dumps({"batch": 0}).encode()
    reply = http(server.server_address, [*head, f"Content-Length: {len(quick)}"], quick)
    assert reply.status == 400 and reply.error.startswith("batch: 0 is not in the range")


def test_a_cancel_waits_for_an_import_to_finish(tmp_path, monkeypatch) -> None:
    """A cancel that landed inside a first-time import would leave the module half made
    for the whole process: it waits until the import is done."""
    import importlib
    import sys
    import threading

    from dataflow_viewer.cancel import Stopped, run_cancellable

    (tmp_path / "slow_to_import.py").write_text("import time\ntime.sleep(1.0)\nDONE = True\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def work() -> None:
        importlib.import_module("slow_to_import")
        while True:  # then pure Python that only a cancel ends
            pass

    live: set[threading.Thread] = set()
    start = time.monotonic()
    with pytest.raises(Stopped) as stopped:
        run_cancellable(work, time_limit_s=60, gone=lambda: True, live=live)
    assert stopped.value.why == "gone"
    assert 1.0 <= time.monotonic() - start < 1.0 + STOPS_WITHIN_S
    assert sys.modules["slow_to_import"].DONE  # imported whole, then cancelled
    assert live == set()


@pytest.mark.filterwarnings("ignore::pytest.PytestUnraisableExceptionWarning")
def test_a_cancel_lost_in_a_finalizer_is_raised_again() -> None:
    """A cancel that lands inside ``__del__`` (or a garbage-collector callback) is printed
    and lost (a CI run lost one in hypothesis' gc callback, 2026-12-05): it is raised
    again while the work runs, so the work still stops."""
    import threading

    from dataflow_viewer.cancel import Stopped, run_cancellable

    inside = threading.Event()
    swallowed: list[str] = []

    class Finalized:
        def __del__(self) -> None:
            inside.set()
            start = time.monotonic()
            try:
                while time.monotonic() - start < 5.0:  # the first cancel lands here
                    pass
            except BaseException as exc:
                swallowed.append(type(exc).__name__)
                raise  # out of __del__: printed as "Exception ignored", then lost

    def work() -> None:
        Finalized()  # dropped at once: its __del__ runs here
        deadline = time.monotonic() + 30.0  # pure Python only a cancel ends early
        while time.monotonic() < deadline:
            pass

    live: set[threading.Thread] = set()
    start = time.monotonic()
    with pytest.raises(Stopped) as stopped:
        run_cancellable(work, time_limit_s=60, gone=inside.is_set, live=live)
    assert stopped.value.why == "gone"
    assert swallowed == ["Cancelled"]  # the first cancel was lost in the finalizer
    deadline = time.monotonic() + STOPS_WITHIN_S
    while live and time.monotonic() < deadline:
        time.sleep(0.01)
    assert live == set(), "the work ran on after its cancel was lost"
    assert time.monotonic() - start < STOPS_WITHIN_S
