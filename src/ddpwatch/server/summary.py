"""The end-of-run summary: how long, which ranks, the alerts in order, how each rank ended,
and one verdict line ("rank 1 exited with code 3 at step 51; ranks 0, 2 failed because of it").

A pure function of the status document (with its ``history``), so ``ddpwatch run``, ``demo``,
``serve`` and ``ddpwatch report`` on a recording all print the same story.
"""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from ddpwatch.server.rules.text import format_ranks
from ddpwatch.vocabulary import AlertKind, RankState, Severity

ALERTS_LISTED = 20
DEAD_STATES = frozenset({RankState.CRASHED, RankState.EXITED, RankState.STOPPED, RankState.SILENT})


def summary_lines(document: dict[str, Any], not_started: str | None = None) -> list[str]:
    """The summary, one line per item, without a prefix. ``not_started``: why the launcher
    ended before any rank reported (its own words, ``launch_failure``), when it did."""
    ranks: list[dict[str, Any]] = [r for r in document.get("ranks", []) if isinstance(r, dict)]
    history: list[dict[str, Any]] = document.get("history") or []
    lines = [_overview(document, ranks)]
    shown = [e for e in history if e.get("event") != "cleared"]
    if shown:
        lines.append("alerts, in order:")
        cleared = _clearing_times(history)
        for entry in shown[:ALERTS_LISTED]:
            lines.append("  " + _alert_line(entry, cleared))
        if len(shown) > ALERTS_LISTED:
            lines.append(f"  and {len(shown) - ALERTS_LISTED} more (ddpwatch status --json)")
    else:
        lines.append("alerts: none")
    ends = [(r["rank"], _ending(r)) for r in ranks]
    if any(end for _, end in ends):
        lines.append("ranks: " + " · ".join(f"{rank} {end}" for rank, end in ends if end))
    seen = any(r.get("state") != RankState.NOT_CONNECTED for r in ranks)
    if not_started is not None and not seen:
        lines.append(f"verdict: the job did not start: {not_started}")
    else:
        lines.append("verdict: " + verdict(document))
    return lines


def verdict(document: dict[str, Any]) -> str:
    """One sentence: the first error that names a culprit, what that rank did, who it took
    down; else the first error, else the warnings, else that nothing was seen."""
    ranks = {r["rank"]: r for r in document.get("ranks", []) if isinstance(r, dict)}
    history = document.get("history") or []
    latest = {_key(e["alert"]): e["alert"] for e in history}  # an alert's numbers update
    latest.update((_key(a), a) for a in document.get("alerts") or [])  # (who waits, for how
    raised = [e for e in history if e.get("event") != "cleared"]  # long) after it is raised
    errors = [
        latest[_key(e["alert"])] for e in raised if e["alert"].get("severity") == Severity.ERROR
    ]
    named = [a for a in errors if a.get("ranks")]
    if named:
        alert = named[0]
        culprits = alert["ranks"]
        text = f"{format_ranks(culprits)} {_what(alert, ranks.get(culprits[0], {}))}"
        waiting = alert.get("waiting") or []
        failed = [r for r in waiting if ranks.get(r, {}).get("state") in DEAD_STATES]
        held = [r for r in waiting if r not in failed]
        if failed:
            text += f"; {format_ranks(failed)} failed because of it"
        if held:
            text += f"; {format_ranks(held)} waited for it"
        return text
    if errors:
        return f"{errors[0].get('kind')}: {errors[0].get('message')} (no single rank to blame)"
    warnings = [e["alert"] for e in raised]
    if warnings:
        kinds = ", ".join(sorted({str(a.get("kind")) for a in warnings}))
        plural = "s" if len(warnings) > 1 else ""
        return f"no errors; {len(warnings)} warning{plural} ({kinds})"
    return "no problems seen"


def _key(alert: dict[str, Any]) -> tuple[str, tuple[int, ...]]:
    return (str(alert.get("kind")), tuple(alert.get("ranks") or ()))


def _overview(document: dict[str, Any], ranks: list[dict[str, Any]]) -> str:
    seen = [r for r in ranks if r.get("state") != RankState.NOT_CONNECTED]
    hosts = {r.get("host") for r in seen if r.get("host")}
    steps = [r["step"] for r in seen if isinstance(r.get("step"), int)]
    started = document.get("job_started")
    now = document.get("server_time")
    parts = []
    if isinstance(started, (int, float)) and isinstance(now, (int, float)):
        parts.append(f"ran {run_duration(now - started)}")
    host_text = f" on {len(hosts)} host{'s' if len(hosts) != 1 else ''}" if hosts else ""
    parts.append(f"{len(seen)} rank{'s' if len(seen) != 1 else ''} seen{host_text}")
    world = document.get("world_size")
    if isinstance(world, int) and world > len(seen):
        parts.append(f"{world - len(seen)} of {world} never reported")
    if steps:
        low, high = min(steps), max(steps)
        parts.append(f"last step {high}" if low == high else f"last steps {low}-{high}")
    return ", ".join(parts)


def _alert_line(entry: dict[str, Any], cleared: dict[tuple[str, tuple[int, ...]], float]) -> str:
    alert = entry["alert"]
    key = _key(alert)
    line = f"+{entry.get('elapsed_s', 0.0):.1f} s [{alert.get('severity')}] {alert.get('kind')}"
    if entry.get("event") == "escalated" and entry.get("from"):
        line += f" (was {entry['from'].get('kind')})"
    up = cleared.get(key)
    if up is not None:
        line += f", cleared after {run_duration(up)}"
    return line + f": {alert.get('message')}"


def _clearing_times(history: Iterable[dict[str, Any]]) -> dict[tuple[str, tuple[int, ...]], float]:
    """How long each alert was up, by (kind, culprits), when it cleared (the last time)."""
    found: dict[tuple[str, tuple[int, ...]], float] = {}
    for entry in history:
        if entry.get("event") == "cleared" and entry.get("duration_s") is not None:
            found[_key(entry["alert"])] = entry["duration_s"]
    return found


def _ending(rank: dict[str, Any]) -> str:
    """How a rank ended: "exit 3", "SIGKILL", "crashed (RuntimeError), exit 1", or ""."""
    state = rank.get("state")
    code, signal = rank.get("exit_code"), rank.get("exit_signal")
    how = signal if signal else (f"exit {code}" if code is not None else "")
    if state == RankState.CRASHED:
        error = rank.get("error") or {}
        kind = f"crashed ({error.get('type')})" if error.get("type") else "crashed"
        return f"{kind}, {how}" if how else kind
    if state in (RankState.STOPPED, RankState.SILENT, RankState.NOT_CONNECTED):
        return f"{state}, {how}" if how else str(state)
    return how


def _what(alert: dict[str, Any], rank: dict[str, Any]) -> str:
    """What the culprit did, in words, with the step where it is known."""
    kind = alert.get("kind")
    step = rank.get("step")
    if kind == AlertKind.EXITED:
        code, signal = rank.get("exit_code"), rank.get("exit_signal")
        text = (
            f"was ended by {signal}"
            if signal
            else f"exited with code {code}"
            if code is not None
            else "exited"
        )
    elif kind == AlertKind.CRASHED:
        error = rank.get("error") or {}
        text = f"crashed with {error['type']}" if error.get("type") else "crashed"
    elif kind == AlertKind.NAN_LOSS:
        text = "produced the first non-finite loss"
        step = rank.get("nan_step", step)
    elif kind in (AlertKind.STRAGGLER, AlertKind.STALLED):
        text = "held the others up (stopped making progress)"
    elif kind == AlertKind.SILENT:
        text = "fell silent"
    elif kind == AlertKind.COLLECTIVE_MISMATCH:
        text = "made a collective call the others did not"
    elif kind == AlertKind.NOT_CONNECTED:
        return "never connected"
    else:
        text = f"raised {kind}"
    return text + (f" at step {step}" if isinstance(step, int) else "")


def run_duration(seconds: float) -> str:
    """How long a run took or an alert was up: "2.3 s", "4 min 12 s", "3 h 5 min"."""
    seconds = max(0.0, seconds)
    if seconds < 60:
        return f"{seconds:.1f} s"
    minutes, secs = divmod(int(seconds), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def print_summary(
    document: dict[str, Any], file: Any, prefix: str = "ddpwatch: ", not_started: str | None = None
) -> None:
    """Write the summary under a rule line, each line prefixed like the alert stream."""
    print(f"{prefix}── summary " + "─" * 40, file=file)
    for line in summary_lines(document, not_started):
        print(prefix + line, file=file)
    file.flush()
