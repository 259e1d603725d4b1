"""The report and the served page in a real browser: the system's headless Chromium (the
Debian ``chromium`` package, which .ci/run installs), driven by playwright without a
browser download. Skipped, saying why, where either is missing.

``DATAFLOW_VIEWER_SCREENSHOTS=DIR`` also writes each page's screenshot into DIR (the
ones in docs/images/ came from ``DATAFLOW_VIEWER_SCREENSHOTS=docs/images pytest
plugins/viewer/tests/test_browser.py``).
"""

from __future__ import annotations

import os
import shutil
import threading
from pathlib import Path

import pytest
from dataflow_viewer.page import SECTIONS
from dataflow_viewer.report import write_report
from dataflow_viewer.run import predict
from dataflow_viewer.server import serve_in_thread

CHROMIUM = os.environ.get("DATAFLOW_CHROMIUM") or next(
    filter(None, map(shutil.which, ("chromium", "chromium-browser", "google-chrome"))), None
)
playwright = pytest.importorskip(
    "playwright.sync_api", reason="playwright is not installed (pip install playwright)"
)
pytestmark = pytest.mark.skipif(
    CHROMIUM is None,
    reason="no chromium on PATH (apt-get install chromium, or set DATAFLOW_CHROMIUM)",
)
#: JavaScript: the ids of the panels that hold a rendered view (bokeh draws each view
#: into a shadow root: a plot's canvas, a table's cells, a note's text), and the cards
RENDERED = """() => [...document.querySelectorAll('.panel')].filter(panel => {
  if (panel.id === 'panel-cards') return panel.querySelector('.card') !== null;
  const drawn = (root) => [...root.querySelectorAll('*')].some(
    e => e.shadowRoot && (e.shadowRoot.querySelector('canvas, .bk-cell, .slick-cell, p, h3')
                          || drawn(e.shadowRoot)));
  return drawn(panel);
}).map(panel => panel.id)"""
#: JavaScript: how many canvases the timeline panel's plots drew into
CANVASES = """() => { let n = 0; const walk = (root) => root.querySelectorAll('*').forEach(e => {
  if (e.tagName === 'CANVAS') n += 1; if (e.shadowRoot) walk(e.shadowRoot); });
  walk(document.getElementById('panel-timeline')); return n; }"""


#: a name that resolves to this machine, as a rebinding attacker's own name would
REBIND = "MAP rebind.example 127.0.0.1"


@pytest.fixture(scope="module")
def browser():
    with playwright.sync_playwright() as driver:
        browser = driver.chromium.launch(
            executable_path=CHROMIUM, args=["--no-sandbox", f"--host-resolver-rules={REBIND}"]
        )
        yield browser
        browser.close()


class Page:
    """A page that records console errors, page errors and every request it makes."""

    def __init__(self, browser) -> None:
        self.page = browser.new_page(viewport={"width": 1400, "height": 900})
        self.errors: list[str] = []
        self.requests: list[str] = []
        self.page.on("console", lambda m: self.errors.append(m.text) if m.type == "error" else None)
        self.page.on("pageerror", lambda e: self.errors.append(str(e)))
        self.page.on("request", lambda r: self.requests.append(r.url))

    def shot(self, name: str, tmp_path: Path) -> None:
        path = tmp_path / name
        self.page.screenshot(path=str(path), full_page=True)
        assert path.stat().st_size > 10_000
        wanted = os.environ.get("DATAFLOW_VIEWER_SCREENSHOTS")
        if wanted:
            Path(wanted).mkdir(parents=True, exist_ok=True)
            shutil.copy(path, Path(wanted) / name)


def test_the_report_renders_offline(browser, measured_run, tmp_path) -> None:
    report = write_report(measured_run, tmp_path / "report.html")
    page = Page(browser)
    page.page.goto(report.as_uri())
    page.page.wait_for_function("() => window.Bokeh && Bokeh.documents.length === 1")
    page.page.wait_for_function(f"() => ({RENDERED})().length === {len(SECTIONS)}")
    assert sorted(page.page.evaluate(RENDERED)) == sorted(f"panel-{k}" for k in SECTIONS)
    assert page.page.evaluate("() => Bokeh.documents[0].roots().length") == 4
    assert page.page.evaluate(CANVASES) >= 3  # spans, memory, links
    assert page.errors == []
    assert page.requests == [report.as_uri()]  # nothing but the file itself
    page.shot("report.png", tmp_path)


def test_the_served_page_replans_at_a_new_budget(browser, tiny_program, tmp_path) -> None:
    server, thread = serve_in_thread(warm_up=False)
    host, port = server.server_address[:2]
    origin = f"http://{host}:{port}"
    try:
        page = Page(browser)
        page.page.goto(origin + "/")
        page.page.wait_for_selector("body[data-state=ready]", timeout=60_000)
        first = float(page.page.inner_text("#makespan"))
        assert first == pytest.approx(predict(tiny_program, 2 << 20).predicted.end_us, abs=0.05)
        page.page.fill("input[name=budget]", "3MiB")
        page.page.select_option("select[name=planner]", "recompute")
        page.page.click("#replan")
        page.page.wait_for_selector(f"body[data-budget='{3 << 20}'][data-state=ready]")
        second = float(page.page.inner_text("#makespan"))
        expected = predict(tiny_program, 3 << 20, "recompute").predicted.end_us
        assert second == pytest.approx(expected, abs=0.05) and second != first
        assert sorted(page.page.evaluate(RENDERED)) == sorted(f"panel-{k}" for k in SECTIONS)
        page.page.fill("input[name=budget]", "1KiB")
        page.page.click("#replan")
        page.page.wait_for_selector("body[data-state=error]")
        assert "budget 1 KiB" in page.page.inner_text("#error")
        page.page.fill("input[name=budget]", "3MiB")
        page.page.click("#replan")
        page.page.wait_for_selector("body[data-state=ready]")
        assert [e for e in page.errors if "400" not in e] == []  # the refused plan's 400 only
        assert all(url.startswith(origin) for url in page.requests)
        page.shot("serve.png", tmp_path)
    finally:
        server.shutdown()
        server.server_close()
        thread.join(5)


TOKEN = "a-token-of-thirty-two-characters"


@pytest.fixture(params=[None, TOKEN], ids=["plain", "token"])
def served(request):
    """A served viewer on loopback, without a token or with one."""
    server, thread = serve_in_thread(token=request.param, warm_up=False)
    yield server
    server.shutdown()
    server.server_close()
    thread.join(5)


#: another site's page that asks the viewer to work (it cannot read the answer, but
#: without the Origin check the server would compute)
FOREIGN_PAGE = """<script>fetch("http://127.0.0.1:PORT/api/run",
  {method: "POST", mode: "no-cors", body: JSON.stringify({rounds: 64})});</script>"""


@pytest.mark.parametrize("served", [TOKEN], indirect=True, ids=["token"])
def test_the_page_of_a_server_with_a_token_sends_it(browser, served) -> None:
    token = served.guard.token
    origin = f"http://127.0.0.1:{served.server_address[1]}"
    page = Page(browser)
    assert page.page.goto(origin + "/").status == 401
    page.page.goto(f"{origin}/?token={token}")
    page.page.wait_for_selector("body[data-state=ready]", timeout=60_000)
    assert all("status of 401" in error for error in page.errors)  # the page, the icon


def test_another_sites_page_cannot_make_it_work(browser, served, tmp_path) -> None:
    """A page of another origin in the same browser posts to the viewer: refused (403)
    by its Origin, before any work; and a page reached by a name that resolves to
    127.0.0.1 (DNS rebinding) is refused by its Host, with the token or without."""
    from functools import partial
    from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

    port = served.server_address[1]
    (tmp_path / "evil.html").write_text(FOREIGN_PAGE.replace("PORT", str(port)))
    handler = partial(SimpleHTTPRequestHandler, directory=str(tmp_path))
    foreign = ThreadingHTTPServer(("127.0.0.1", 0), handler)
    threading.Thread(target=foreign.serve_forever, daemon=True).start()
    try:
        page = Page(browser)
        with page.page.expect_response(lambda r: r.url.endswith("/api/run")) as caught:
            page.page.goto(f"http://localhost:{foreign.server_address[1]}/evil.html")
        assert caught.value.status == 403
        assert served.working == set()
        assert page.page.goto(f"http://rebind.example:{port}/?token={TOKEN}").status == 403
    finally:
        foreign.shutdown()
        foreign.server_close()
