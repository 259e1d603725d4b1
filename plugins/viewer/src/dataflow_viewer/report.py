"""``report_html(run)``: one self-contained HTML file of a run's panels (the summary
cards, the timeline, the deviating tasks, stall attribution, the budget sweep)."""

from __future__ import annotations

import html
from pathlib import Path

from bokeh.embed import components

from dataflow import PlanningError, format_size
from dataflow_viewer.metrics import step_work
from dataflow_viewer.page import page, sections
from dataflow_viewer.panels import cards_html, panels
from dataflow_viewer.run import Run, ViewerError
from dataflow_viewer.sweep import SweepPoint, sweep


def sweep_or_reason(run: Run, points: int = 6) -> tuple[list[SweepPoint], str]:
    """The budget sweep of ``run``'s chain with its planner, or why there is none."""
    try:
        return sweep(run.program, step_work(run.program), run.planner or "pressurefit", points), ""
    except (PlanningError, ViewerError) as exc:  # no plan, or a planner not installed here
        return [], f"no budget sweep: {' '.join(str(exc).split())}"


def heading(run: Run) -> str:
    """The page's title line and what the run is."""
    budget = f", budget {format_size(run.budget_bytes)}" if run.budget_bytes else ""
    planner = f", planner {run.planner}" if run.planner else ""
    measured = "predicted and measured" if run.measured is not None else "predicted only"
    return (
        f"<h1>dataflow: {html.escape(run.program.name)}</h1>\n"
        f'<p class="source">{html.escape(run.source)}{budget}{planner}; {measured}; '
        f"{len(run.program.tasks)} tasks</p>"
    )


def report_html(run: Run, sweep_points: int = 6) -> str:
    """The whole report as one HTML document (BokehJS inlined: no network to view it)."""
    points, reason = sweep_or_reason(run, sweep_points)
    script, divs = components(panels(run, points))
    if reason:
        divs["sweep"] = f'<p class="note">{html.escape(reason)}</p>' + divs["sweep"]
    body = heading(run) + sections({"cards": cards_html(run, step_work(run.program)), **divs})
    return page(f"dataflow report: {run.program.name}", body, script)


def write_report(run: Run, path: str | Path, sweep_points: int = 6) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(report_html(run, sweep_points), encoding="utf-8")
    return path
