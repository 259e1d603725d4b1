"""Work that stops when its time is up or its client has gone (``run_cancellable``).

Planning and simulating a large step takes from seconds to minutes of pure Python, and a
request's thread cannot be stopped from outside while it computes. So the request's
thread hands the work to a worker thread and watches: every ``POLL_S`` it checks the time
limit and whether the client's socket has been closed (readable with nothing to read).
When either happens it raises ``Cancelled`` inside the worker (CPython's
``PyThreadState_SetAsyncExc``), which unwinds the work at its next Python instruction and
frees what it held; the request's thread answers (or not, for a client that left) and is
free at once. A call into C (a torch operation) is not interrupted: the work stops when
that call returns. The planner and simulator carry no cancellation hook of their own, and
a process per request would lose the caches that make re-planning fast.

An asynchronous exception that lands inside a finalizer or a garbage-collector callback
(``__del__``, ``gc.callbacks``) is printed as "Exception ignored" and lost, and the work
would run on to its end. So the cancel is raised again every ``RECANCEL_S`` for as long as
the worker is still inside the work: the worker marks its leaving the work (under the
cancel's lock, in a ``finally`` around the work), after which no cancel is raised, and one
raised just before lands at a checkpoint the worker still guards.

An exception raised inside a first-time import would leave that module half made for the
whole process (``partially initialized module 'torch'``), so the cancel waits while the
worker's stack is inside the import machinery, and the server imports what its work
needs before it takes work (``dataflow_viewer.server.warm``).
"""

from __future__ import annotations

import ctypes
import select
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

#: how often the watching thread looks at the clock and the client's socket
POLL_S = 0.05
#: how long the watching thread waits for a cancelled worker to unwind before leaving it
UNWIND_S = 5.0
#: how often a cancel not yet taken (lost in a finalizer, or postponed by an import) is
#: raised again while the worker is still inside the work
RECANCEL_S = 0.25


class Cancelled(BaseException):
    """Raised inside a worker to stop it (a BaseException: ``except Exception`` in the
    work does not swallow it)."""


class Stopped(Exception):
    """The work was cancelled: ``why`` is ``"time"`` (the limit passed) or ``"gone"``
    (the client closed its connection); ``seconds`` how long it had run."""

    def __init__(self, why: str, seconds: float) -> None:
        super().__init__(f"stopped ({why}) after {seconds:.1f} s")
        self.why = why
        self.seconds = seconds


def client_gone(connection: socket.socket) -> bool:
    """Whether the peer of ``connection`` has closed it: the socket reads as ready with
    no bytes (or fails). A client that only shut down its sending side counts as gone."""
    try:
        ready, _, _ = select.select([connection], [], [], 0)
        return bool(ready) and connection.recv(1, socket.MSG_PEEK) == b""
    except (OSError, ValueError):  # reset, or already closed here
        return True


class _Worker(threading.Thread):
    """Runs ``work`` once; ``cancel`` stops it unless it has already finished."""

    def __init__(self, work: Callable[[], Any], live: set[threading.Thread]) -> None:
        super().__init__(daemon=True, name="dataflow-serve-work")
        self._work, self._live = work, live
        self._lock = threading.Lock()
        self._running = True
        self.done = threading.Event()
        self.value: Any = None
        self.error: BaseException | None = None
        self.cancelled = False

    def run(self) -> None:
        try:
            try:
                self.value = self._in_work()
            except Exception as exc:  # handed to the waiting thread, which answers it
                self.error = exc
            _checkpoint()  # a cancel raised just before the work was left lands here
        except Cancelled:
            self.cancelled = True
        finally:
            self._live.discard(self)
            self.done.set()

    def _in_work(self) -> Any:
        """The work, marked as left (no more cancels) however it ends."""
        try:
            return self._work()
        finally:
            with self._lock:
                self._running = False

    def cancel(self) -> bool:
        """Raise ``Cancelled`` in the worker (again, if an earlier one was lost), unless
        it has left the work (True) or is importing (False: ask again later)."""
        with self._lock:
            if not self._running:
                return True
            if _importing(self.ident):
                return False
            ctypes.pythonapi.PyThreadState_SetAsyncExc(
                ctypes.c_ulong(self.ident), ctypes.py_object(Cancelled)
            )
            return True


def _checkpoint() -> None:
    """A Python call: a pending asynchronous exception is raised at its start."""


def _importing(thread_id: int) -> bool:
    """Whether the thread's stack is inside the import machinery."""
    frame = sys._current_frames().get(thread_id)
    while frame is not None:
        if frame.f_code.co_filename.startswith("<frozen importlib"):
            return True
        frame = frame.f_back
    return False


def run_cancellable(
    work: Callable[[], Any],
    *,
    time_limit_s: float,
    gone: Callable[[], bool],
    live: set[threading.Thread],
) -> Any:
    """``work()`` on a worker thread (kept in ``live`` while it runs), its value or its
    exception; ``Stopped`` when ``time_limit_s`` passes or ``gone()`` turns true first,
    the worker then cancelled."""
    start = time.monotonic()
    worker = _Worker(work, live)
    live.add(worker)
    worker.start()
    why = None
    while not worker.done.wait(POLL_S):
        elapsed = time.monotonic() - start
        if why is None:
            why = "time" if elapsed > time_limit_s else "gone" if gone() else None
        if why is not None and worker.cancel():  # postponed while the worker imports
            unwind = time.monotonic() + UNWIND_S
            while not worker.done.wait(RECANCEL_S) and time.monotonic() < unwind:
                worker.cancel()  # once more, in case the last one was lost
            raise Stopped(why, elapsed)
    if worker.error is not None:
        raise worker.error
    return worker.value
