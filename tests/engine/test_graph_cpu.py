"""What decides whether a step may be captured into a CUDA graph, checked without CUDA."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")
chain = pytest.importorskip("dataflow_resolver_matmul_chain.chain")

from dataflow_resolver_matmul_chain.resolver import build  # noqa: E402

from dataflow.engine.backends.torch_graph import DeviceValues, not_capturable  # noqa: E402


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
