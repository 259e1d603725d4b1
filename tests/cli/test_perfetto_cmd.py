"""``dataflow perfetto BUNDLE`` and ``dataflow trace ... --bundle``: a bundle's trace, and
the measured timeline written beside it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from dataflow.bundle import bundle_of, plan_summary, read_bundle, write_bundle
from dataflow.planning import minimal_budget, place, plan
from dataflow.schema import Program
from dataflow.testing.cli import FAILURE_EXIT, assert_one_line_error, invoke
from dataflow.testing.trace_events import trace_event_problems

EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "programs" / "training_step.json"


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory) -> Path:
    program = Program.from_json(EXAMPLE)
    placement = place(plan(program, int(minimal_budget(program) * 1.1)))
    folder = tmp_path_factory.mktemp("bundle")
    write_bundle(folder, bundle_of(placement, plan_summary(placement, "program")))
    return folder


def test_trace_bundle_then_perfetto_shows_predicted_and_measured(bundle_dir, tmp_path) -> None:
    program = bundle_dir / "program.json"
    traced = invoke(
        "trace", program, "--resolver", "synthetic", "--steps", "2", "--bundle", bundle_dir,
        "-o", tmp_path / "chrome.json",
    )  # fmt: skip
    assert traced.exit_code == 0, traced.output
    bundle = read_bundle(bundle_dir)
    assert bundle.measured is not None and bundle.summary.measured.steps == 2
    assert {s.task_id for s in bundle.measured.tasks} == {t.id for t in bundle.program.tasks}
    assert all(s.args["measured_us"] >= 0 for s in bundle.measured.tasks)
    out = tmp_path / "trace.json"
    result = invoke("perfetto", bundle_dir, "-o", out)
    assert result.exit_code == 0, result.output
    assert "predicted and measured" in result.output
    document = json.loads(out.read_text())
    assert trace_event_problems(document) == []
    assert {e["pid"] for e in document["traceEvents"] if e["ph"] == "X"} == {1, 2}


def test_trace_bundle_of_another_program_is_refused(bundle_dir, tmp_path) -> None:
    other = Program.from_json(EXAMPLE)
    other_path = tmp_path / "other.json"
    other_path.write_text(other.bare().to_json())
    result = invoke(
        "trace", other_path, "--resolver", "synthetic", "--bundle", bundle_dir,
        "-o", tmp_path / "t.json",
    )  # fmt: skip
    assert_one_line_error(result, FAILURE_EXIT, "--bundle", "other.json")


def test_a_broken_bundle_is_one_line_naming_the_file(bundle_dir, tmp_path) -> None:
    broken = tmp_path / "broken"
    broken.mkdir()
    for name in ("program.json", "plan.json", "summary.json"):
        (broken / name).write_text((bundle_dir / name).read_text())
    (broken / "timeline.json").write_text("[1, 2")
    result = invoke("perfetto", broken, "-o", tmp_path / "t.json")
    assert_one_line_error(result, FAILURE_EXIT, "timeline.json", "not JSON")
