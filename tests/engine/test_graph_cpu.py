"""What decides whether a step may be captured into a CUDA graph, checked without CUDA."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")

from dataflow_resolver_matmul_chain.resolver import build  # noqa: E402

from dataflow.engine.backends.torch_graph import (  # noqa: E402
    DeviceValues,
    not_capturable,
    trace_activity,
    union_us,
)


def test_not_capturable_names_the_first_task_that_does_not_declare_it() -> None:
    program = chain.build_program(2, 16, 8)
    resolver = build(program)

    class Plain:
        def launch(self, ctx):  # pragma: no cover - never launched
            pass

    executables = [resolver(task) for task in program.tasks]
    assert not_capturable(program, executables) is None
    executables[1] = Plain()
    reason = not_capturable(program, executables)
    assert program.tasks[1].id in reason and "capturable" in reason and "Plain" in reason


def test_only_numbers_can_be_device_values() -> None:
    assert DeviceValues.unsupported({"lr": 1e-3, "step": 3, "flag": True}) is None
    reason = DeviceValues.unsupported({"lr": 1e-3, "schedule": "cosine"})
    assert "schedule" in reason and "str" in reason


def test_graph_on_cpu_is_refused_with_one_line() -> None:
    from dataflow.engine import Engine
    from dataflow.planning import plan

    program = chain.build_program(2, 16, 8)
    values = chain.initial_values(program)
    planned = plan(program, 2**30)
    with Engine("torch", device="cpu", graph=True) as engine:
        engine.load(planned, build(planned.program), initial=values)
        with pytest.warns(RuntimeWarning, match="CUDA graphs need"):
            engine.run(steps=2, feed=lambda _step: values)
    assert "\n" not in engine.graph_note


def test_union_of_intervals() -> None:
    assert union_us([]) == 0
    assert union_us([(0, 10), (5, 15), (20, 25), (21, 22)]) == 20
    assert union_us([(3, 4), (0, 1)]) == 2


def test_trace_activity_splits_kernels_device_copies_and_each_link() -> None:
    events = [
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 0, "dur": 10},
        {"ph": "X", "cat": "kernel", "name": "k", "ts": 5, "dur": 10},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoD", "ts": 20, "dur": 5},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy HtoD", "ts": 0, "dur": 30,
         "args": {"bytes": 64}},
        {"ph": "X", "cat": "gpu_memcpy", "name": "Memcpy DtoH", "ts": 40, "dur": 2,
         "args": {"bytes": 8}},
        {"ph": "i", "cat": "kernel", "name": "not a span", "ts": 100},
    ]  # fmt: skip
    found = trace_activity(events)
    assert found["kernel_busy_us"] == 15 and found["compute_busy_us"] == 20
    assert found["h2d_busy_us"] == 30 and found["d2h_busy_us"] == 2
    assert found["h2d_bytes"] == 64 and found["d2h_bytes"] == 8
    assert found["span_us"] == 42
    assert trace_activity([])["span_us"] == 0.0
