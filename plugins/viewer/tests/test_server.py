"""`dataflow serve`: the page, and the re-plan it asks for, over real HTTP on loopback."""

from __future__ import annotations

import contextlib
import json
import subprocess
import sys
import urllib.error
import urllib.request
from urllib.parse import parse_qs, urlsplit

import pytest
from dataflow_viewer.run import ViewerError, predict
from dataflow_viewer.server import DEFAULTS, run_of, serve_in_thread


@pytest.fixture(scope="module")
def server():
    server, thread = serve_in_thread(warm_up=False)
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
        ({"budget": "lots"}, "budget: 'lots' is not a size"),
        ({"budget": "-1MiB"}, "budget: '-1MiB' is not a size"),
        ({"budget": "0"}, "budget: '0' is 0 bytes"),
        ({"budget": "1e400"}, "budget: '1e400' is too large"),
        ({"budget": "1KiB"}, "budget 1 KiB"),
        ({"batch": "0"}, "batch: 0 is not in the range"),
        ({"batch": -3}, "batch: -3 is not in the range"),
        ({"batch": 8.5}, "batch: '8.5' is not a valid integer"),
        ({"rounds": True}, "rounds: 'True' is not a valid integer"),
        ({"seq_len": "x"}, "seq_len"),
        ({"seq_len": 4096}, "seq_len: 4096 is longer than preset 'gpt2_tiny' takes"),
        ({"preset": "gpt9"}, "preset: no installed family has a preset 'gpt9'"),
        ({"family": "toy_moe"}, "preset: toy_moe has no preset 'gpt2_tiny'"),
        ({"family": "nope"}, "family: no family named 'nope'"),
        ({"planner": "nope"}, "planner: no planner named 'nope'"),
        ({"dtype": "fp8"}, "dtype: 'fp8' is not one of"),
        ({"program": "{}"}, "program"),
        ({"measured": "[1]"}, "measured upload"),
        ({"seqlen": 64}, "seqlen: no such field"),
    ],
)
def test_bad_requests_name_the_field(server, change, culprit) -> None:
    status, reply = post(server, {**DEFAULTS, **change})
    assert status == 400
    assert culprit in reply["error"] and "\n" not in reply["error"]


def test_the_fields_are_checked_by_the_commands_own_checks() -> None:
    """What ``dataflow lower`` refuses, the server refuses with the same words."""
    from dataflow.testing import USAGE_EXIT, invoke

    result = invoke("lower", "--preset", "gpt2_tiny", "--seq-len", "4096", "-o", "x.json")
    assert result.exit_code == USAGE_EXIT
    with pytest.raises(ViewerError) as caught:
        run_of({**DEFAULTS, "seq_len": 4096})
    assert str(caught.value).removeprefix("seq_len: ") in result.output


def test_run_of_raises_viewer_errors() -> None:
    with pytest.raises(ViewerError, match="dtype: 'fp8' is not one of 'fp32', 'bf16'"):
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


@contextlib.contextmanager
def serving(*options: str):
    """``dataflow serve OPTIONS`` in its own process; yields the line it printed first."""
    process = subprocess.Popen(
        [sys.executable, "-m", "dataflow", "serve", *options],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        line = process.stdout.readline()
        assert line.startswith("serving on http://"), line + process.stderr.read()
        yield line
    finally:
        process.terminate()
        process.wait(10)


def test_serve_prints_where_it_listens_and_serves_the_page() -> None:
    with serving() as line:
        assert line.startswith("serving on http://127.0.0.1:")
        with urllib.request.urlopen(line.split()[2], timeout=30) as response:
            assert 'id="controls"' in response.read().decode()


def test_serve_on_an_interface_that_is_not_here_is_one_line() -> None:
    from dataflow.testing import FAILURE_EXIT, assert_one_line_error, invoke

    result = invoke("serve", "--host", "203.0.113.7", "--port", "1", "--expose")
    assert_one_line_error(result, FAILURE_EXIT, "--host 203.0.113.7", "cannot listen")


@pytest.mark.parametrize("host", ["0.0.0.0", "203.0.113.7", "myhost.lan", "::"])
def test_serve_beyond_loopback_needs_expose(host) -> None:
    from dataflow.testing import USAGE_EXIT, assert_one_line_error, invoke

    result = invoke("serve", "--host", host)
    assert_one_line_error(result, USAGE_EXIT, "--host", "not a loopback address", "--expose")


def test_serve_refuses_a_short_token() -> None:
    from dataflow.testing import USAGE_EXIT, assert_one_line_error, invoke

    result = invoke("serve", "--expose", "--token", "secret")
    assert_one_line_error(result, USAGE_EXIT, "--token", "at least 16")


def test_serve_exposed_prints_its_token_and_wants_it() -> None:
    with serving("--host", "0.0.0.0", "--expose") as line:
        assert line.startswith("serving on http://0.0.0.0:")
        address = urlsplit(line.split()[2])
        token = parse_qs(address.query)["token"][0]
        assert len(token) >= 40
        base = f"http://127.0.0.1:{address.port}"
        with pytest.raises(urllib.error.HTTPError) as caught:
            urllib.request.urlopen(f"{base}/", timeout=30)
        assert caught.value.code == 401
        with urllib.request.urlopen(f"{base}/?token={token}", timeout=30) as response:
            assert 'id="controls"' in response.read().decode()
