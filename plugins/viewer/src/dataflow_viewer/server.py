"""``dataflow serve``: the report's panels in a page that re-plans.

A standard-library HTTP server (``http.server``) on the loopback interface unless told
otherwise. ``GET /`` is the page: a form (a preset and its training shape, or an uploaded
program JSON; the budget; the planner; optionally a measured timeline to compare) and the
report's sections. The page posts the form to ``POST /api/run`` as JSON; the answer holds
the summary cards as HTML and every panel as a bokeh JSON item, which the page embeds. No
file leaves the machine and the page loads nothing from the network (BokehJS is inlined).
"""

from __future__ import annotations

import hashlib
import html
import json
import threading
from collections import OrderedDict
from functools import lru_cache
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import attrs
from bokeh.embed import json_item

from dataflow import PlanningError, Program, format_size, parse_size
from dataflow_viewer.bundle import timeline_from_json
from dataflow_viewer.metrics import step_work
from dataflow_viewer.page import page, sections
from dataflow_viewer.panels import cards_html, panels
from dataflow_viewer.report import heading, sweep_or_reason
from dataflow_viewer.run import Run, ViewerError, lower_preset, predict, presets

#: the largest request body read (an uploaded program of a big model is a few MiB)
MAX_BODY_BYTES = 256 << 20
DEFAULTS = {
    "preset": "gpt2_tiny",
    "batch": 8,
    "seq_len": 64,
    "rounds": 1,
    "dtype": "fp32",
    "budget": "2MiB",
    "planner": "pressurefit",
}


@lru_cache(maxsize=16)
def _lowered(preset: str, batch: int, seq_len: int, rounds: int, dtype: str) -> Program:
    return lower_preset(preset, batch=batch, seq_len=seq_len, rounds=rounds, dtype=dtype)


def _whole(request: dict[str, Any], name: str) -> int:
    value = request.get(name, DEFAULTS[name])
    try:
        number = int(value)
    except (TypeError, ValueError):
        raise ViewerError(f"{name}: {value!r} is not a whole number") from None
    if number < 1:
        raise ViewerError(f"{name}: must be >= 1, not {number}")
    return number


def run_of(request: dict[str, Any]) -> Run:
    """The run a form asks for (keys of ``DEFAULTS``, plus ``program``: the text of an
    uploaded program JSON that replaces the preset, and ``measured``: the text of a
    measured timeline JSON). Bad input raises ``ViewerError`` naming the field."""
    try:
        budget = parse_size(str(request.get("budget", DEFAULTS["budget"])))
    except ValueError as exc:
        raise ViewerError(f"budget: {' '.join(str(exc).split())}") from None
    if budget < 1:
        raise ViewerError("budget: must be > 0")
    program_text = request.get("program")
    if program_text:
        try:
            program = Program.from_json(program_text)
        except Exception as exc:  # the converter's errors name the field path
            raise ViewerError(f"program: {' '.join(str(exc).split())}") from None
        source = f"uploaded program {program.name}"
    else:
        shape = {name: _whole(request, name) for name in ("batch", "seq_len", "rounds")}
        preset = str(request.get("preset", DEFAULTS["preset"]))
        program = _lowered(preset, dtype=str(request.get("dtype", DEFAULTS["dtype"])), **shape)
        source = f"preset {preset}, batch {shape['batch']}, seq_len {shape['seq_len']}, "
        source += f"{shape['rounds']} round(s)"
    planner = str(request.get("planner", DEFAULTS["planner"]))
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


def cached_sweep(run: Run) -> tuple[list, str]:
    """``sweep_or_reason(run)``, computed once per program and planner."""
    chain = attrs.evolve(run.program.bare(), budget=None)  # the plan's budget aside
    key = (hashlib.sha256(chain.to_json().encode()).hexdigest(), run.planner)
    if key not in _SWEEPS:
        _SWEEPS[key] = sweep_or_reason(run)
        while len(_SWEEPS) > SWEEPS_KEPT:
            _SWEEPS.popitem(last=False)
    _SWEEPS.move_to_end(key)
    return _SWEEPS[key]


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
  const response = await fetch("/api/run", {method: "POST", body: JSON.stringify(request)});
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

    def do_GET(self) -> None:
        if self.path.split("?")[0] != "/":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no page {self.path}"})
            return
        self._send_bytes(HTTPStatus.OK, "text/html; charset=utf-8", index_html().encode())

    def do_POST(self) -> None:
        if self.path != "/api/run":
            self._send(HTTPStatus.NOT_FOUND, {"error": f"no endpoint {self.path}"})
            return
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_BODY_BYTES:
            self._send(HTTPStatus.REQUEST_ENTITY_TOO_LARGE, {"error": "request too large"})
            return
        try:
            request = json.loads(self.rfile.read(length) or b"{}")
            if not isinstance(request, dict):
                raise ViewerError("the request must be a JSON object")
            reply = answer(run_of(request))
        except (ViewerError, json.JSONDecodeError) as exc:
            self._send(HTTPStatus.BAD_REQUEST, {"error": str(exc)})
            return
        self._send(HTTPStatus.OK, reply)

    def _send(self, status: HTTPStatus, body: dict[str, Any]) -> None:
        self._send_bytes(status, "application/json", json.dumps(body).encode())

    def _send_bytes(self, status: HTTPStatus, kind: str, data: bytes) -> None:
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, format: str, *args: Any) -> None:  # noqa: A002 (the base's name)
        if getattr(self.server, "verbose", False):
            super().log_message(format, *args)


def make_server(host: str = "127.0.0.1", port: int = 0, verbose: bool = False) -> Any:
    """A bound server (port 0: a free one; ``server.server_address`` says which)."""
    server = ThreadingHTTPServer((host, port), Handler)
    server.daemon_threads = True
    server.verbose = verbose
    return server


def serve_in_thread(host: str = "127.0.0.1", port: int = 0) -> tuple[Any, threading.Thread]:
    """Start a server on a background thread (tests); stop it with ``server.shutdown()``."""
    server = make_server(host, port)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    return server, thread
