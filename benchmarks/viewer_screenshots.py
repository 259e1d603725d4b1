"""The screenshots of docs/exporting_runs.md: the report of a real (CPU) run and the
served page after a re-plan, in headless Chromium.

    python -m benchmarks.viewer_screenshots --out docs/images

Exports GPT-2 tiny (batch 8 x 64, fp32) planned into 2 MiB, priced by the h200 roofline;
traces three steps of that plan on the CPU into the bundle (`dataflow trace --bundle`);
writes its report (`dataflow report`) and screenshots it (report.png); then serves the
viewer, re-plans at 3 MiB with the recompute planner and screenshots that (serve.png).
Needs chromium on PATH (or DATAFLOW_CHROMIUM) and playwright.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

STEP = ["--preset", "gpt2_tiny", "--batch", "8", "--seq-len", "64", "--budget", "2MiB"]


def dataflow(*args: str) -> None:
    print("$ dataflow", " ".join(args), flush=True)
    subprocess.run(["dataflow", *args], check=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--out", type=Path, default=Path("docs/images"))
    args = parser.parse_args()
    chromium = os.environ.get("DATAFLOW_CHROMIUM") or shutil.which("chromium")
    if chromium is None:
        raise SystemExit("no chromium on PATH (apt-get install chromium, or DATAFLOW_CHROMIUM)")
    from dataflow_viewer.server import serve_in_thread
    from playwright.sync_api import sync_playwright

    args.out.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory() as tmp:
        bundle = Path(tmp) / "gpt2_tiny_2MiB"
        dataflow("export", *STEP, "--pricing", "roofline", "-o", str(bundle))
        program, chrome = str(bundle / "program.json"), str(bundle / "chrome.json")
        dataflow(
            "trace",
            program,
            "--resolver",
            "torch",
            "--steps",
            "3",
            "--bundle",
            str(bundle),
            "-o",
            chrome,
        )
        dataflow("report", str(bundle), "-o", str(bundle / "report.html"))
        server, thread = serve_in_thread()
        host, port = server.server_address[:2]
        with sync_playwright() as driver:
            browser = driver.chromium.launch(executable_path=chromium, args=["--no-sandbox"])
            page = browser.new_page(viewport={"width": 1400, "height": 900})
            page.goto((bundle / "report.html").as_uri())
            page.wait_for_function("() => window.Bokeh && Bokeh.documents.length === 1")
            page.wait_for_timeout(1500)  # let every plot draw
            page.screenshot(path=str(args.out / "report.png"), full_page=True)
            page.goto(f"http://{host}:{port}/")
            page.wait_for_selector("body[data-state=ready]", timeout=120_000)
            page.fill("input[name=budget]", "3MiB")
            page.select_option("select[name=planner]", "recompute")
            page.click("#replan")
            page.wait_for_selector(f"body[data-budget='{3 << 20}'][data-state=ready]")
            page.wait_for_timeout(1500)
            page.screenshot(path=str(args.out / "serve.png"), full_page=True)
            browser.close()
        server.shutdown()
        thread.join(5)
    print(f"wrote {args.out / 'report.png'} and {args.out / 'serve.png'}")


if __name__ == "__main__":
    main()
