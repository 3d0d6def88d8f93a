"""``ddpwatch report`` as Markdown (to read in a terminal or paste into an issue) and as JSON
(for scripts: stable, sorted keys). Pure functions of ``RunReport``."""

from __future__ import annotations

import json
import math
import re
from typing import Any

import msgspec

from ddpwatch.core.vocabulary import RankState
from ddpwatch.outputs.postmortem import (
    Culprit,
    RankStats,
    RunReport,
    event_text,
    fmt_change,
    pair_ranks,
    ratio,
)
from ddpwatch.status.fmt import duration, elapsed, iso_time, report_bytes, step_seconds
from ddpwatch.status.report_schema import (
    REPORT_SCHEMA,
    ReportAlert,
    ReportAttempt,
    ReportCulprit,
    ReportDocument,
    ReportHint,
    ReportRank,
)

TABLE_ROWS = 256  # ranks listed in a table; the JSON has them all
CULPRITS_SHOWN = 16  # an alert about every rank (all stalled) must not print 8,192 stacks
SPARK = "▁▂▃▄▅▆▇█"
SPARK_WIDTH = 16
_INT_METRICS = frozenset({"step", "mem_allocated_bytes", "gpu_mem_used_bytes"})


# ------------------------------------------------------------------ shared words


def header_line(report: RunReport) -> str:
    """When the job ran, for how long, how big: the line under every title."""
    started = report.document.job_started
    seen = [r for r in report.ranks if r.state != RankState.NOT_CONNECTED]
    parts = []
    if started is not None and report.frames:
        parts.append(f"started {iso_time(started, 'seconds')}")
    parts.append(f"ran {duration(report.duration_s)}")
    parts.append(f"{len(seen)} rank{'s' if len(seen) != 1 else ''}")
    parts.append(f"{report.frames} messages recorded")
    return ", ".join(parts)


def alerts_text(kinds: tuple[str, ...]) -> str:
    return ", ".join(kinds) if kinds else "—"


def ranks_text(ranks: list[int] | None) -> str:
    if not ranks:
        return "—"
    more = f" and {len(ranks) - 16} more" if len(ranks) > 16 else ""
    return ", ".join(str(r) for r in ranks[:16]) + more


def shown_ranks(report: RunReport) -> tuple[list[RankStats], int]:
    """The rows of the rank table (the telling ones when there are too many), in rank order,
    and how many were left out."""
    if len(report.ranks) <= TABLE_ROWS:
        return report.ranks, 0
    keep = set(report.worst_ranks(TABLE_ROWS))
    return [r for r in report.ranks if r.rank in keep], len(report.ranks) - TABLE_ROWS


def sparkline(report: RunReport, rank: int, top: float | None) -> str:
    """The rank's step time from its first step to its last, on one scale for all ranks
    (a slow rank stands out): the highest step time in each of ``SPARK_WIDTH`` slices."""
    series = report.series.get(rank)
    points = series.points["step_time_s"] if series is not None else []
    if not points or not top:
        return ""
    start = points[0][0]
    span = (points[-1][0] - start) or 1.0
    slices: list[float | None] = [None] * SPARK_WIDTH
    for t, v in points:
        i = min(SPARK_WIDTH - 1, max(0, int((t - start) / span * SPARK_WIDTH)))
        slices[i] = v if slices[i] is None else max(v, slices[i] or 0.0)
    chars, last = [], None
    for value in slices:
        last = value if value is not None else last
        chars.append(SPARK[min(7, int((last or 0.0) / top * 7.999))])
    return "".join(chars)


def top_step_time(report: RunReport) -> float | None:
    values = [v for s in report.series.values() for _, v in s.points["step_time_s"]]
    return max(values) if values else None


# ------------------------------------------------------------------ markdown


def _text(value: Any) -> str:
    """Inline-safe: one line, and no ``<`` that a Markdown viewer would take for a tag."""
    return " ".join(str(value).split()).replace("<", "\\<")


def _cell(value: Any) -> str:
    """Table-safe: ``_text`` with pipes escaped."""
    return _text(value).replace("|", "\\|")


def _row(cells: list[Any]) -> str:
    return "| " + " | ".join(_cell(c) for c in cells) + " |"


def _fence(text: str, info: str = "text") -> list[str]:
    """A code block whose fence is longer than any run of backticks inside."""
    longest = max((len(run) for run in re.findall(r"`+", text)), default=0)
    fence = "`" * max(3, longest + 1)
    return [fence + info, text.rstrip("\n"), fence]


def to_markdown(report: RunReport) -> str:
    """The post-mortem as Markdown."""
    lines = [f"# ddpwatch report: {report.name}", "", header_line(report) + ".", ""]
    lines += [f"> note: {_text(note)}\n" for note in report.notes()]
    lines += [f"**Verdict:** {_text(report.verdict)}", "", "## Summary", ""]
    lines += _fence("\n".join(report.summary))
    lines += ["", "## Timeline", ""]
    if report.history:
        lines.append(_row(["elapsed", "time", "event", "severity", "kind", "ranks", "message"]))
        lines.append("|---:|---|---|---|---|---|---|")
        for entry in report.history:
            alert = entry.alert
            lines.append(
                _row(
                    [
                        elapsed(entry.elapsed_s),
                        entry.time,
                        event_text(entry),
                        alert.severity,
                        alert.kind,
                        ranks_text(alert.ranks),
                        alert.message,
                    ]
                )
            )
    else:
        lines.append("No alerts were raised.")
    lines += ["", "## Ranks", ""]
    lines += _rank_table(report)
    lines += ["", "## Culprits", ""]
    if report.culprits:
        for culprit in report.culprits[:CULPRITS_SHOWN]:
            lines += _culprit(culprit)
        if len(report.culprits) > CULPRITS_SHOWN:
            more = len(report.culprits) - CULPRITS_SHOWN
            lines += [f"{more} more culprits are in `--format json`.", ""]
    else:
        lines.append("No rank was named by an error or a warning.")
    if lines[-1]:
        lines.append("")
    lines += ["## Hints", ""]
    hints = report.hints()
    lines += [f"- **{kind}**: {_text(hint)}" for kind, hint in hints] or ["None."]
    return "\n".join(lines).rstrip() + "\n"


def _rank_table(report: RunReport) -> list[str]:
    rows, left_out = shown_ranks(report)
    if not rows:
        return ["No rank reported."]
    top = top_step_time(report)
    lines = [
        _row(
            ["rank", "host", "state", "steps", "median step", "peak memory", "alerts", "step time"]
        ),
        "|---:|---|---|---:|---:|---:|---|---|",
    ]
    for r in rows:
        spark = sparkline(report, r.rank, top)
        lines.append(
            _row(
                [
                    r.rank,
                    r.host or "—",
                    r.state or "—",
                    "—" if r.steps is None else r.steps,
                    step_seconds(r.median_step_time_s),
                    report_bytes(r.peak_mem_bytes),
                    alerts_text(r.alerts),
                    f"`{spark}`" if spark else "",
                ]
            )
        )
    if left_out:
        lines += ["", f"{left_out} more ranks with nothing to note are in `--format json`."]
    return lines


def _culprit(culprit: Culprit) -> list[str]:
    where = f" at step {culprit.step}" if culprit.step is not None else ""
    lines = [f"### rank {culprit.rank}: {culprit.state or 'unknown'}{where}", ""]
    for alert in culprit.alerts:
        lines.append(f"- **[{alert.severity}] {alert.kind}**: {_text(alert.message)}")
        if alert.hint:
            lines.append(f"  fix: {_text(alert.hint)}")
    error = culprit.error
    if error is not None:
        lines += ["", f"Error: **{_text(error.type)}**: {_text(error.message)}"]
        if error.traceback:
            lines += ["", "Traceback:", "", *_fence(error.traceback)]
    if culprit.stack:
        lines += ["", "Last stack:", "", *_fence(culprit.stack)]
    if culprit.log_tail:
        lines += ["", "Last output:", "", *_fence("\n".join(culprit.log_tail))]
    return [*lines, ""]  # the blank line before the next culprit


def compare_markdown(runs: list[RunReport]) -> str:
    """Two runs side by side: did the change help?"""
    a, b = _two(runs)
    lines = [
        f"# ddpwatch comparison: {a.name} → {b.name}",
        "",
        f"A: `{a.path}` ({header_line(a)})  ",
        f"B: `{b.path}` ({header_line(b)})  ",
        "Changes are B relative to A.",
        "",
    ]
    lines += [f"> note (A): {_text(n)}\n" for n in a.notes()]
    lines += [f"> note (B): {_text(n)}\n" for n in b.notes()]
    lines += [_row(["", "A", "B", "change"]), "|---|---|---|---|"]
    for label, before, after, change in overview_rows(a, b):
        lines.append(_row([label, before, after, change]))
    lines += ["", "## Per rank", ""]
    lines.append(
        _row(
            [
                "rank",
                "steps A",
                "steps B",
                "median step A",
                "median step B",
                "change",
                "peak memory A",
                "peak memory B",
                "change",
                "alerts A",
                "alerts B",
            ]
        )
    )
    lines.append("|---:|---:|---:|---:|---:|---|---:|---:|---|---|---|")
    pairs, left_out = compared_pairs(a, b)
    for pair in pairs:
        x, y = pair.before, pair.after
        lines.append(
            _row(
                [
                    pair.rank,
                    _steps(x),
                    _steps(y),
                    step_seconds(x and x.median_step_time_s),
                    step_seconds(y and y.median_step_time_s),
                    fmt_change(x and x.median_step_time_s, y and y.median_step_time_s),
                    report_bytes(x and x.peak_mem_bytes),
                    report_bytes(y and y.peak_mem_bytes),
                    fmt_change(x and x.peak_mem_bytes, y and y.peak_mem_bytes),
                    alerts_text(x.alerts if x else ()),
                    alerts_text(y.alerts if y else ()),
                ]
            )
        )
    if left_out:
        lines += ["", f"{left_out} more ranks are in `--format json`."]
    return "\n".join(lines).rstrip() + "\n"


def _two(runs: list[RunReport]) -> tuple[RunReport, RunReport]:
    if len(runs) != 2:
        raise ValueError(f"a comparison takes two runs, got {len(runs)}")
    return runs[0], runs[1]


def _steps(stats: RankStats | None) -> str:
    return "—" if stats is None or stats.steps is None else str(stats.steps)


def overview_rows(a: RunReport, b: RunReport) -> list[tuple[str, str, str, str]]:
    """(label, A, B, change) for the run-level comparison."""

    def seen(run: RunReport) -> str:
        return str(sum(1 for r in run.ranks if r.state != RankState.NOT_CONNECTED))

    return [
        ("verdict", a.verdict, b.verdict, ""),
        ("duration", duration(a.duration_s), duration(b.duration_s), ""),
        ("ranks seen", seen(a), seen(b), ""),
        ("alerts raised", str(a.alerts_raised), str(b.alerts_raised), ""),
        (
            "median step time, all ranks",
            step_seconds(a.median_step_time_s),
            step_seconds(b.median_step_time_s),
            fmt_change(a.median_step_time_s, b.median_step_time_s),
        ),
        (
            "median step time, slowest rank",
            step_seconds(a.slowest_step_time_s),
            step_seconds(b.slowest_step_time_s),
            fmt_change(a.slowest_step_time_s, b.slowest_step_time_s),
        ),
        (
            "peak memory, any rank",
            report_bytes(a.peak_mem_bytes),
            report_bytes(b.peak_mem_bytes),
            fmt_change(a.peak_mem_bytes, b.peak_mem_bytes),
        ),
    ]


def compared_pairs(a: RunReport, b: RunReport) -> tuple[list[Any], int]:
    """The per-rank rows (the telling ones when there are too many) and how many were left."""
    pairs = pair_ranks(a, b)
    if len(pairs) <= TABLE_ROWS:
        return pairs, 0
    keep = set(a.worst_ranks(TABLE_ROWS // 2)) | set(b.worst_ranks(TABLE_ROWS // 2))
    shown = [p for p in pairs if p.rank in keep][:TABLE_ROWS]
    return shown, len(pairs) - len(shown)


# ------------------------------------------------------------------ json


def _clean(value: Any) -> Any:
    """JSON without NaN or infinity (strict parsers refuse them): those become null."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): _clean(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_clean(v) for v in value]
    return value


def _dump(data: dict[str, Any]) -> str:
    return json.dumps(_clean(data), indent=2, sort_keys=True, allow_nan=False) + "\n"


def _stats(stats: RankStats | None) -> dict[str, Any] | None:
    return None if stats is None else msgspec.to_builtins(_rank(stats))


def run_data(report: RunReport) -> dict[str, Any]:
    """The report as plain data: what ``to_json`` writes (``status/report_schema.py``)."""
    series: dict[str, dict[str, int | list[list[float]]]] = {
        str(rank): {
            "samples": s.samples,
            **{
                metric: [[round(t, 3), int(v) if metric in _INT_METRICS else v] for t, v in points]
                for metric, points in s.points.items()
            },
        }
        for rank, s in sorted(report.series.items())
    }
    run = report.run
    document = ReportDocument(
        file=report.path,
        verdict=run.text,
        summary=report.summary,
        notes=report.notes(),
        duration_s=report.duration_s,
        t0=report.t0,
        frames=report.frames,
        undecodable_frames=report.undecodable,
        tail_bytes=report.tail_bytes,
        sessions=report.sessions,
        median_step_time_s=report.median_step_time_s,
        slowest_step_time_s=report.slowest_step_time_s,
        peak_mem_bytes=report.peak_mem_bytes,
        ranks=[_rank(r) for r in report.ranks],
        culprits=[
            ReportCulprit(
                rank=c.rank,
                state=c.state,
                step=c.step,
                alerts=[ReportAlert(a.kind, a.severity, a.message, a.hint) for a in c.alerts],
                error=c.error,
                stack=c.stack,
                log_tail=list(c.log_tail),
            )
            for c in report.culprits
        ],
        hints=[ReportHint(kind, hint) for kind, hint in report.hints()],
        episodes=run.episodes,
        time_lost=run.time_lost,  # the summary's own accounts, as the verdict holds them
        attempts=[ReportAttempt(a.attempt, a.verdict) for a in run.attempts],
        series=series,
        status=report.document,
    )
    return msgspec.to_builtins(document)  # type: ignore[no-any-return]


def _rank(stats: RankStats) -> ReportRank:
    return ReportRank(
        stats.rank,
        stats.host,
        stats.state,
        stats.steps,
        stats.median_step_time_s,
        stats.peak_mem_bytes,
        list(stats.alerts),
    )


def to_json(report: RunReport) -> str:
    """The status document, the per-rank series and numbers, the culprits: one JSON object."""
    return _dump(run_data(report))


def compare_json(runs: list[RunReport]) -> str:
    """Two runs' numbers, per run and per rank, with B/A ratios (null where unknown)."""
    a, b = _two(runs)

    def run(r: RunReport) -> dict[str, Any]:
        return {
            "file": r.path,
            "verdict": r.verdict,
            "duration_s": r.duration_s,
            "alerts_raised": r.alerts_raised,
            "median_step_time_s": r.median_step_time_s,
            "slowest_step_time_s": r.slowest_step_time_s,
            "peak_mem_bytes": r.peak_mem_bytes,
        }

    return _dump(
        {
            "comparison": REPORT_SCHEMA,
            "runs": [run(a), run(b)],
            "ratio": {
                "median_step_time": ratio(a.median_step_time_s, b.median_step_time_s),
                "slowest_step_time": ratio(a.slowest_step_time_s, b.slowest_step_time_s),
                "peak_mem": ratio(a.peak_mem_bytes, b.peak_mem_bytes),
            },
            "ranks": [
                {
                    "rank": p.rank,
                    "runs": [_stats(p.before), _stats(p.after)],
                    "step_time_ratio": ratio(
                        p.before.median_step_time_s if p.before else None,
                        p.after.median_step_time_s if p.after else None,
                    ),
                    "peak_mem_ratio": ratio(
                        p.before.peak_mem_bytes if p.before else None,
                        p.after.peak_mem_bytes if p.after else None,
                    ),
                }
                for p in pair_ranks(a, b)
            ],
        }
    )
