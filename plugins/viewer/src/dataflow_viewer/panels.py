"""The viewer's panels as bokeh models, the same for the report and the served page.

``panels(run, sweep_points)`` returns one model per panel, by name (``PANELS``):

- ``timeline``: the compute, h2d and d2h tracks of the prediction above those of the
  measurement, fast memory against the budget and each link's GB/s against its
  bandwidth, all on one time axis (zoom with the wheel, pan by dragging);
- ``deviations``: the tasks whose measured time differs most from the predicted;
- ``stalls``: what the compute stream waited for, summed by object;
- ``sweep``: the predicted step and tokens/s over a range of budgets.

The summary cards are HTML (``cards_html``), not a plot.
"""

from __future__ import annotations

import html
from typing import Any

from bokeh.layouts import column, row
from bokeh.models import (
    ColumnDataSource,
    DataTable,
    Div,
    FactorRange,
    HoverTool,
    NumberFormatter,
    Range1d,
    Span,
    TableColumn,
)
from bokeh.palettes import Category10_10
from bokeh.plotting import figure

from dataflow import Timeline, format_size
from dataflow_viewer.metrics import (
    FAST_MEMORY,
    StepWork,
    budget_limit,
    deviations,
    link_rates,
    stalls_by_object,
    summary,
)
from dataflow_viewer.run import MEASURED, PREDICTED, Run
from dataflow_viewer.sweep import SweepPoint

PANELS = ("timeline", "deviations", "stalls", "sweep")
DIRECTIONS = ("h2d", "d2h")  # the two links, each a track
TOP_DEVIATIONS = 20
TOP_STALLS = 15
MiB = float(1 << 20)
ROLE_PREFIX = f"{FAST_MEMORY}: "  # the bundle's fast-memory counters by role
TOOLS = "xpan,xwheel_zoom,box_zoom,reset,save"
#: how each run's lines are drawn where both share a plot
DASH = {PREDICTED: "solid", MEASURED: "dashed"}
LINK_COLOUR = {"h2d": Category10_10[0], "d2h": Category10_10[1]}

#: the summary cards: (key of ``metrics.summary``, label, how a value reads)
CARDS = (
    ("step_s", "s/step", lambda v: f"{v:.4g} s"),
    ("tok_s", "tokens/s", lambda v: f"{v:,.0f}"),
    ("tflops", "model TFLOP/s", lambda v: f"{v:.3g}"),
    ("fast_peak_bytes", "fast-memory peak", lambda v: format_size(int(v))),
    ("h2d_bytes", "bytes moved h2d", lambda v: format_size(int(v))),
    ("d2h_bytes", "bytes moved d2h", lambda v: format_size(int(v))),
    ("compute_idle_pct", "compute idle", lambda v: f"{v:.1f} %"),
    ("recompute_pct", "recompute", lambda v: f"{v:.1f} %"),
)


def step_times(run: Run) -> dict[str, float | None]:
    """The step time of each side where the bundle's summary says it better than the
    traced step's length: the plan's step (a cyclic plan's steady-state iteration) and
    the median of the measured steps."""
    found: dict[str, float | None] = {PREDICTED: None, MEASURED: None}
    if run.summary is not None:
        found[PREDICTED] = run.summary.step_s
        if run.summary.measured is not None:
            found[MEASURED] = run.summary.measured.step_s
    return found


def cards_html(run: Run, work: StepWork | None) -> str:
    """The summary cards: each figure predicted, measured and their difference."""
    steps = step_times(run)
    figures = {
        name: summary(timeline, work, steps[name]) for name, timeline in run.timelines.items()
    }
    cells = []
    for key, label, fmt in CARDS:
        predicted = figures[PREDICTED][key]
        measured = figures.get(MEASURED, {}).get(key)
        shown = [fmt(predicted) if predicted is not None else "n/a"]
        if run.measured is not None:
            shown.append(fmt(measured) if measured is not None else "n/a")
            shown.append(_difference(predicted, measured))
        rows = "".join(
            f'<div class="card-row"><span>{name}</span><b>{html.escape(value)}</b></div>'
            for name, value in zip(("predicted", "measured", "difference"), shown, strict=False)
        )
        cells.append(
            f'<div class="card" data-metric="{key}"><h3>{html.escape(label)}</h3>{rows}</div>'
        )
    note = (
        ""
        if run.measured is not None
        else '<p class="note">No measured run: the cards show the prediction alone.</p>'
    )
    return f'<div class="cards">{"".join(cells)}</div>{note}'


def _difference(predicted: float | None, measured: float | None) -> str:
    if predicted is None or measured is None:
        return "n/a"
    if predicted == 0:
        return "0" if measured == 0 else "new"
    return f"{100 * (measured - predicted) / predicted:+.1f} %"


def panels(run: Run, sweep_points: list[SweepPoint]) -> dict[str, Any]:
    """Every panel of ``run`` by name (module docstring)."""
    return {
        "timeline": timeline_panel(run),
        "deviations": deviations_panel(run),
        "stalls": stalls_panel(run),
        "sweep": sweep_panel(sweep_points, run.budget_bytes),
    }


def timeline_panel(run: Run) -> Any:
    end_ms = max(timeline.end_us for timeline in run.timelines.values()) / 1e3
    x_range = Range1d(0, end_ms * 1.01 or 1.0, bounds=(0, end_ms * 1.01 or 1.0))
    tracks = [f"{name} {track}" for name in run.timelines for track in ("compute", *DIRECTIONS)]
    spans = time_figure(
        "Timeline (predicted above measured)",
        x_range,
        90 + 28 * len(tracks),
        y_range=FactorRange(*reversed(tracks)),
    )
    kinds = sorted({span.kind or "task" for t in run.timelines.values() for span in t.tasks})
    colour = {kind: Category10_10[(i + 2) % 10] for i, kind in enumerate(kinds)}
    for name, timeline in run.timelines.items():
        spans.hbar(source=_task_source(name, timeline, colour), **_bar_glyph())
        spans.hbar(source=_transfer_source(name, timeline), **_bar_glyph())
    spans.add_tools(
        HoverTool(
            tooltips=[
                ("", "@label"),
                ("kind", "@kind"),
                ("start", "@left{0.000} ms"),
                ("duration", "@duration_us{0.0} µs"),
                ("bytes", "@size"),
            ]
        )
    )
    return column(
        spans, memory_figure(run, x_range), links_figure(run, x_range), sizing_mode="stretch_width"
    )


def time_figure(title: str, x_range: Range1d, height: int, **options: Any) -> Any:
    """A full-width plot on the shared time axis (ms), zoomed by the wheel along it."""
    return figure(
        title=title,
        x_range=x_range,
        height=height,
        sizing_mode="stretch_width",
        tools=TOOLS,
        active_scroll="xwheel_zoom",
        x_axis_label="time (ms)",
        **options,
    )


def _bar_glyph() -> dict[str, Any]:
    return {
        "y": "track",
        "left": "left",
        "right": "right",
        "height": 0.8,
        "fill_color": "colour",
        "line_color": None,
    }


def _task_source(name: str, timeline: Timeline, colour: dict[str, str]) -> ColumnDataSource:
    tasks = timeline.tasks
    return ColumnDataSource(
        {
            "track": [f"{name} compute"] * len(tasks),
            "left": [span.start_us / 1e3 for span in tasks],
            "right": [span.end_us / 1e3 for span in tasks],
            "label": [span.task_id for span in tasks],
            "kind": [span.kind or "task" for span in tasks],
            "duration_us": [span.duration_us for span in tasks],
            "size": [""] * len(tasks),
            "colour": [colour[span.kind or "task"] for span in tasks],
        }
    )


def _transfer_source(name: str, timeline: Timeline) -> ColumnDataSource:
    moved = timeline.transfers
    return ColumnDataSource(
        {
            "track": [f"{name} {span.direction}" for span in moved],
            "left": [span.start_us / 1e3 for span in moved],
            "right": [span.end_us / 1e3 for span in moved],
            "label": [span.obj_id for span in moved],
            "kind": [span.direction for span in moved],
            "duration_us": [span.duration_us for span in moved],
            "size": [format_size(span.size_bytes) for span in moved],
            "colour": [LINK_COLOUR[span.direction] for span in moved],
        }
    )


def memory_figure(run: Run, x_range: Range1d) -> Any:
    """Fast memory (MiB) over time against the budget: the prediction stacked by role
    (where its timeline has the role counters), each run's total as a line."""
    fig = time_figure("Fast memory by role against the budget", x_range, 280, y_axis_label="MiB")
    roles = [c for c in run.predicted.counters if c.name.startswith(ROLE_PREFIX) and c.peak > 0]
    if roles:
        times = sorted({t for counter in roles for t, _ in counter.points})
        columns = {"t": [t / 1e3 for t in times]}
        for counter in roles:
            columns[counter.name] = [v / MiB for v in _values_at(counter.points, times)]
        names = [counter.name for counter in roles]
        fig.varea_stack(
            names,
            x="t",
            source=ColumnDataSource(columns),
            color=[Category10_10[i % 10] for i in range(len(names))],
            legend_label=[f"predicted {n.removeprefix(ROLE_PREFIX)}" for n in names],
            alpha=0.5,
        )
    for name, timeline in run.timelines.items():
        total = timeline.counter(FAST_MEMORY)
        if total is None or not total.points:
            continue
        fig.step(
            [t / 1e3 for t, _ in total.points],
            [value / MiB for _, value in total.points],
            mode="after",
            line_width=2,
            line_dash=DASH[name],
            color="black",
            legend_label=f"{name}: {total.name}",
        )
    budget = run.budget_bytes or budget_limit(run.predicted)
    if budget:
        fig.add_layout(Span(location=budget / MiB, dimension="width", line_color="red"))
        fig.title.text += f" ({format_size(budget)}, red)"
    fig.legend.location = "top_left"
    fig.legend.click_policy = "hide"
    return fig


def _values_at(points: tuple, times: list[float]) -> list[float]:
    """A step function's value at each of ``times`` (sorted), 0 before its first point."""
    values, i, value = [], 0, 0.0
    for t in times:
        while i < len(points) and points[i][0] <= t:
            value = points[i][1]
            i += 1
        values.append(value)
    return values


def links_figure(run: Run, x_range: Range1d) -> Any:
    """Each link's GB/s over time against its bandwidth (dotted)."""
    fig = time_figure("Link use against bandwidth (dotted)", x_range, 220, y_axis_label="GB/s")
    for name, timeline in run.timelines.items():
        for direction, counter in link_rates(timeline).items():
            fig.step(
                [t / 1e3 for t, _ in counter.points],
                [rate for _, rate in counter.points],
                mode="after",
                line_dash=DASH[name],
                color=LINK_COLOUR.get(direction, "grey"),
                legend_label=f"{name} {direction}",
            )
    for direction in DIRECTIONS:
        link = getattr(run.program.links, direction)
        fig.add_layout(
            Span(
                location=link.bw_bytes_per_us / 1e3,
                dimension="width",
                line_dash="dotted",
                line_color=LINK_COLOUR[direction],
            )
        )
    fig.legend.click_policy = "hide"
    return fig


def deviations_panel(run: Run) -> Any:
    title = f"The {TOP_DEVIATIONS} tasks that deviate most (measured - predicted)"
    if run.measured is None:
        return Div(text=f"<h3>{title}</h3><p class='note'>No measured run to compare.</p>")
    found = deviations(run.predicted, run.measured, TOP_DEVIATIONS)
    source = ColumnDataSource(
        {
            "task": [d.task_id for d in found],
            "kind": [d.kind for d in found],
            "predicted_us": [d.predicted_us for d in found],
            "measured_us": [d.measured_us for d in found],
            "diff_us": [d.diff_us for d in found],
            "ratio": [d.ratio if d.ratio is not None else float("nan") for d in found],
        }
    )
    number = NumberFormatter(format="0,0.0")
    table = DataTable(
        source=source,
        columns=[
            TableColumn(field="task", title="task"),
            TableColumn(field="kind", title="kind"),
            TableColumn(field="predicted_us", title="predicted µs", formatter=number),
            TableColumn(field="measured_us", title="measured µs", formatter=number),
            TableColumn(field="diff_us", title="difference µs", formatter=number),
            TableColumn(
                field="ratio", title="measured/predicted", formatter=NumberFormatter(format="0.00")
            ),
        ],
        height=30 + 25 * max(len(found), 1),
        sizing_mode="stretch_width",
        index_position=None,
        reorderable=False,
    )
    return column(Div(text=f"<h3>{title}</h3>"), table, sizing_mode="stretch_width")


def stalls_panel(run: Run) -> Any:
    figures = []
    for name, timeline in run.timelines.items():
        found = stalls_by_object(timeline, run.program)[:TOP_STALLS]
        objects = [obj for obj, _, _ in found] or ["(no stall)"]
        fig = figure(
            title=f"{name}: compute waited for (µs, by object)",
            y_range=FactorRange(*reversed(objects)),
            height=80 + 22 * len(objects),
            sizing_mode="stretch_width",
            tools="hover,save",
            tooltips=[("object", "@obj"), ("waited", "@wait_us{0.0} µs"), ("times", "@times")],
            x_axis_label="µs",
        )
        fig.hbar(
            source=ColumnDataSource(
                {
                    "obj": [obj for obj, _, _ in found],
                    "wait_us": [wait for _, wait, _ in found],
                    "times": [times for _, _, times in found],
                }
            ),
            y="obj",
            right="wait_us",
            height=0.7,
            color=Category10_10[3],
        )
        fig.x_range.start = 0
        figures.append(fig)
    return row(*figures, sizing_mode="stretch_width")


def sweep_panel(points: list[SweepPoint], budget_bytes: int | None) -> Any:
    planned = [p for p in points if p.step_s is not None]
    source = ColumnDataSource(
        {
            "budget": [p.budget_bytes / MiB for p in planned],
            "step_ms": [p.step_s * 1e3 for p in planned],
            "tok_s": [p.tok_s if p.tok_s is not None else float("nan") for p in planned],
        }
    )
    figures = []
    for field, label in (("step_ms", "predicted ms/step"), ("tok_s", "predicted tokens/s")):
        fig = figure(
            title=f"Budget sweep: {label}",
            height=260,
            sizing_mode="stretch_width",
            tools="hover,save",
            tooltips=[("budget", "@budget{0.00} MiB"), (label, f"@{field}{{0,0.000}}")],
            x_axis_label="fast budget (MiB)",
            y_axis_label=label,
        )
        fig.line("budget", field, source=source, line_width=2)
        fig.scatter("budget", field, source=source, size=7)
        if budget_bytes:
            fig.add_layout(
                Span(location=budget_bytes / MiB, dimension="height", line_dash="dashed")
            )
        figures.append(fig)
    return row(*figures, sizing_mode="stretch_width")
