"""Loss curves of ``metrics.jsonl`` files as one SVG (no plotting library: the project
does not depend on one)::

    python -m benchmarks.loss_plot OUT.svg LABEL=RUN/metrics.jsonl [LABEL=...] [--smooth N]

Each curve is the loss by step, a running mean over ``--smooth`` steps (default: a
hundredth of the longest run, at least 1), so that runs that differ by less than the
step-to-step noise can be told apart. The y axis spans the curves after their first 5 %
of steps (the first steps' loss, far above the rest, would flatten everything after);
what lies above is clipped. The legend gives each curve's last smoothed loss.
"""

from __future__ import annotations

import argparse
import json
import math
from collections.abc import Mapping, Sequence
from html import escape
from pathlib import Path

WIDTH, HEIGHT = 760, 440
LEFT, RIGHT, TOP, BOTTOM = 64, 24, 40, 48
COLORS = ("#d62728", "#1f77b4", "#2ca02c", "#9467bd", "#ff7f0e", "#8c564b")


def read_losses(metrics: Path) -> list[tuple[int, float]]:
    """``(step, loss)`` of every line of a ``metrics.jsonl``."""
    rows = [json.loads(line) for line in Path(metrics).read_text().splitlines() if line]
    return [(int(r["step"]), float(r["loss"])) for r in rows]


def smoothed(points: Sequence[tuple[int, float]], window: int) -> list[tuple[int, float]]:
    """The running mean of the last ``window`` losses at every step."""
    out, total = [], 0.0
    for i, (step, loss) in enumerate(points):
        total += loss
        if i >= window:
            total -= points[i - window][1]
        out.append((step, total / min(i + 1, window)))
    return out


def ticks(low: float, high: float, count: int = 5) -> list[float]:
    """About ``count`` round values from ``low`` to ``high``."""
    span = high - low
    if span <= 0:
        return [low]
    raw = span / count
    unit = 10 ** math.floor(math.log10(raw))
    step = next(m * unit for m in (1, 2, 2.5, 5, 10) if m * unit >= raw)
    first = math.ceil(low / step) * step
    return [first + i * step for i in range(int((high - first) / step + 1e-9) + 1)]


def render(
    curves: Mapping[str, Sequence[tuple[int, float]]], title: str, smooth: int | None = None
) -> str:
    """The SVG text of ``curves`` (label -> (step, loss) points)."""
    longest = max(len(points) for points in curves.values())
    window = smooth or max(1, longest // 100)
    lines = {label: smoothed(points, window) for label, points in curves.items()}
    x_high = max(p[-1][0] for p in lines.values())
    x_low = min(p[0][0] for p in lines.values())
    settled = [loss for p in lines.values() for step, loss in p[len(p) // 20 :]]
    y_low, y_high = min(settled), max(settled)
    pad = 0.05 * (y_high - y_low) or 0.05
    y_low, y_high = y_low - pad, y_high + pad
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(step: float) -> float:
        return LEFT + plot_w * (step - x_low) / max(x_high - x_low, 1)

    def y(loss: float) -> float:
        return TOP + plot_h * (y_high - loss) / (y_high - y_low)

    parts = [
        f'<svg xmlns="http://www.w3.org/2000/svg" width="{WIDTH}" height="{HEIGHT}" '
        f'viewBox="0 0 {WIDTH} {HEIGHT}" font-family="sans-serif" font-size="12">',
        f'<rect width="{WIDTH}" height="{HEIGHT}" fill="white"/>',
        f'<clipPath id="plot"><rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}"/>'
        "</clipPath>",
        f'<text x="{WIDTH / 2}" y="{TOP / 2 + 4}" text-anchor="middle" font-size="14">'
        f"{escape(title)}</text>",
        f'<rect x="{LEFT}" y="{TOP}" width="{plot_w}" height="{plot_h}" fill="none" '
        'stroke="#444"/>',
    ]
    for value in ticks(x_low, x_high):
        parts.append(
            f'<line x1="{x(value):.1f}" y1="{TOP + plot_h}" x2="{x(value):.1f}" '
            f'y2="{TOP + plot_h + 5}" stroke="#444"/><text x="{x(value):.1f}" '
            f'y="{TOP + plot_h + 18}" text-anchor="middle">{value:g}</text>'
        )
    for value in ticks(y_low, y_high):
        parts.append(
            f'<line x1="{LEFT}" y1="{y(value):.1f}" x2="{LEFT + plot_w}" y2="{y(value):.1f}" '
            f'stroke="#ddd"/><text x="{LEFT - 6}" y="{y(value) + 4:.1f}" '
            f'text-anchor="end">{value:g}</text>'
        )
    parts.append(
        f'<text x="{LEFT + plot_w / 2}" y="{HEIGHT - 10}" text-anchor="middle">step</text>'
        f'<text x="16" y="{TOP + plot_h / 2}" text-anchor="middle" '
        f'transform="rotate(-90 16 {TOP + plot_h / 2})">loss (mean of {window} steps)</text>'
    )
    for index, (label, points) in enumerate(lines.items()):
        color = COLORS[index % len(COLORS)]
        path = " ".join(f"{x(s):.1f},{y(v):.2f}" for s, v in points)
        parts.append(
            f'<polyline class="curve" data-label="{escape(label)}" fill="none" '
            f'stroke="{color}" stroke-width="1.5" clip-path="url(#plot)" points="{path}"/>'
        )
        legend_y = TOP + 18 + 18 * index
        parts.append(
            f'<line x1="{LEFT + plot_w - 210}" y1="{legend_y - 4}" x2="{LEFT + plot_w - 186}" '
            f'y2="{legend_y - 4}" stroke="{color}" stroke-width="2"/>'
            f'<text x="{LEFT + plot_w - 180}" y="{legend_y}">{escape(label)}: '
            f"{points[-1][1]:.4f} at step {points[-1][0]}</text>"
        )
    parts.append("</svg>")
    return "\n".join(parts) + "\n"


def write_plot(
    path: Path, metrics: Mapping[str, Path], title: str, smooth: int | None = None
) -> Path:
    """Write the SVG of the ``metrics.jsonl`` files (label -> path) to ``path``."""
    curves = {label: read_losses(file) for label, file in metrics.items()}
    Path(path).write_text(render(curves, title, smooth))
    return Path(path)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("out", type=Path)
    parser.add_argument("runs", nargs="+", metavar="LABEL=METRICS")
    parser.add_argument("--smooth", type=int, default=None)
    parser.add_argument("--title", default="loss by step")
    args = parser.parse_args(argv)
    metrics = {}
    for run in args.runs:
        label, equals, file = run.partition("=")
        if not equals:
            parser.error(f"{run!r}: give LABEL=PATH/metrics.jsonl")
        metrics[label] = Path(file)
    print(write_plot(args.out, metrics, args.title, args.smooth))


if __name__ == "__main__":
    main()
