"""The Perfetto trace of a prediction and a measurement, checked strictly against the
trace-event format (``dataflow.testing.trace_events``; Perfetto's trace_processor needs a
binary download, so it is not used), and the check itself against planted faults."""

from __future__ import annotations

import copy
from pathlib import Path

import attrs
import pytest

from dataflow.bundle import bundle_of, plan_summary
from dataflow.engine import Engine
from dataflow.planning import minimal_budget, place, plan
from dataflow.schema import Program
from dataflow.testing.trace_events import trace_event_problems
from dataflow.timeline import TransferSpan
from dataflow.timeline.perfetto import flow_chains, perfetto_trace, tracks_of

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "programs" / "training_step.json"


@pytest.fixture(scope="module")
def bundle():
    from dataflow.bundle import measured_timeline

    program = Program.from_json(EXAMPLE)
    placement = place(plan(program, int(minimal_budget(program) * 1.1)))
    predicted = bundle_of(placement, plan_summary(placement, "program"))
    with Engine("virtual") as engine:  # replays the simulator's timeline, with jitter below
        engine.load(placement.plan)
        result = engine.run(steps=2)
    steps = [result.to_timeline(i) for i in range(2)]
    assert min(s.duration_us for s in steps[-1].tasks) > 3.0
    faster = [attrs.evolve(s, end_us=s.end_us - 3.0) for s in steps[-1].tasks]
    # each task 3 us shorter than predicted, nothing else moved: a measurement to compare
    steps[-1] = attrs.evolve(steps[-1], tasks=faster)
    measured = measured_timeline(placement.plan.program, steps, predicted.timeline)
    return attrs.evolve(predicted, measured=measured)


def _events(document, ph, pid=None):
    return [
        e for e in document["traceEvents"] if e["ph"] == ph and (pid is None or e["pid"] == pid)
    ]


def test_the_trace_is_sound_trace_event_json(bundle) -> None:
    document = perfetto_trace(bundle.timeline, bundle.measured)
    assert trace_event_problems(document) == []
    assert trace_event_problems(perfetto_trace(bundle.timeline)) == []


def test_two_processes_with_compute_and_link_tracks(bundle) -> None:
    document = perfetto_trace(bundle.timeline, bundle.measured)
    names = {
        e["pid"]: e["args"]["name"] for e in _events(document, "M") if e["name"] == "process_name"
    }
    assert names[1].startswith("predicted") and names[2].startswith("measured")
    threads = {
        (e["pid"], e["args"]["name"]) for e in _events(document, "M") if e["name"] == "thread_name"
    }
    assert threads == {(pid, t) for pid in (1, 2) for t in ("compute", "h2d", "d2h")}
    tasks = len(bundle.program.tasks)
    for pid in (1, 2):
        assert len([e for e in _events(document, "X", pid) if e["tid"] == 1]) == tasks


def test_slices_carry_bytes_both_times_and_their_difference(bundle) -> None:
    document = perfetto_trace(bundle.timeline, bundle.measured)
    sizes = {o.id: o.size_bytes for o in bundle.program.objects}
    for event in _events(document, "X"):
        args = event["args"]
        assert args["diff_us"] == pytest.approx(args["measured_us"] - args["predicted_us"])
        if event["tid"] == 1:
            assert args["diff_us"] == pytest.approx(-3.0)
            task = bundle.program.tasks_by_id[event["name"]]
            assert args["bytes"] == sum(sizes[o] for o in task.inputs + task.mutates + task.outputs)
        else:
            assert args["bytes"] == sizes[event["name"]]
            assert args["diff_us"] == pytest.approx(0.0, abs=1e-6)


def test_counters_by_role_against_the_budget_and_per_link(bundle) -> None:
    document = perfetto_trace(bundle.timeline, bundle.measured)
    counters = {e["name"] for e in _events(document, "C", 1)}
    for role in ("params", "grads", "optimizer state", "activations", "aux"):
        assert f"fast memory: {role}" in counters
    assert {"fast memory", "fast memory budget", "h2d GB/s", "d2h GB/s"} <= counters
    budget = {
        e["args"]["bytes"] for e in _events(document, "C", 1) if e["name"] == "fast memory budget"
    }
    assert budget == {bundle.plan.planned_budget_bytes}


def test_flows_run_from_the_writer_through_the_transfer_to_the_reader(bundle) -> None:
    program = bundle.program
    chains = flow_chains(bundle.timeline)
    assert len(chains) == len(bundle.timeline.transfers)
    order = {t.id: i for i, t in enumerate(program.tasks)}
    full = [c for c in chains if c[0] is not None and c[2] is not None]
    assert full, "an offloaded and re-fetched object gives a whole chain"
    for source, transfer, sink in full:
        writer, reader = program.tasks_by_id[source.task_id], program.tasks_by_id[sink.task_id]
        assert (
            transfer.obj_id in writer.outputs + writer.mutates or transfer.enqueued_by == writer.id
        )
        assert transfer.obj_id in reader.inputs + reader.mutates
        assert order[writer.id] < order[reader.id]
        assert source.end_us <= transfer.start_us and transfer.end_us <= sink.start_us
    document = perfetto_trace(bundle.timeline)
    starts = _events(document, "s")
    assert len(starts) == len(_events(document, "f")) == len([c for c in chains if c[0] or c[2]])


def test_stalls_are_instants_on_the_compute_track(bundle) -> None:
    document = perfetto_trace(bundle.timeline, bundle.measured)
    instants = _events(document, "i", 1)
    assert len(instants) == len(bundle.timeline.instants) > 0
    assert all(e["tid"] == 1 and e["args"]["waited_us"] > 0 for e in instants)


def test_another_link_gets_a_track_of_its_own(bundle) -> None:
    with attrs.validators.disabled():  # a link the records do not know yet (the fleet's)
        extra = TransferSpan("gW_0", "collective", 64, 1.0, 2.0)
    timeline = attrs.evolve(bundle.timeline, transfers=(*bundle.timeline.transfers, extra))
    assert tracks_of(timeline) == ["compute", "h2d", "d2h", "collective"]
    document = perfetto_trace(timeline)
    assert trace_event_problems(document) == []
    assert [e["name"] for e in _events(document, "X") if e["tid"] == 4] == ["gW_0"]


def _planted(document, change):
    broken = copy.deepcopy(document)
    change(broken["traceEvents"])
    return trace_event_problems(broken)


def _first(events, ph):
    return next(e for e in events if e["ph"] == ph)


@pytest.mark.parametrize(
    ("change", "problem"),
    [
        (lambda ev: _first(ev, "X").pop("dur"), "missing dur"),
        (lambda ev: _first(ev, "X").update(dur=-1), "dur -1"),
        (lambda ev: _first(ev, "C").update(args={"bytes": "12"}), "are not numbers"),
        (lambda ev: _first(ev, "i").update(s="x"), "scope"),
        (lambda ev: ev.remove(_first(ev, "f")), "one s first, one f"),
        (lambda ev: _first(ev, "s").update(ts=-5.0), "in no slice"),
        (lambda ev: ev.append({**_first(ev, "X"), "ts": 0.0}), "starts before"),
        (lambda ev: ev.append({"ph": "Q", "pid": 1}), "unknown phase"),
    ],
)
def test_the_check_finds_planted_faults(bundle, change, problem) -> None:
    document = perfetto_trace(bundle.timeline, bundle.measured)
    problems = _planted(document, change)
    assert any(problem in line for line in problems), problems


def test_the_check_refuses_what_is_not_json() -> None:
    assert trace_event_problems({"traceEvents": [{"ph": "C", "ts": float("nan")}]})
    assert trace_event_problems({"events": []}) == ["no traceEvents list"]
