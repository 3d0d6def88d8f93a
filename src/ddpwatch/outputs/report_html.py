"""``ddpwatch report --format html``: one self-contained page (inline CSS and SVG, no script),
to open from a file, attach to an issue or keep as a CI artifact. Pure functions of
``RunReport``; every recorded string is escaped, since ranks send whatever they like."""

from __future__ import annotations

from html import escape

from ddpwatch.core.vocabulary import HistoryEvent, Severity
from ddpwatch.outputs.postmortem import (
    Culprit,
    RunReport,
    event_text,
    fmt_change,
)
from ddpwatch.outputs.report_svg import PALETTE, Line, line_chart
from ddpwatch.outputs.report_text import (
    CULPRITS_SHOWN,
    alerts_text,
    compared_pairs,
    header_line,
    overview_rows,
    ranks_text,
    shown_ranks,
)
from ddpwatch.status.fmt import byte_unit, elapsed, report_bytes, step_seconds

CHART_RANKS = len(PALETTE)  # more lines than colours cannot be told apart

CSS = """
body { font: 14px/1.45 system-ui, sans-serif; margin: 2em auto; max-width: 70em;
       color: #222; padding: 0 1em; }
h1 { font-size: 1.5em; margin-bottom: 0.2em; } h2 { margin-top: 1.8em; font-size: 1.2em; }
.sub, .note { color: #555; } .note { font-style: italic; }
.verdict { font-size: 1.1em; padding: 0.6em 0.9em; border-left: 4px solid #2ca02c;
           background: #f2f8f2; }
.verdict.bad { border-color: #d62728; background: #fdf2f2; }
table { border-collapse: collapse; margin: 0.5em 0; }
th, td { border: 1px solid #ddd; padding: 0.25em 0.55em; text-align: left; vertical-align: top; }
th { background: #f5f5f5; } td.num { text-align: right; font-variant-numeric: tabular-nums; }
.error { color: #b00; } .warning { color: #a60; } .info { color: #357; }
pre { background: #f7f7f7; border: 1px solid #e3e3e3; padding: 0.6em; overflow-x: auto;
      font-size: 12.5px; }
.chart .grid { stroke: #eee; } .chart .axis { stroke: #999; }
.chart text { font: 11px system-ui, sans-serif; fill: #444; }
.pair { display: flex; flex-wrap: wrap; gap: 1em; } .pair > div { flex: 1 1 30em; }
.pair svg { width: 100%; height: auto; }
"""


def _page(title: str, body: list[str]) -> str:
    return "\n".join(
        [
            "<!doctype html>",
            '<html lang="en">',
            "<head>",
            '<meta charset="utf-8">',
            f"<title>{escape(title)}</title>",
            f"<style>{CSS}</style>",
            "</head>",
            "<body>",
            *body,
            "</body>",
            "</html>",
            "",
        ]
    )


def _table(head: list[str], rows: list[list[str]], numeric: frozenset[int] = frozenset()) -> str:
    """A table of already-escaped cells; columns in ``numeric`` align right."""
    out = ["<table>", "<tr>" + "".join(f"<th>{h}</th>" for h in head) + "</tr>"]
    for row in rows:
        cells = (
            f'<td class="num">{cell}</td>' if i in numeric else f"<td>{cell}</td>"
            for i, cell in enumerate(row)
        )
        out.append("<tr>" + "".join(cells) + "</tr>")
    out.append("</table>")
    return "\n".join(out)


def _pre(text: str, css: str = "") -> str:
    attr = f' class="{css}"' if css else ""
    return f"<pre{attr}>{escape(text.rstrip())}</pre>"


def _verdict(report: RunReport) -> str:
    bad = any(
        e.alert.severity == Severity.ERROR
        for e in report.history
        if e.event != HistoryEvent.CLEARED
    )
    css = "verdict bad" if bad else "verdict"
    return f'<p class="{css}"><strong>Verdict:</strong> {escape(report.verdict)}</p>'


# ------------------------------------------------------------------ charts


def memory_metric(runs: list[RunReport]) -> str:
    """The allocator's memory where any rank reported it, else the GPU's (NVML)."""
    for metric in ("mem_allocated_bytes", "gpu_mem_used_bytes"):
        if any(s.points[metric] for run in runs for s in run.series.values()):
            return metric
    return "mem_allocated_bytes"


def _memory_unit(top: float) -> tuple[float, str]:
    found = byte_unit(top)
    return (1.0, "bytes") if found is None else (float(found[0]), found[1])


def _lines(report: RunReport, metric: str) -> list[Line]:
    lines = []
    for rank in sorted(report.worst_ranks(CHART_RANKS)):
        series = report.series.get(rank)
        if series is not None and series.points[metric]:
            lines.append(Line(f"rank {rank}", str(rank), series.points[metric]))
    return lines


def _top(runs: list[RunReport], metric: str) -> tuple[float, float]:
    """The longest run and the largest value of ``metric`` in any run: one scale for all
    (the time axis runs to the end of the recording, so a rank that stopped shows it)."""
    points = [p for r in runs for s in r.series.values() for p in s.points[metric]]
    longest = max((r.duration_s or 0.0 for r in runs), default=0.0)
    return max([longest, *(t for t, _ in points)]), max((v for _, v in points), default=0.0)


def _charts(report: RunReport, runs: list[RunReport]) -> dict[str, str]:
    """The step-time and memory charts of ``report``, on the scale of all ``runs``."""
    out = {}
    memory = memory_metric(runs)
    for title, metric in (("Step time", "step_time_s"), ("Memory", memory)):
        lines = _lines(report, metric)
        if not lines:
            what = "step times" if metric == "step_time_s" else "memory figures"
            out[title] = f'<p class="note">No {what} were recorded.</p>'
            continue
        x_max, y_max = _top(runs, metric)
        scale, unit = (1.0, "seconds") if metric == "step_time_s" else _memory_unit(y_max)
        if metric == "gpu_mem_used_bytes":
            unit += " (GPU, NVML)"
        out[title] = line_chart(
            lines,
            title=f"{title} per rank: {report.name}",
            unit=unit,
            scale=scale,
            x_max=x_max,
            y_max=y_max,
        )
    return out


def _chart_note(report: RunReport) -> str:
    if len(report.series) <= CHART_RANKS:
        return ""
    return (
        f'<p class="note">Showing {CHART_RANKS} of {len(report.series)} ranks: the culprits '
        "and ranks named by alerts first, then the slowest. Every rank's series is in "
        "<code>--format json</code>.</p>"
    )


# ------------------------------------------------------------------ one run


def to_html(report: RunReport) -> str:
    """The post-mortem as one self-contained HTML page."""
    body = [
        f"<h1>ddpwatch report: {escape(report.name)}</h1>",
        f'<p class="sub">{escape(header_line(report))}</p>',
        *(f'<p class="note">Note: {escape(n)}</p>' for n in report.notes()),
        _verdict(report),
        "<h2>Summary</h2>",
        _pre("\n".join(report.summary)),
    ]
    charts = _charts(report, [report])
    for title, chart in charts.items():
        body += [f"<h2>{escape(title)}</h2>", chart]
    body.append(_chart_note(report))
    body += ["<h2>Timeline</h2>", _timeline(report)]
    body += ["<h2>Ranks</h2>", _ranks(report)]
    body.append("<h2>Culprits</h2>")
    body += [_culprit(c) for c in report.culprits[:CULPRITS_SHOWN]] or [
        "<p>No rank was named by an error or a warning.</p>"
    ]
    if len(report.culprits) > CULPRITS_SHOWN:
        more = len(report.culprits) - CULPRITS_SHOWN
        body.append(f'<p class="note">{more} more culprits are in <code>--format json</code>.</p>')
    body.append("<h2>Hints</h2>")
    hints = report.hints()
    if hints:
        items = (f"<li><strong>{escape(k)}</strong>: {escape(h)}</li>" for k, h in hints)
        body += ["<ul>", *items, "</ul>"]
    else:
        body.append("<p>None.</p>")
    return _page(f"ddpwatch report: {report.name}", [b for b in body if b])


def _timeline(report: RunReport) -> str:
    if not report.history:
        return "<p>No alerts were raised.</p>"
    rows = []
    for entry in report.history:
        alert = entry.alert
        severity = alert.severity
        rows.append(
            [
                escape(elapsed(entry.elapsed_s)),
                escape(entry.time),
                escape(event_text(entry)),
                f'<span class="{escape(severity)}">{escape(severity)}</span>',
                escape(alert.kind),
                escape(ranks_text(alert.ranks)),
                escape(alert.message),
            ]
        )
    head = ["elapsed", "time", "event", "severity", "kind", "ranks", "message"]
    return _table(head, rows, frozenset({0}))


def _ranks(report: RunReport) -> str:
    shown, left_out = shown_ranks(report)
    if not shown:
        return "<p>No rank reported.</p>"
    rows = [
        [
            str(r.rank),
            escape(r.host or "—"),
            escape(r.state or "—"),
            "—" if r.steps is None else str(r.steps),
            escape(step_seconds(r.median_step_time_s)),
            escape(report_bytes(r.peak_mem_bytes)),
            escape(alerts_text(r.alerts)),
        ]
        for r in shown
    ]
    head = ["rank", "host", "state", "steps", "median step", "peak memory", "alerts"]
    table = _table(head, rows, frozenset({0, 3, 4, 5}))
    if left_out:
        table += f'\n<p class="note">{left_out} more ranks are in <code>--format json</code>.</p>'
    return table


def _culprit(culprit: Culprit) -> str:
    where = f" at step {culprit.step}" if culprit.step is not None else ""
    out = [f"<h3>rank {culprit.rank}: {escape(culprit.state or 'unknown')}{where}</h3>", "<ul>"]
    for alert in culprit.alerts:
        severity = escape(alert.severity)
        out.append(
            f'<li><span class="{severity}">[{severity}]</span> '
            f"<strong>{escape(alert.kind)}</strong>: {escape(alert.message)}"
            + (f"<br>fix: {escape(alert.hint)}" if alert.hint else "")
            + "</li>"
        )
    out.append("</ul>")
    error = culprit.error
    if error is not None:
        out.append(f"<p>Error: <code>{escape(error.type)}: {escape(error.message)}</code></p>")
        if error.traceback:
            out += ["<p>Traceback:</p>", _pre(error.traceback, "traceback")]
    if culprit.stack:
        out += ["<p>Last stack:</p>", _pre(culprit.stack, "stack")]
    if culprit.log_tail:
        out += ["<p>Last output:</p>", _pre("\n".join(culprit.log_tail), "log")]
    return '<section class="culprit">\n' + "\n".join(out) + "\n</section>"


# ------------------------------------------------------------------ two runs


def compare_html(runs: list[RunReport]) -> str:
    """Two runs side by side: the numbers, then each run's charts on one shared scale."""
    if len(runs) != 2:
        raise ValueError(f"a comparison takes two runs, got {len(runs)}")
    a, b = runs
    body = [
        f"<h1>ddpwatch comparison: {escape(a.name)} → {escape(b.name)}</h1>",
        f'<p class="sub">A: {escape(a.path)} ({escape(header_line(a))})<br>'
        f"B: {escape(b.path)} ({escape(header_line(b))})<br>Changes are B relative to A.</p>",
        *(f'<p class="note">Note (A): {escape(n)}</p>' for n in a.notes()),
        *(f'<p class="note">Note (B): {escape(n)}</p>' for n in b.notes()),
        _table(
            ["", "A", "B", "change"],
            [[escape(cell) for cell in row] for row in overview_rows(a, b)],
        ),
        "<h2>Per rank</h2>",
        _pairs(a, b),
    ]
    charts = [_charts(a, runs), _charts(b, runs)]
    for title in charts[0]:
        body += [f"<h2>{escape(title)}</h2>", '<div class="pair">']
        for label, run, chart in (("A", a, charts[0][title]), ("B", b, charts[1][title])):
            body.append(f"<div><h3>{label}: {escape(run.name)}</h3>\n{chart}</div>")
        body.append("</div>")
    body += [_chart_note(a), _chart_note(b)]
    return _page(f"ddpwatch comparison: {a.name} → {b.name}", [x for x in body if x])


def _pairs(a: RunReport, b: RunReport) -> str:
    pairs, left_out = compared_pairs(a, b)
    rows = []
    for pair in pairs:
        x, y = pair.before, pair.after
        rows.append(
            [
                str(pair.rank),
                "—" if x is None or x.steps is None else str(x.steps),
                "—" if y is None or y.steps is None else str(y.steps),
                escape(step_seconds(x and x.median_step_time_s)),
                escape(step_seconds(y and y.median_step_time_s)),
                escape(fmt_change(x and x.median_step_time_s, y and y.median_step_time_s)),
                escape(report_bytes(x and x.peak_mem_bytes)),
                escape(report_bytes(y and y.peak_mem_bytes)),
                escape(fmt_change(x and x.peak_mem_bytes, y and y.peak_mem_bytes)),
                escape(alerts_text(x.alerts if x else ())),
                escape(alerts_text(y.alerts if y else ())),
            ]
        )
    head = [
        "rank", "steps A", "steps B", "median step A", "median step B", "change",
        "peak memory A", "peak memory B", "change", "alerts A", "alerts B",
    ]  # fmt: skip
    table = _table(head, rows, frozenset({0, 1, 2, 3, 4, 6, 7}))
    if left_out:
        table += f'\n<p class="note">{left_out} more ranks are in <code>--format json</code>.</p>'
    return table
