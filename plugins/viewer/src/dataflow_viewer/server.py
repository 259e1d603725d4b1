"""``dataflow serve``: the report's panels in a page that re-plans.

A standard-library HTTP server (``http.server``) on the loopback interface unless told
otherwise. ``GET /`` is the page: a form (a preset and its training shape, or an uploaded
program JSON; the budget; the planner; optionally a measured timeline to compare) and the
report's sections. The page posts the form to ``POST /api/run`` as JSON; the answer holds
the summary cards as HTML and every panel as a bokeh JSON item, which the page embeds. No
file leaves the machine and the page loads nothing from the network (BokehJS is inlined).

Every request passes ``dataflow_viewer.guard`` first (a loopback ``Host``, the page's own
``Origin``, the token of an exposed server, a bounded ``Content-Length``); every field is
checked as the ``dataflow`` command line checks the option of that name; and the work runs
under ``dataflow_viewer.cancel``: stopped at the time limit or when the client goes.
"""

from __future__ import annotations

import hashlib
import html
import json
import socket
import threading
from collections import OrderedDict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any
from urllib.parse import urlsplit

import attrs
from bokeh.embed import json_item

from dataflow import PlanningError, Program, format_size
from dataflow.cli import BUDGET, COUNT, one_line
from dataflow_viewer.bundle import timeline_from_json
from dataflow_viewer.cancel import Stopped, client_gone, run_cancellable
from dataflow_viewer.guard import Guard, Limits, Refused, is_loopback
from dataflow_viewer.metrics import step_work
from dataflow_viewer.page import page, sections
from dataflow_viewer.panels import cards_html, panels
from dataflow_viewer.report import heading, sweep_or_reason
from dataflow_viewer.run import (
    Run,
    ViewerError,
    checked,
    lower_preset,
    planner_spec,
    predict,
    presets,
)

DEFAULTS = {
    "preset": "gpt2_tiny",
    "batch": 8,
    "seq_len": 64,
    "rounds": 1,
    "dtype": "fp32",
    "budget": "2MiB",
    "planner": "pressurefit",
}


#: what a request may hold: the training shape and budget (``DEFAULTS``), the family of
#: the preset (default: the one that has it), an uploaded program and a measured timeline
FIELDS = (*DEFAULTS, "family", "program", "measured")


def _field(request: dict[str, Any], name: str) -> str:
    """The field as the command line would have it: text (JSON numbers too, so that 8.5
    is refused as ``--batch 8.5`` is, not rounded)."""
    return str(request.get(name, DEFAULTS[name]))


def run_of(request: dict[str, Any]) -> Run:
    """The run a form asks for (keys of ``DEFAULTS``, plus ``program``: the text of an
    uploaded program JSON that replaces the preset, and ``measured``: the text of a
    measured timeline JSON). Each field is checked as ``dataflow lower`` and ``dataflow
    plan`` check the option of that name, by their own checks; bad input raises
    ``ViewerError`` naming the field."""
    unknown = sorted(set(request) - set(FIELDS))
    if unknown:
        raise ViewerError(f"{unknown[0]}: no such field; the fields are {', '.join(FIELDS)}")
    budget = checked("budget", BUDGET.convert, _field(request, "budget"), None, None)
    planner = _field(request, "planner")
    planner_spec(planner)
    program_text = request.get("program")
    if program_text:
        try:
            program = Program.from_json(program_text)
        except Exception as exc:  # the converter's errors name the field path
            raise ViewerError(f"program: {' '.join(str(exc).split())}") from None
        source = f"uploaded program {program.name}"
    else:
        shape = {
            name: checked(name, COUNT.convert, _field(request, name), None, None)
            for name in ("batch", "seq_len", "rounds")
        }
        preset, family = _field(request, "preset"), request.get("family")
        family = None if family is None else str(family)
        program = lower_preset(preset, family=family, dtype=_field(request, "dtype"), **shape)
        source = f"preset {preset}, batch {shape['batch']}, seq_len {shape['seq_len']}, "
        source += f"{shape['rounds']} round(s)"
    try:
        run = predict(program, budget, planner, source=source)
    except PlanningError as exc:
        raise ViewerError(f"budget {format_size(budget)}: {' '.join(str(exc).split())}") from None
    measured_text = request.get("measured")
    if measured_text:
        run = run.with_measured(timeline_from_json(measured_text, "measured upload"))
    return run


#: sweeps by (program, planner): a sweep does not depend on the budget asked for, and
#: finding the minimal budget of a big step takes seconds (GPT-2 124M: about 8 s)
_SWEEPS: OrderedDict[tuple[str, str], tuple[list, str]] = OrderedDict()
SWEEPS_KEPT = 32
_SWEEPS_LOCK = threading.Lock()


def cached_sweep(run: Run) -> tuple[list, str]:
    """``sweep_or_reason(run)``, computed once per program and planner (requests on other
    threads may compute the same one at once: the first to finish is kept)."""
    chain = attrs.evolve(run.program.bare(), budget=None)  # the plan's budget aside
    key = (hashlib.sha256(chain.to_json().encode()).hexdigest(), run.planner)
    with _SWEEPS_LOCK:
        found = _SWEEPS.get(key)
    if found is None:
        found = sweep_or_reason(run)
    with _SWEEPS_LOCK:
        found = _SWEEPS.setdefault(key, found)
        _SWEEPS.move_to_end(key)
        while len(_SWEEPS) > SWEEPS_KEPT:
            _SWEEPS.popitem(last=False)
    return found


def answer(run: Run) -> dict[str, Any]:
    """The page's update: heading and cards as HTML, each panel as a bokeh JSON item."""
    points, reason = cached_sweep(run)
    items = {name: json_item(model, f"panel-{name}") for name, model in panels(run, points).items()}
    return {
        "heading": heading(run),
        "cards": cards_html(run, step_work(run.program)),
        "items": items,
        "sweep_note": reason,
        "makespan_us": run.predicted.end_us,
        "measured_makespan_us": run.measured.end_us if run.measured is not None else None,
        "budget_bytes": run.budget_bytes,
    }


def index_html() -> str:
    """The page: the form, empty sections, and the script that fills them."""
    from dataflow import planners

    def options(values: list[str], chosen: str) -> str:
        return "".join(
            f'<option value="{html.escape(v)}"{" selected" if v == chosen else ""}>'
            f"{html.escape(v)}</option>"
            for v in values
        )

    names = sorted(spec.name for spec in planners())
    form = f"""
<form class="controls" id="controls">
  <label>preset<select name="preset">{options(presets(), DEFAULTS["preset"])}</select></label>
  <label>batch<input type="number" name="batch" min="1" value="{DEFAULTS["batch"]}"></label>
  <label>seq_len<input type="number" name="seq_len" min="1" value="{DEFAULTS["seq_len"]}"></label>
  <label>rounds<input type="number" name="rounds" min="1" value="{DEFAULTS["rounds"]}"></label>
  <label>dtype<select name="dtype">{options(["fp32", "bf16"], DEFAULTS["dtype"])}</select></label>
  <label>or a program JSON<input type="file" name="program" accept=".json"></label>
  <label>budget<input type="text" name="budget" value="{DEFAULTS["budget"]}"></label>
  <label>planner<select name="planner">{options(names, DEFAULTS["planner"])}</select></label>
  <label>measured timeline<input type="file" name="measured" accept=".json"></label>
  <button type="submit" id="replan">Plan and simulate</button>
</form>
<p id="status">predicted makespan <b id="makespan">…</b> µs<span id="measured-makespan"></span></p>
<p class="error" id="error"></p>"""
    body = (
        '<div id="heading"><h1>dataflow serve</h1></div>'
        + form
        + sections({"cards": "", "sweep": '<p class="note" id="sweep-note"></p>'})
    )
    return page("dataflow serve", body, f"<script>{SCRIPT}</script>")


SCRIPT = """
const form = document.getElementById("controls");
// an exposed server's page is opened as /?token=...: every request carries the token
const token = new URLSearchParams(location.search).get("token");
const headers = {"Content-Type": "application/json"};
if (token) headers["Authorization"] = "Bearer " + token;
async function fileText(input) {
  return input.files.length ? await input.files[0].text() : null;
}
async function replan(event) {
  if (event) event.preventDefault();
  document.body.dataset.state = "busy";
  const request = {};
  for (const el of form.elements) {
    if (!el.name) continue;
    request[el.name] = el.type === "file" ? await fileText(el) : el.value;
  }
  const body = JSON.stringify(request);
  const response = await fetch("/api/run", {method: "POST", headers, body});
  const reply = await response.json();
  const error = document.getElementById("error");
  if (!response.ok) {
    error.textContent = reply.error;
    document.body.dataset.state = "error";
    return;
  }
  error.textContent = "";
  for (const doc of Bokeh.documents.splice(0)) doc.clear();
  document.getElementById("heading").innerHTML = reply.heading;
  document.getElementById("panel-cards").innerHTML = reply.cards;
  for (const [name, item] of Object.entries(reply.items)) {
    document.getElementById("panel-" + name).innerHTML = "";
    await Bokeh.embed.embed_item(item, "panel-" + name);
  }
  if (reply.sweep_note) {
    const note = document.createElement("p");
    note.className = "note";
    note.textContent = reply.sweep_note;
    document.getElementById("panel-sweep").prepend(note);
  }
  document.getElementById("makespan").textContent = reply.makespan_us.toFixed(1);
  document.getElementById("measured-makespan").textContent =
    reply.measured_makespan_us === null ? "" :
    `, measured ${reply.measured_makespan_us.toFixed(1)} µs`;
  document.body.dataset.budget = reply.budget_bytes;
  document.body.dataset.state = "ready";
}
form.addEventListener("submit", replan);
replan();
"""


class Handler(BaseHTTPRequestHandler):
    server_version = "dataflow-serve"

    def setup(self) -> None:
        self.timeout = self.server.limits.read_timeout_s  # reading the head and the body
        super().setup()

    def do_GET(self) -> None:
        if not self._admitted("GET"):
            return
        if urlsplit(self.path).path != "/":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no page {self.path}"})
            return
        self._send_bytes(HTTPStatus.OK, "text/html; charset=utf-8", index_html().encode())

    def do_POST(self) -> None:
        if not self._admitted("POST"):
            return
        if self.path != "/api/run":
            self._refuse(Refused(HTTPStatus.NOT_FOUND, f"no endpoint {self.path}"))
            return
        try:
            request = json.loads(self.server.guard.read_body(self.headers, self.rfile) or b"{}")
        except Refused as refused:
            self._refuse(refused)
            return
        except ValueError as exc:  # not JSON, or not UTF-8
            self._send(HTTPStatus.BAD_REQUEST, {"error": f"the body is not JSON: {exc}"})
            return
        if not isinstance(request, dict):
            self._send(HTTPStatus.BAD_REQUEST, {"error": "the body must be a JSON object"})
            return
        self._run(request)

    def _run(self, request: dict[str, Any]) -> None:
        """Answer the run ``request`` asks for, computed on a worker that is stopped at the
        time limit (503) or when the client closes its connection (no answer)."""
        limit_s = self.server.limits.time_limit_s
        self.server.warmed.wait()  # no first-time import on a worker that may be cancelled
        try:
            reply = run_cancellable(
                lambda: answer(run_of(request)),
                time_limit_s=limit_s,
                gone=lambda: client_gone(self.connection),
                live=self.server.working,
            )
        except Stopped as stop:
            if stop.why == "gone":
                self.log_message("the client left; its work stopped after %.1f s", stop.seconds)
                self.close_connection = True
                return
            self._send(
                HTTPStatus.SERVICE_UNAVAILABLE,
                {
                    "error": f"the work took longer than this server's time limit of "
                    f"{limit_s:g} s (dataflow serve --time-limit) and was stopped; a smaller "
                    "shape plans faster"
                },
            )
            return
        except ViewerError as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        except Exception as exc:  # a bug: one line, and the server goes on
            self.log_error("internal error: %r", exc)
            error = (
                f"internal error ({type(exc).__name__}: {one_line(str(exc))}), a bug of dataflow"
            )
            self._send(HTTPStatus.INTERNAL_SERVER_ERROR, {"error": error})
            return
        self._send(HTTPStatus.OK, reply)

    def _admitted(self, method: str) -> bool:
        """Whether the caller may ask (``Guard.check_caller``); else it has its refusal."""
        try:
            self.server.guard.check_caller(method, self.path, self.headers)
        except Refused as refused:
            self._refuse(refused)
            return False
        return True

    def _refuse(self, refused: Refused) -> None:
        """Send the refusal and close: half-close first and drop what the client still
        sends for a moment, so a client writing a body it was refused reads the answer
        rather than a reset connection."""
        extra = {"WWW-Authenticate": "Bearer"} if refused.status == HTTPStatus.UNAUTHORIZED else {}
        self._send(refused.status, {"error": refused.reason}, extra)
        self.close_connection = True
        if self.command != "POST":
            return
        try:
            self.wfile.flush()
            self.connection.shutdown(socket.SHUT_WR)
            self.connection.settimeout(LINGER_S)
            while self.connection.recv(1 << 16):
                pass
        except OSError:  # the client went, or lingered too long: nothing more to do
            pass

    def _send(self, status: HTTPStatus, body: dict[str, Any], headers: dict | None = None) -> None:
        self._send_bytes(status, "application/json", json.dumps(body).encode(), headers)

    def _send_bytes(
        self, status: HTTPStatus, kind: str, data: bytes, headers: dict | None = None
    ) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.send_header("X-Content-Type-Options", "nosniff")
        for name, value in (headers or {}).items():
            self.send_header(name, value)
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        if self.server.verbose:
            super().log_message(format, *args)


#: how long a refused POST's connection drains what its client still sends
LINGER_S = 1.0


def warm() -> None:
    """Load the plugins and import what planning and simulating a request imports on
    first use (by answering the default form once), so that no import runs on a worker
    that may be cancelled (``dataflow_viewer.cancel``). A failure here is the first
    request's to report."""
    import torch  # noqa: F401 (the lowering's, and the largest import)

    from dataflow import families

    for spec in families():
        try:
            spec.load()
        except Exception:  # a broken family: `dataflow plugins list` says why
            continue
    try:
        answer(run_of(dict(DEFAULTS)))
    except Exception:
        pass


class _Server(ThreadingHTTPServer):
    daemon_threads = True


class _Server6(_Server):
    address_family = socket.AF_INET6


def make_server(
    host: str = "127.0.0.1",
    port: int = 0,
    verbose: bool = False,
    *,
    token: str | None = None,
    limits: Limits | None = None,
    warm_up: bool = True,
) -> Any:
    """A bound server (port 0: a free one; ``server.server_address`` says which). With a
    ``token`` every request must carry it (``dataflow_viewer.guard``); a server bound
    beyond loopback needs one, and takes any ``Host``; one bound to loopback only
    loopback ones. ``server.working`` holds the worker threads
    computing at the moment; ``server.warmed`` is set once ``warm`` (started on a thread
    now; ``warm_up=False``: not at all, for tests that cancel nothing) is done, and
    requests wait for it. ``limits``: default ``Limits()``."""
    limits = limits or Limits()
    if token is None and not is_loopback(host):
        raise ValueError(f"a server on {host}, beyond loopback, needs a token")
    server = (_Server6 if ":" in host else _Server)((host, port), Handler)
    bound_host, bound_port = server.server_address[:2]
    server.guard = Guard(bound_host, bound_port, token, limits.max_body_bytes)
    server.limits = limits
    server.verbose = verbose
    server.working = set()
    server.warmed = threading.Event()
    if warm_up:
        threading.Thread(target=_warm_then_set, args=(server.warmed,), daemon=True).start()
    else:
        server.warmed.set()
    return server


def _warm_then_set(warmed: threading.Event) -> None:
    try:
        warm()
    finally:
        warmed.set()


def serve_in_thread(
    host: str = "127.0.0.1", port: int = 0, **options: Any
) -> tuple[Any, threading.Thread]:
    """Start a server on a background thread (tests); stop it with ``server.shutdown()``.
    ``options``: ``make_server``'s."""
    server = make_server(host, port, **options)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread
