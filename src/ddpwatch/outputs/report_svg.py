"""Inline SVG line charts for ``ddpwatch report --format html``: no script and no other file,
so the page still works as a mail attachment or a CI artifact years later."""

from __future__ import annotations

import math
from dataclasses import dataclass
from html import escape

from ddpwatch.outputs.postmortem import Point

PALETTE = (
    "#1f77b4", "#d62728", "#2ca02c", "#ff7f0e", "#9467bd", "#8c564b", "#e377c2", "#7f7f7f",
    "#bcbd22", "#17becf", "#393b79", "#637939", "#8c6d31", "#843c39", "#7b4173", "#3182bd",
)  # fmt: skip
WIDTH, HEIGHT = 760, 260
LEFT, RIGHT, TOP, BOTTOM = 70, 110, 18, 38  # room for tick labels and the legend
LEGEND_ROW = 14


@dataclass(frozen=True)
class Line:
    """One polyline: ``key`` lands in ``data-rank`` so tests and scripts can find it."""

    label: str
    key: str
    points: list[Point]


def nice_ticks(high: float, count: int = 5) -> list[float]:
    """0 and round steps (1, 2, 2.5 or 5 times a power of ten) up to at least ``high``."""
    if not high > 0 or not math.isfinite(high):
        return [0.0, 1.0]
    raw = high / (count - 1)
    magnitude = 10 ** math.floor(math.log10(raw))
    step = next(m * magnitude for m in (1, 2, 2.5, 5, 10) if m * magnitude >= raw * (1 - 1e-9))
    n = max(1, math.ceil(high / step - 1e-9))
    return [i * step for i in range(n + 1)]


def _label(value: float) -> str:
    return f"{value:.4g}"


def line_chart(
    lines: list[Line],
    *,
    title: str,
    unit: str,
    scale: float = 1.0,
    x_max: float | None = None,
    y_max: float | None = None,
) -> str:
    """An SVG chart of ``lines`` against seconds; values are divided by ``scale`` and
    labelled in ``unit``. ``x_max``/``y_max`` fix the axes (two runs on one scale)."""
    values = [v / scale for line in lines for _, v in line.points]
    times = [t for line in lines for t, _ in line.points]
    xs = nice_ticks(max(x_max or 0.0, max(times, default=0.0)))
    ys = nice_ticks(max((y_max or 0.0) / scale, max(values, default=0.0)))
    plot_w, plot_h = WIDTH - LEFT - RIGHT, HEIGHT - TOP - BOTTOM

    def x(t: float) -> float:
        return LEFT + min(max(t, 0.0), xs[-1]) / xs[-1] * plot_w

    def y(v: float) -> float:
        return TOP + plot_h - min(max(v, 0.0), ys[-1]) / ys[-1] * plot_h

    out = [
        f'<svg xmlns="http://www.w3.org/2000/svg" class="chart" viewBox="0 0 {WIDTH} {HEIGHT}" '
        f'width="{WIDTH}" height="{HEIGHT}" role="img" aria-label="{escape(title)}">',
        f"<title>{escape(title)}</title>",
    ]
    for tick in ys:
        out.append(
            f'<line class="grid" x1="{LEFT}" x2="{LEFT + plot_w}" y1="{y(tick):.1f}" '
            f'y2="{y(tick):.1f}"/>'
            f'<text class="tick" x="{LEFT - 6}" y="{y(tick) + 4:.1f}" text-anchor="end">'
            f"{escape(_label(tick))}</text>"
        )
    for tick in xs:
        out.append(
            f'<text class="tick" x="{x(tick):.1f}" y="{TOP + plot_h + 16}" '
            f'text-anchor="middle">{escape(_label(tick))}</text>'
        )
    out.append(
        f'<line class="axis" x1="{LEFT}" x2="{LEFT}" y1="{TOP}" y2="{TOP + plot_h}"/>'
        f'<line class="axis" x1="{LEFT}" x2="{LEFT + plot_w}" y1="{TOP + plot_h}" '
        f'y2="{TOP + plot_h}"/>'
        f'<text class="unit" x="{LEFT - 6}" y="{TOP - 6}" text-anchor="end">'
        f"{escape(unit)}</text>"
        f'<text class="unit" x="{LEFT + plot_w}" y="{HEIGHT - 4}" text-anchor="end">'
        "seconds since the job started</text>"
    )
    for i, line in enumerate(lines):
        color = PALETTE[i % len(PALETTE)]
        coords = " ".join(f"{x(t):.1f},{y(v / scale):.1f}" for t, v in line.points)
        out.append(
            f'<polyline class="series" data-rank="{escape(line.key)}" fill="none" '
            f'stroke="{color}" stroke-width="1.5" points="{coords}">'
            f"<title>{escape(line.label)}</title></polyline>"
        )
        if len(line.points) == 1:  # a lone point draws no line: mark it
            t, v = line.points[0]
            out.append(f'<circle cx="{x(t):.1f}" cy="{y(v / scale):.1f}" r="2" fill="{color}"/>')
        row = TOP + i * LEGEND_ROW
        out.append(
            f'<rect x="{WIDTH - RIGHT + 14}" y="{row}" width="10" height="10" fill="{color}"/>'
            f'<text class="legend" x="{WIDTH - RIGHT + 28}" y="{row + 9}">'
            f"{escape(line.label)}</text>"
        )
    out.append("</svg>")
    return "\n".join(out)
