"""`dataflow report`: one offline HTML file, from a bundle folder; errors name the file."""

from __future__ import annotations

import json
import re

import pytest
from dataflow_viewer.bundle import read_run
from dataflow_viewer.page import SECTIONS
from dataflow_viewer.panels import CARDS
from dataflow_viewer.report import report_html
from dataflow_viewer.run import planner_spec

from dataflow import (
    bundle_of,
    place,
    plan,
    plan_summary,
    timeline_to_dict,
    write_bundle,
    write_measured,
)
from dataflow.testing import FAILURE_EXIT, assert_one_line_error, invoke


@pytest.fixture(scope="module")
def bundle_dir(tmp_path_factory, tiny_program, tiny_run):
    """A bundle of GPT-2 tiny at 2 MiB, as `dataflow export` writes one."""
    placement = place(
        plan(tiny_program, tiny_run.budget_bytes, planner=planner_spec("pressurefit"))
    )
    folder = tmp_path_factory.mktemp("bundle")
    write_bundle(folder, bundle_of(placement, plan_summary(placement, "program")))
    return folder


def test_read_run_of_a_bundle(bundle_dir, tiny_run) -> None:
    run = read_run(bundle_dir)
    assert run.measured is None
    assert run.budget_bytes == tiny_run.budget_bytes
    assert run.planner == "pressurefit"
    assert run.predicted == tiny_run.predicted


def test_a_run_folder_s_bundle_below_it_is_found(bundle_dir, tmp_path) -> None:
    import shutil

    shutil.copytree(bundle_dir, tmp_path / "run" / "bundle")
    assert read_run(tmp_path / "run").source == str(tmp_path / "run" / "bundle")
    shutil.copytree(bundle_dir, tmp_path / "run" / "other")
    result = invoke("report", str(tmp_path / "run"), "-o", str(tmp_path / "r.html"))
    assert_one_line_error(result, FAILURE_EXIT, "several bundles", "other")


def test_the_report_is_one_offline_file(measured_run) -> None:
    text = report_html(measured_run)
    for key in SECTIONS:
        assert f'id="panel-{key}"' in text
    for key, _, _ in CARDS:
        assert f'data-metric="{key}"' in text
    assert "No measured run" not in text
    # every script and stylesheet is inline: nothing to fetch, from a network or a file
    assert re.findall(r"<script[^>]*\bsrc=", text) == []
    assert re.findall(r"<link[^>]*\bhref=['\"](?!data:)", text) == []
    assert "Bokeh.embed" in text or "embed_items" in text


def test_a_prediction_alone_says_so(tiny_run) -> None:
    text = report_html(tiny_run)
    assert "No measured run: the cards show the prediction alone." in text
    assert "No measured run to compare." in text


def test_report_command_writes_the_file(bundle_dir, measured_run, tmp_path) -> None:
    out = tmp_path / "out" / "report.html"
    result = invoke("report", str(bundle_dir), "-o", str(out))
    assert result.exit_code == 0, result.output
    assert "prediction only" in result.output
    assert out.stat().st_size > 1_000_000  # BokehJS is inlined
    measured = tmp_path / "measured.json"
    measured.write_text(json.dumps(timeline_to_dict(measured_run.measured)))
    result = invoke("report", str(bundle_dir), "-o", str(out), "--measured", str(measured))
    assert result.exit_code == 0, result.output
    assert "predicted and measured" in result.output


def test_the_bundle_s_own_measurement_is_read(bundle_dir, measured_run, tmp_path) -> None:
    import shutil

    folder = tmp_path / "with_measured"
    shutil.copytree(bundle_dir, folder)
    write_measured(folder, measured_run.measured)
    run = read_run(folder)
    assert run.measured == measured_run.measured


@pytest.mark.parametrize(
    ("make", "wanted"),
    [
        (lambda tmp: tmp / "missing", "no such folder"),
        (lambda tmp: (tmp / "empty").mkdir() or tmp / "empty", "no program.json"),
        (lambda tmp: (tmp / "f.json").write_text("{}") and tmp / "f.json", "not a folder"),
    ],
)
def test_report_of_bad_input_names_it(tmp_path, make, wanted) -> None:
    path = make(tmp_path)
    result = invoke("report", str(path), "-o", str(tmp_path / "r.html"))
    assert_one_line_error(result, FAILURE_EXIT, str(path), wanted)


def test_a_broken_bundle_file_is_named(bundle_dir, tmp_path) -> None:
    import shutil

    folder = tmp_path / "broken"
    shutil.copytree(bundle_dir, folder)
    (folder / "timeline.json").write_text("{not json")
    result = invoke("report", str(folder), "-o", str(tmp_path / "r.html"))
    assert_one_line_error(result, FAILURE_EXIT, str(folder / "timeline.json"))


def test_a_bad_measured_file_is_named(bundle_dir, tmp_path) -> None:
    bad = tmp_path / "measured.json"
    bad.write_text(json.dumps({"format": "something/v9"}))
    result = invoke(
        "report", str(bundle_dir), "-o", str(tmp_path / "r.html"), "--measured", str(bad)
    )
    assert_one_line_error(result, FAILURE_EXIT, str(bad), "format")
