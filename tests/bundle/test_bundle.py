"""Bundles: files written and read back, errors naming the file, and the predicted
timeline's extra counters and stalls checked against the simulator's own totals."""

from __future__ import annotations

import json
from pathlib import Path

import attrs
import pytest

from dataflow.bundle import (
    BundleError,
    Measured,
    bundle_of,
    measured_timeline,
    plan_summary,
    predicted_timeline,
    read_bundle,
    write_bundle,
    write_measured,
)
from dataflow.planning import minimal_budget, place, plan
from dataflow.schema import Program
from dataflow.timeline import Counter, TaskSpan, Timeline

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "programs" / "training_step.json"


@pytest.fixture(scope="module")
def placement():
    program = Program.from_json(EXAMPLE)
    return place(plan(program, int(minimal_budget(program) * 1.1)))


def _value_at(counter: Counter, time_us: float) -> float:
    value = 0.0
    for at, v in counter.points:
        if at > time_us:
            break
        value = v
    return value


def test_bundle_round_trips(tmp_path: Path, placement) -> None:
    summary = plan_summary(placement, "program", measured=Measured(0.1, 3, "cpu", 123))
    bundle = bundle_of(placement, summary)
    write_bundle(tmp_path, bundle)
    assert sorted(p.name for p in tmp_path.iterdir()) == [
        "plan.json",
        "program.json",
        "summary.json",
        "timeline.json",
    ]
    back = read_bundle(tmp_path)
    assert back == bundle
    assert back.program == placement.plan.program  # the exact annotated program
    plan_doc = json.loads((tmp_path / "plan.json").read_text())
    assert plan_doc["format"] == "dataflow.bundle.plan/v1"
    offloads = {k for k, d in plan_doc["directives"].items() if d["offloads"]}
    assert offloads == {t.id for t in back.program.tasks if t.offloads}
    blocks = plan_doc["placement"]["blocks"]
    assert max(b["offset_bytes"] + b["size_bytes"] for b in blocks) <= placement.arena_bytes


def test_measured_timeline_is_written_beside_and_read_back(tmp_path: Path, placement) -> None:
    bundle = bundle_of(placement, plan_summary(placement, "program"))
    write_bundle(tmp_path, bundle)
    assert read_bundle(tmp_path).measured is None
    measured = attrs.evolve(bundle.timeline, name="measured")
    write_measured(tmp_path, measured)
    assert read_bundle(tmp_path).measured == measured
    write_bundle(tmp_path, bundle)  # a bundle without one keeps the measured file
    assert read_bundle(tmp_path).measured == measured


@pytest.mark.parametrize("name", ["program.json", "plan.json", "timeline.json", "summary.json"])
def test_a_missing_or_corrupt_file_is_named(tmp_path: Path, placement, name: str) -> None:
    write_bundle(tmp_path, bundle_of(placement, plan_summary(placement, "program")))
    path = tmp_path / name
    path.unlink()
    with pytest.raises(BundleError, match=rf"{name}: missing"):
        read_bundle(tmp_path)
    path.write_text("{not json")
    with pytest.raises(BundleError, match=rf"{name}: "):
        read_bundle(tmp_path)


def test_a_wrong_field_or_format_is_named(tmp_path: Path, placement) -> None:
    write_bundle(tmp_path, bundle_of(placement, plan_summary(placement, "program")))
    summary = json.loads((tmp_path / "summary.json").read_text())
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "format": "other/v9"}))
    with pytest.raises(BundleError, match=r"summary.json: format is 'other/v9'"):
        read_bundle(tmp_path)
    del summary["step_s"]
    (tmp_path / "summary.json").write_text(json.dumps(summary))
    with pytest.raises(BundleError, match=r"summary.json: .*step_s"):
        read_bundle(tmp_path)
    timeline = json.loads((tmp_path / "timeline.json").read_text())
    timeline["tasks"][0]["colour"] = "red"
    (tmp_path / "summary.json").write_text(json.dumps({**summary, "step_s": 1.0}))
    (tmp_path / "timeline.json").write_text(json.dumps(timeline))
    with pytest.raises(BundleError, match=r"timeline.json: \$.tasks\[0\].*colour"):
        read_bundle(tmp_path)
    with pytest.raises(BundleError, match="not a folder"):
        read_bundle(tmp_path / "nothing")


def test_role_counters_add_up_to_the_simulated_fast_memory(placement) -> None:
    timeline = predicted_timeline(placement)
    sim_fast = timeline.counter("fast memory")
    roles = [c for c in timeline.counters if c.name.startswith("fast memory: ")]
    assert len(roles) == 7
    times = sorted({t for c in [sim_fast, *roles] for t, _ in c.points})
    # between events (one instant may hold several changes in another order)
    for a, b in zip(times, times[1:], strict=False):
        middle = (a + b) / 2
        assert sum(_value_at(c, middle) for c in roles) == _value_at(sim_fast, middle)
    params = timeline.counter("fast memory: params")
    assert params.peak > 0 and timeline.counter("fast memory: optimizer state").peak > 0


def test_link_counters_integrate_to_the_bytes_each_link_moved(placement) -> None:
    timeline = predicted_timeline(placement)
    for link, stats in placement.plan.sim.links.items():
        counter = timeline.counter(f"{link} GB/s")
        points = [*counter.points, (timeline.end_us, 0.0)]
        moved = sum(v * (points[i + 1][0] - t) for i, (t, v) in enumerate(points[:-1])) * 1e3
        assert moved == pytest.approx(stats.bytes, rel=1e-9)
        assert stats.bytes > 0


def test_stalls_account_for_the_simulated_compute_idle_time(placement) -> None:
    timeline = predicted_timeline(placement)
    sim = placement.plan.sim
    waited = sum(i.args["waited_us"] for i in timeline.instants)
    tail = sim.makespan_us - max(span.end_us for span in timeline.tasks)
    assert waited + tail == pytest.approx(sim.compute_idle_us, rel=1e-9)
    tasks = placement.plan.program.tasks_by_id
    for instant in timeline.instants:
        if instant.args["reason"] == "inputs":
            task = tasks[instant.args["task"]]
            assert set(instant.args["objects"]) <= set(task.inputs) | set(task.mutates)


def test_measured_timeline_takes_the_last_timed_step_and_the_median() -> None:
    program = Program.from_json(EXAMPLE)
    first, second = program.tasks[0].id, program.tasks[1].id

    def step(costs: tuple[float, float], makespan: float) -> Timeline:
        spans = [TaskSpan(first, 0, costs[0]), TaskSpan(second, costs[0] + 2, sum(costs) + 2)]
        return Timeline("m", tasks=spans, metadata={"makespan_us": makespan})

    replayed = Timeline("m", metadata={"makespan_us": 5.0})
    predicted = Timeline("p", tasks=[TaskSpan(first, 0, 1, args={"inputs": {"x": 4}})])
    steps = [step((1, 1), 4), step((3, 5), 10), step((2, 9), 13), replayed]
    measured = measured_timeline(program, steps, predicted)
    assert [s.duration_us for s in measured.tasks] == [2, 9]
    assert measured.tasks[0].args["median_us"] == 2
    assert measured.tasks[1].args["median_us"] == 5
    assert measured.tasks[0].args["inputs"] == {"x": 4}  # the program's uses, from predicted
    assert measured.metadata["step_makespans_us"] == [4, 10, 13, 5.0]
    assert measured.metadata["replayed_steps"] == [3]
    assert [i.args["waited_us"] for i in measured.instants] == [2]
    with pytest.raises(ValueError, match="replayed from a CUDA graph"):
        measured_timeline(program, [replayed])


def test_measured_role_counters_are_the_predicted_ones_on_the_measured_clock(placement) -> None:
    """Each predicted instant moves to the measured time between the same task
    boundaries: a measured run twice as slow (plus a 10 µs start) doubles every time."""
    predicted = predicted_timeline(placement)
    slow = [
        attrs.evolve(s, start_us=10 + 2 * s.start_us, end_us=10 + 2 * s.end_us)
        for s in predicted.tasks
    ]
    program = placement.plan.program
    measured = measured_timeline(program, [Timeline("m", tasks=slow)], predicted)
    by_name = {c.name: c for c in measured.counters}
    roles = [c for c in predicted.counters if c.name.startswith("fast memory: ")]
    assert roles
    first, last = predicted.tasks[0].start_us, predicted.tasks[-1].end_us
    for counter in roles:
        moved = by_name[counter.name]
        assert [v for _, v in moved.points] == [v for _, v in counter.points]
        for (t, _), (u, _) in zip(counter.points, moved.points, strict=True):
            t = min(max(t, first), last)  # flat beyond the first and last task
            assert u == pytest.approx(10 + 2 * t)
