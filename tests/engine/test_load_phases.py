"""``Engine.load_seconds``: where a load's time went, phase by phase."""

from __future__ import annotations

import time

import pytest

pytest.importorskip("torch")
chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")

from dataflow_resolver_matmul_chain.resolver import build  # noqa: E402

from dataflow.engine import Engine  # noqa: E402
from dataflow.planning import plan  # noqa: E402


def test_each_phase_is_timed_where_it_runs() -> None:
    program = chain.build_program(2, 16, 8)
    planned = plan(program, 2**30)
    resolver = build(planned.program)
    values = chain.initial_values(program)

    def slow_resolver(task):
        time.sleep(0.02)
        return resolver(task)

    class SlowValues(dict):
        def __getitem__(self, key):
            time.sleep(0.02)
            return super().__getitem__(key)

    with Engine("torch", device="cpu") as engine:
        assert engine.load_seconds == {}
        engine.load(planned, slow_resolver, initial=SlowValues(values))
        phases = engine.load_seconds
    assert list(phases) == ["resolve", "storage", "start values"]
    assert phases["resolve"] >= 0.02 * len(program.tasks)
    assert phases["start values"] >= 0.02 * len(values)
    assert phases["storage"] < min(phases["resolve"], phases["start values"])
