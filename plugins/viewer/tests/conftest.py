"""Shared fixtures: GPT-2 tiny's training step planned into 2 MiB, and a measured timeline
made from its prediction with known slowdowns (what a real run's deviations look like,
with answers known in advance); ``http``, a raw HTTP request over a real socket."""

from __future__ import annotations

import json
import socket
import time

import attrs
import pytest
from dataflow_viewer.run import Run, lower_preset, predict

from dataflow import Timeline, link_counters, stalls

BUDGET_BYTES = 2 << 20
#: task id -> how much slower the fake measurement runs it
SLOWDOWNS = {"bwd_0_0_1": 4.0, "fwd_0_0_0": 3.0, "opt_0_0_emb": 2.0}


@pytest.fixture(scope="session")
def tiny_program():
    return lower_preset("gpt2_tiny", batch=8, seq_len=64)


@pytest.fixture(scope="session")
def tiny_run(tiny_program) -> Run:
    return predict(tiny_program, BUDGET_BYTES, "pressurefit")


def slowed(run: Run, slowdowns: dict[str, float] = SLOWDOWNS) -> Timeline:
    """The prediction with each task in ``slowdowns`` that many times longer and
    everything after it shifted by the extra time, its stalls and link rates worked out
    again: a measured timeline whose deviations are known."""
    shift, tasks, moves = 0.0, [], []
    extra_at: list[tuple[float, float]] = []
    for span in sorted(run.predicted.tasks, key=lambda s: s.start_us):
        extra = span.duration_us * (slowdowns.get(span.task_id, 1.0) - 1.0)
        start = span.start_us + shift
        tasks.append(attrs.evolve(span, start_us=start, end_us=start + span.duration_us + extra))
        shift += extra
        extra_at.append((span.end_us, shift))

    def shifted(time_us: float) -> float:
        return time_us + max((s for end, s in extra_at if end <= time_us), default=0.0)

    for span in run.predicted.transfers:
        start = shifted(span.start_us)
        moves.append(attrs.evolve(span, start_us=start, end_us=start + span.duration_us))
    base = Timeline(
        "measured",
        tasks=tasks,
        transfers=moves,
        counters=[
            attrs.evolve(c, points=[(shifted(t), value) for t, value in c.points])
            for c in run.predicted.counters
            if c.name == "fast memory"
        ],
    )
    return attrs.evolve(
        base,
        counters=[*base.counters, *link_counters(base)],
        instants=stalls(base, run.program),
    )


@pytest.fixture(scope="session")
def slowdowns() -> dict[str, float]:
    return dict(SLOWDOWNS)


@pytest.fixture(scope="session")
def measured_run(tiny_run) -> Run:
    return tiny_run.with_measured(slowed(tiny_run))


@attrs.frozen
class Reply:
    """An HTTP answer read off a raw socket: its status, head, body text, and how long it
    took; ``error``: the one line of a refusal."""

    status: int
    head: str
    text: str
    seconds: float

    @property
    def error(self) -> str:
        return json.loads(self.text)["error"]


def exchange(
    address: tuple, head: list[str], body: bytes = b"", *, timeout_s: float = 60.0
) -> Reply:
    """Send the request ``head`` (request line and header lines, sent exactly as given:
    no Host or length added) and ``body`` over a new connection to ``address`` and read
    the answer to the end (the server closes after each answer)."""
    start = time.monotonic()
    with socket.create_connection(address[:2], timeout=timeout_s) as connection:
        connection.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        data = b""
        while chunk := connection.recv(1 << 16):
            data += chunk
    head_text, _, text = data.decode().partition("\r\n\r\n")
    status = int(head_text.split()[1])
    return Reply(status, head_text, text, time.monotonic() - start)


@pytest.fixture(scope="session")
def http():
    """``exchange``: one raw HTTP request over a real socket."""
    return exchange
