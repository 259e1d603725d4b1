"""The step search's plans made ahead, in forked processes (``Ahead``).

The search (``plan.search``) plans candidates one at a time, best bound first, and each
decision (whether the next is pruned, planned straight inside the host's slow budget, or
the best so far) depends on the plans before it. Planning is pure Python, so threads do
not help; instead, where the search is about to plan a candidate, the next ones it may
plan (best bound first, not pruned by the best plan so far) are planned at the same time,
each in a process forked for it, up to ``jobs`` at once. The sequential decision is then
replayed over their results: a result is taken only for the candidate and the
``straight`` it was asked for, so the choice is the one the sequential search makes,
whatever ``jobs`` is; what the replay never asks for is dropped.

A candidate's step is lowered and priced in the searching process before the fork (on
CUDA the profiling pass runs there): a worker only plans, and touches no device. Its
plans come back pickled (a Llama 3 8B 16-round plan is about 3 MB, 0.1 s to pickle and
0.2 s to read back, against seconds to plan again) without their planner
(``Plan.spec``, a closure), which ``Searcher.keep_plan`` gives back to the chosen
shape's alone. A worker that fails is planned again in this process, which then raises
what it raised.

``DATAFLOW_SEARCH_JOBS`` sets ``jobs`` (1: one plan after another, no fork); by default
the CPUs this process may use, at most ``MOST_JOBS``.
"""

from __future__ import annotations

import multiprocessing
import os
import pickle
import traceback
from collections.abc import Iterable
from multiprocessing.connection import Connection, wait
from typing import Any

import attrs

from dataflow_training.plan.predict import default_jobs
from dataflow_training.plan.shapes import Shape

#: Names the number of processes that plan the search's candidates at once
JOBS_ENV = "DATAFLOW_SEARCH_JOBS"

#: Processes at most by default: a search's first pass makes 8 plans at most
#: (``search.MAX_PLANS``), so more would plan candidates it never asks for
MOST_JOBS = 8

#: A worker's result: the candidate as tried and its plans, each (plan options, the plan
#: pickled without its planner)
Planned = tuple[Any, list[tuple[dict[str, Any], bytes]]]


def search_jobs(device: str = "cpu") -> int:
    """Processes that plan the search's candidates at once: ``$DATAFLOW_SEARCH_JOBS``,
    else the CPUs this process may use (at most ``MOST_JOBS``); 1 where the platform
    cannot fork, and by default 1 where the search prices for a CUDA ``device``: a fork
    of a process holding a CUDA context and the profiling pass's threads has not been
    run on a GPU yet (session 29), so there it is only by ``$DATAFLOW_SEARCH_JOBS``."""
    named = os.environ.get(JOBS_ENV, "").strip()
    if named:
        jobs = int(named) if named.isdigit() else 0
        if jobs < 1:
            raise ValueError(
                f"{JOBS_ENV}={named!r}: give the number of processes that plan the step "
                "search's candidates at once, 1 or more (1: one after another)"
            )
        return jobs
    if "fork" not in multiprocessing.get_all_start_methods() or device.startswith("cuda"):
        return 1
    return min(default_jobs(), MOST_JOBS)


class Ahead:
    """The plans of one searcher's candidates, ``jobs`` at once (module docstring)."""

    def __init__(self, searcher: Any, jobs: int) -> None:
        self.searcher, self.jobs = searcher, jobs
        self._context = multiprocessing.get_context("fork") if jobs > 1 else None
        self._done: dict[tuple[Shape, bool], Planned | None] = {}
        self._running: dict[tuple[Shape, bool], tuple[Any, Connection]] = {}

    def tried(
        self,
        shape: Shape,
        bound: float,
        straight: bool,
        later: Iterable[tuple[Shape, float]] = (),
    ) -> Any:
        """``searcher.try_shape(shape, bound, straight)``; with ``jobs`` > 1, ``later``
        (the candidates the search may plan next, with their bounds, in that order) are
        planned meanwhile with the same ``straight``."""
        if self._context is None:
            return self.searcher.try_shape(shape, bound, straight)
        key = (shape, straight)
        wanted = [(key, bound)] + [((s, straight), b) for s, b in later]
        keys = {k for k, _ in wanted}
        while key not in self._done:
            if key not in self._running:  # what the search no longer asks for gives way
                for stale in [k for k in self._running if k not in keys]:
                    self._stop(stale)
            for k, b in wanted:
                if len(self._running) >= self.jobs:
                    break
                if k not in self._done and k not in self._running:
                    self._start(k, b)
            self._collect()
        done = self._done.pop(key)
        if done is None:  # the worker failed: again here, which raises what it raised
            return self.searcher.try_shape(shape, bound, straight)
        tried, plans = done
        self.searcher.adopt(shape, plans)
        return tried

    def close(self) -> None:
        """Stop every worker still planning (candidates the search did not ask for)."""
        for key in list(self._running):
            self._stop(key)
        self._done.clear()

    def _start(self, key: tuple[Shape, bool], bound: float) -> None:
        shape, straight = key
        self.searcher.lowered(shape)  # lowered and priced here: the worker only plans
        receive, send = self._context.Pipe(duplex=False)
        worker = self._context.Process(
            target=_plan_ahead, args=(self.searcher, shape, bound, straight, send), daemon=True
        )
        worker.start()
        send.close()
        self._running[key] = (worker, receive)

    def _collect(self) -> None:
        """Wait for a worker to finish and keep what it sent (None: it failed)."""
        by_connection = {receive: key for key, (_, receive) in self._running.items()}
        for receive in wait(list(by_connection)):
            key = by_connection[receive]
            worker, _ = self._running.pop(key)
            try:
                status, *result = pickle.loads(receive.recv_bytes())
            except (EOFError, OSError, pickle.UnpicklingError):
                status, result = "failed", []
            receive.close()
            worker.join()
            self._done[key] = tuple(result) if status == "done" else None

    def _stop(self, key: tuple[Shape, bool]) -> None:
        worker, receive = self._running.pop(key)
        worker.terminate()
        worker.join()
        receive.close()


def _plan_ahead(searcher: Any, shape: Shape, bound: float, straight: bool, send: Any) -> None:
    """A worker: ``shape`` tried, sent back with its plans pickled (``Planned``), or
    ``failed`` with the traceback."""
    try:
        tried = searcher.try_shape(shape, bound, straight)
        plans = [
            (options, pickle.dumps(attrs.evolve(made, spec=None), pickle.HIGHEST_PROTOCOL))
            for options, made in searcher.plans_of(shape)
        ]
        payload = pickle.dumps(("done", tried, plans), pickle.HIGHEST_PROTOCOL)
    except BaseException:  # noqa: BLE001 - the searching process plans it again and raises
        payload = pickle.dumps(("failed", traceback.format_exc()))
    send.send_bytes(payload)
    send.close()
