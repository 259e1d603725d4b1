"""The collective link (docs/execution_model.md#the-collective-link), worked by hand.

A two-layer backward of a fleet member: each layer's gradient is all-reduced on the
collective link while compute runs the layer below; the optimizer waits for both.
Link: 10 bytes/us, 2 us latency, so reducing 100 bytes takes 12 us.
"""

from __future__ import annotations

import pytest

from dataflow.engine import Engine, EngineRunError
from dataflow.schema import Link, Links, Obj, Program, Task, validate
from dataflow.sim import simulate
from dataflow.timeline import chrome_trace

LINK = Link(bw_bytes_per_us=10.0, latency_us=2.0)


def backward(**changes) -> Program:
    tasks = {
        "bwd1": Task("bwd1", "bwd", "k", inputs=("W1",), outputs=("dW1",), cost_us=10.0),
        "ar1": Task("ar1", "allreduce", "k", mutates=("dW1",), resource="collective"),
        "bwd0": Task("bwd0", "bwd", "k", inputs=("W0",), outputs=("dW0",), cost_us=5.0),
        "ar0": Task("ar0", "allreduce", "k", mutates=("dW0",), resource="collective"),
        "opt": Task("opt", "opt", "k", mutates=("W0", "W1"), inputs=("dW0", "dW1"), cost_us=3.0),
    }
    tasks.update(changes)
    return Program(
        name="backward",
        objects=(
            Obj("W0", 50, "param", "fast"),
            Obj("W1", 50, "param", "fast"),
            Obj("dW0", 100, "grad"),
            Obj("dW1", 100, "grad"),
        ),
        tasks=tuple(tasks.values()),
        links=Links(collective=LINK),
    )


def spans(result) -> dict[str, tuple[float, float]]:
    return {t.task_id: (t.start_us, t.end_us) for t in result.tasks}


def test_each_all_reduce_overlaps_the_backward_below_it() -> None:
    result = simulate(backward())
    assert result.valid
    # ar1 starts when bwd1 ends and runs beside bwd0; ar0 waits for the link (ar1), and
    # opt for ar0, whose gradient it reads.
    assert spans(result) == {
        "bwd1": (0.0, 10.0),
        "ar1": (10.0, 22.0),
        "bwd0": (10.0, 15.0),
        "ar0": (22.0, 34.0),
        "opt": (34.0, 37.0),
    }
    assert [t.task_id for t in result.tasks] == ["bwd1", "ar1", "bwd0", "ar0", "opt"]
    assert result.makespan_us == 37.0
    assert result.compute_busy_us == 18.0
    assert (result.collective.transfers, result.collective.bytes) == (2, 200)
    assert result.collective.busy_us == 24.0
    # ar1 ran 5 us under bwd0 and 7 us alone; ar0 ran alone: 19 us exposed, 5 hidden
    assert result.collective_exposed_us == 19.0


def test_the_virtual_engine_gives_the_same_timeline() -> None:
    program = backward()
    with Engine("virtual") as engine:
        engine.load(program)
        trace = engine.run().steps[0]
    assert {t.task: (t.start_us, t.end_us) for t in trace.tasks} == spans(simulate(program))
    assert trace.makespan_us == 37.0


def test_a_compute_task_that_uses_what_is_being_reduced_waits() -> None:
    # bwd0 also reads dW1 (a made-up dependence): it waits for ar1 to end
    program = backward(
        bwd0=Task("bwd0", "bwd", "k", inputs=("W0", "dW1"), outputs=("dW0",), cost_us=5.0)
    )
    result = simulate(program)
    assert spans(result)["bwd0"] == (22.0, 27.0)
    assert spans(result)["ar0"] == (27.0, 39.0)
    assert result.makespan_us == 42.0


def test_dropping_an_object_while_it_is_reduced_is_an_error_in_both() -> None:
    # bwd0 ends at 15 while ar1 still reduces dW1 (until 22): offloading dW1 then would
    # copy a half-reduced gradient
    program = backward(
        bwd0=Task(
            "bwd0", "bwd", "k", inputs=("W0",), outputs=("dW0",), cost_us=5.0, offloads=("dW1",)
        )
    )
    result = simulate(program)
    assert not result.valid
    assert (result.error.kind, result.error.task) == ("offload-not-resident", "bwd0")
    assert "collective task 'ar1' is still reducing it" in result.error.message
    with Engine("virtual") as engine:
        engine.load(program)
        with pytest.raises(EngineRunError, match="still reducing") as failed:
            engine.run()
    assert (failed.value.kind, failed.value.task) == ("offload-not-resident", "bwd0")


def test_validate_names_collective_tasks_that_cannot_be_priced() -> None:
    program = backward(
        ar1=Task("ar1", "allreduce", "k", mutates=("dW1",), cost_us=4.0, resource="collective"),
        ar0=Task("ar0", "allreduce", "k", inputs=("dW0",), resource="collective"),
    )
    codes = {(p.code, p.task) for p in validate(program)}
    assert codes == {("collective-cost", "ar1"), ("collective-mutates", "ar0")}
    unlinked = Program(program.name, program.objects, backward().tasks)
    assert {(p.code, p.task) for p in validate(unlinked)} == {
        ("collective-link", "ar1"),
        ("collective-link", "ar0"),
    }


def test_the_json_form_keeps_the_link_and_the_resource() -> None:
    program = backward()
    again = Program.from_json(program.to_json())
    assert again == program
    assert again.tasks[1].collective and again.links.collective == LINK
    assert '"resource"' not in Program(program.name, program.objects, program.tasks[:1]).to_json()


def test_the_trace_has_a_collective_track() -> None:
    document = chrome_trace(simulate(backward()).to_timeline())
    events = document["traceEvents"]
    names = {e["tid"]: e["args"]["name"] for e in events if e["name"] == "thread_name"}
    on_track = {e["name"]: names[e["tid"]] for e in events if e["ph"] == "X"}
    assert on_track["ar1"] == on_track["ar0"] == "collective"
    assert on_track["bwd0"] == "compute"
