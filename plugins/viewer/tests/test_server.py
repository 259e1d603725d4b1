"""`dataflow serve`: the page, and the re-plan it asks for, over real HTTP on loopback."""

from __future__ import annotations

import json
import urllib.error
import urllib.request

import pytest
from dataflow_viewer.run import ViewerError, predict
from dataflow_viewer.server import DEFAULTS, run_of, serve_in_thread


@pytest.fixture(scope="module")
def server():
    server, thread = serve_in_thread()
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


def url(server, path: str) -> str:
    host, port = server.server_address[:2]
    return f"http://{host}:{port}{path}"


def post(server, body: dict) -> tuple[int, dict]:
    request = urllib.request.Request(url(server, "/api/run"), data=json.dumps(body).encode())
    try:
        with urllib.request.urlopen(request, timeout=60) as response:
            return response.status, json.load(response)
    except urllib.error.HTTPError as exc:
        return exc.code, json.load(exc)


def test_it_listens_on_loopback_by_default(server) -> None:
    assert server.server_address[0] == "127.0.0.1"


def test_the_page_has_the_form_and_the_sections(server) -> None:
    with urllib.request.urlopen(url(server, "/"), timeout=30) as response:
        text = response.read().decode()
    for name in ("preset", "batch", "seq_len", "rounds", "budget", "planner", "program"):
        assert f'name="{name}"' in text
    assert 'id="panel-timeline"' in text and 'id="makespan"' in text
    assert "<script src=" not in text  # BokehJS inline: no network


def test_a_replan_answers_the_simulated_makespan(server, tiny_program) -> None:
    status, reply = post(server, {**DEFAULTS, "budget": "3MiB", "planner": "recompute"})
    assert status == 200, reply
    expected = predict(tiny_program, 3 << 20, "recompute").predicted.end_us
    assert reply["makespan_us"] == pytest.approx(expected)
    assert reply["budget_bytes"] == 3 << 20
    assert set(reply["items"]) == {"timeline", "deviations", "stalls", "sweep"}
    assert all(item["target_id"] == f"panel-{name}" for name, item in reply["items"].items())


def test_an_uploaded_program_and_measurement(server, tiny_program, measured_run) -> None:
    from dataflow import timeline_to_dict

    status, reply = post(
        server,
        {
            "budget": "2MiB",
            "planner": "pressurefit",
            "program": tiny_program.to_json(),
            "measured": json.dumps(timeline_to_dict(measured_run.measured)),
        },
    )
    assert status == 200, reply
    assert reply["makespan_us"] == pytest.approx(measured_run.predicted.end_us)
    assert reply["measured_makespan_us"] == pytest.approx(measured_run.measured.end_us)
    assert "uploaded program" in reply["heading"]


@pytest.mark.parametrize(
    ("change", "culprit"),
    [
        ({"budget": "lots"}, "budget"),
        ({"budget": "1KiB"}, "budget 1 KiB"),
        ({"batch": "0"}, "batch"),
        ({"seq_len": "x"}, "seq_len"),
        ({"preset": "gpt9"}, "preset 'gpt9'"),
        ({"planner": "nope"}, "planner 'nope'"),
        ({"program": "{}"}, "program"),
        ({"measured": "[1]"}, "measured upload"),
    ],
)
def test_bad_requests_name_the_field(server, change, culprit) -> None:
    status, reply = post(server, {**DEFAULTS, **change})
    assert status == 400
    assert culprit in reply["error"] and "\n" not in reply["error"]


def test_run_of_raises_viewer_errors() -> None:
    with pytest.raises(ViewerError, match="dtype must be fp32 or bf16"):
        run_of({**DEFAULTS, "dtype": "fp8"})


def test_unknown_paths_are_404(server) -> None:
    with pytest.raises(urllib.error.HTTPError) as caught:
        urllib.request.urlopen(url(server, "/nothing"), timeout=10)
    assert caught.value.code == 404


def test_a_sweep_is_worked_out_once_per_program_and_planner(tiny_program) -> None:
    from dataflow_viewer import server

    first = server.cached_sweep(predict(tiny_program, 2 << 20))
    again = server.cached_sweep(predict(tiny_program, 3 << 20))
    assert again is first  # the same answer object: not planned again
    other = server.cached_sweep(predict(tiny_program, 3 << 20, "recompute"))
    assert other is not first


def test_serve_prints_where_it_listens_and_serves_the_page() -> None:
    import subprocess
    import sys

    process = subprocess.Popen(
        [sys.executable, "-m", "dataflow", "serve"],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("serving on http://127.0.0.1:"), line + process.stderr.read()
        address = line.split()[2]
        with urllib.request.urlopen(address, timeout=30) as response:
            assert 'id="controls"' in response.read().decode()
    finally:
        process.terminate()
        process.wait(10)


def test_serve_on_an_interface_that_is_not_here_is_one_line() -> None:
    from dataflow.testing import FAILURE_EXIT, assert_one_line_error, invoke

    result = invoke("serve", "--host", "203.0.113.7", "--port", "1")
    assert_one_line_error(result, FAILURE_EXIT, "--host 203.0.113.7", "cannot listen")
