"""The header: job summary on top of the dashboard, packed to the terminal's width."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

from ddpwatch.core.vocabulary import SEVERITIES, RankState, Severity
from ddpwatch.status.fmt import NA, uptime
from ddpwatch.status.schema import StatusDocument, Summary, SummaryReply
from ddpwatch.tui.data.model import TableQuery, job_wait_fraction
from ddpwatch.tui.widgets.fmt import DASH
from ddpwatch.tui.widgets.packed import pack

SEVERITY_STYLE: dict[str, str] = {
    Severity.ERROR: "bold red",
    Severity.WARNING: "bold yellow",
    Severity.INFO: "bold cyan",
}
SEVERITY_GLYPH: dict[str, str] = {Severity.ERROR: "✖", Severity.WARNING: "▲", Severity.INFO: "●"}
NOTE_SEP = " · "
"""Between the parts of a source's ``note``: the header breaks its line there first."""


@dataclass
class HeaderInfo:
    """Everything the header shows; built by the screen from the latest document."""

    source: str = ""
    connected: bool | None = None
    """None until the first fetch returned."""
    world_size: int | None = None
    connected_ranks: int = 0
    total_ranks: int = 0
    hosts: int = 0
    step_min: int | None = None
    step_max: int | None = None
    waiting: float | None = None
    """The share of the job's step time its ranks spend waiting for each other
    (``model.job_wait_fraction``), or None when no rank reports its step split."""
    alerts: dict[str, int] = field(default_factory=dict)
    msg_rate: float | None = None
    uptime_s: float | None = None
    query: TableQuery = field(default_factory=TableQuery)
    sort_title: str = "worst first"
    shown: int = 0
    paused: bool = False
    listed: int | None = None
    """A summary's rank entries (its worst ranks): the table holds these, not every rank."""
    has_document: bool = False
    """False until a first document arrived: then there is nothing to count yet."""
    ended_s: float | None = None
    """How long ago the job ended (``story``), or None while it runs."""
    note: str | None = None
    """A line of the source's own (``ddpwatch demo``: which fault is under way, which next)."""
    following: bool = True
    """The cursor follows the culprits of new alerts; False once the user moved it."""
    attempt: int = 1
    """The launcher's attempt the job is in (the status document's ``attempt``)."""


def summarize(document: StatusDocument) -> dict[str, Any]:
    """World size, connected ranks, hosts and step range of a status document (of all ranks
    from a summary's counts, when the document is one: ``status?view=summary``)."""
    if isinstance(document, SummaryReply):
        return _from_summary(document, document.summary)
    ranks = document.ranks
    hosts = set()
    connected = 0
    low = high = None
    for row in ranks:
        if row.state != RankState.NOT_CONNECTED:
            connected += 1
        host = row.host
        if host is not None:
            hosts.add(host)
        step = row.step
        if step is not None:
            low = step if low is None or step < low else low
            high = step if high is None or step > high else high
    return {
        "world_size": document.world_size,
        "attempt": _attempt(document),
        "connected_ranks": connected,
        "total_ranks": len(ranks),
        "hosts": len(hosts),
        "step_min": low,
        "step_max": high,
        "waiting": job_wait_fraction(ranks),
    }


def _from_summary(document: StatusDocument, counts: Summary) -> dict[str, Any]:
    """``summarize`` of a summary reply: its ranks are only the worst few, its counts cover
    every rank."""
    total = counts.ranks
    hosts = counts.hosts
    lows = [h.step_min for h in hosts if h.step_min is not None]
    highs = [h.step_max for h in hosts if h.step_max is not None]
    named = sum(1 for h in hosts if h.host is not None)
    return {
        "world_size": document.world_size,
        "attempt": _attempt(document),
        "connected_ranks": total - counts.states.get(RankState.NOT_CONNECTED, 0),
        "total_ranks": total,
        "hosts": named + counts.hosts_omitted,
        "step_min": min(lows, default=None),
        "step_max": max(highs, default=None),
        "waiting": None,  # its ranks are the worst few: their waits say nothing of the job's
        "listed": len(document.ranks),
    }


def _attempt(document: StatusDocument) -> int:
    return document.attempt if document.attempt > 0 else 1


def header_lines(info: HeaderInfo, width: int) -> list[Text]:
    """The header's lines for a terminal ``width`` cells wide: the job on top; below, the
    connection, the alerts, the table's view and where the data comes from."""
    bottom = [*_connection_parts(info), *_alert_parts(info), *_view_parts(info)]
    if info.paused:
        bottom.append(Text(" PAUSED ", style="bold black on yellow"))
    if info.connected:
        bottom.append(Text(info.source, style="dim"))
    lines = pack(_job_parts(info), width) + pack(bottom, width)
    if info.note:  # its parts (" · ") whole where they fit, each line cut at the width
        parts = [Text(part, style="bold cyan") for part in info.note.split(NOTE_SEP)]
        for line in pack(parts, width, sep=NOTE_SEP):
            line.truncate(width, overflow="ellipsis")
            lines.append(line)
    return lines


def _kv(label: str, value: str, style: str = "bold") -> Text:
    return Text.assemble((label + " ", "dim"), (value, style))


def _job_parts(info: HeaderInfo) -> list[Text]:
    """The top line: the launcher's attempt once it restarted the job, world size,
    connected ranks (red while some are missing), hosts, the step range, the share of step
    time spent waiting (where ranks report their step split), messages per second and
    uptime."""
    expected = info.world_size if info.world_size is not None else NA
    ranks_style = (
        "bold" if info.world_size is None or info.connected_ranks >= info.world_size else "bold red"
    )
    if info.step_min is None:
        steps = NA
    elif info.step_min == info.step_max:
        steps = str(info.step_min)
    else:
        steps = f"{info.step_min}{DASH}{info.step_max}"
    rate = NA if info.msg_rate is None else f"{info.msg_rate:.0f}"
    restarted = [_kv("attempt", str(info.attempt), "bold yellow")] if info.attempt > 1 else []
    waiting = []
    if info.waiting is not None:
        waiting = [
            Text.assemble(
                ("waiting ", "dim"),
                (f"{round(100 * info.waiting)}%", "bold"),
                (" of step time", "dim"),
            )
        ]
    return [
        Text("ddpwatch", style="bold magenta"),
        *restarted,
        _kv("world", str(expected)),
        _kv("ranks", f"{info.connected_ranks}/{expected}", ranks_style),
        _kv("hosts", str(info.hosts)),
        _kv("step", steps),
        *waiting,
        _kv("msg/s", rate),
        _kv("up", uptime(info.uptime_s)),
    ]


def _connection_parts(info: HeaderInfo) -> list[Text]:
    """The source, marked disconnected or connecting; nothing once connected."""
    if info.connected is False:
        return [Text.assemble((info.source + " ", "dim"), (" DISCONNECTED ", "bold white on red"))]
    if info.connected is None:
        return [Text.assemble((info.source + " ", "dim"), ("connecting…", "italic yellow"))]
    return []


def _alert_parts(info: HeaderInfo) -> list[Text]:
    """That the job finished, when it has; the alert counts by severity, "no alerts" once a
    document says so (while the job runs), else nothing."""
    ended = []
    if info.ended_s is not None:
        ended = [Text(f" job finished {uptime(info.ended_s)} ago ", style="bold reverse")]
    if sum(info.alerts.values()):
        parts = [Text("alerts", style="dim")]
        for severity in SEVERITIES:
            count = info.alerts.get(severity, 0)
            if count:
                parts.append(
                    Text(
                        f"{SEVERITY_GLYPH[severity]} {count} {severity}",
                        style=SEVERITY_STYLE[severity],
                    )
                )
        return [*ended, Text(" ").join(parts)]
    if ended:
        return ended
    if info.has_document:
        return [Text("✔ no alerts", style="bold green")]
    return []


def _view_parts(info: HeaderInfo) -> list[Text]:
    """How the table is sorted and filtered, and how many rows it shows when filtered."""
    query = info.query
    view = [_kv("sort", info.sort_title + (" ▲" if query.reverse else ""), "bold")]
    if query.filter:
        view.append(_kv("filter", query.filter, "bold yellow"))
    if query.flagged:
        view.append(Text("flagged only", style="bold yellow"))
    if query.grouped:
        view.append(Text("by host", style="bold yellow"))
    if query.filter or query.flagged or query.grouped:
        view.append(_kv("shown", str(info.shown)))
    if info.listed is not None:  # a large job: the table holds the worst ranks only
        view.append(_kv("worst", f"{info.listed} of {info.total_ranks}", "bold yellow"))
    if not info.following:
        view.append(_kv("cursor", "yours (f: follow culprits)"))
    return view


class StatusHeader(Widget):
    """World size, ranks, hosts, steps, alert counts, messages/s, uptime, source."""

    DEFAULT_CSS = """
    StatusHeader {
        height: auto;
        max-height: 5;
        padding: 0 1;
        background: $panel;
    }
    """

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.info = HeaderInfo()

    def show(self, info: HeaderInfo) -> None:
        """Repaint; lay the screen out again only when the header's height changes."""
        width = max(20, self.content_size.width or 80)
        before = len(header_lines(self.info, width))
        self.info = info
        self.refresh(layout=len(header_lines(info, width)) != before)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        return len(header_lines(self.info, max(20, width)))

    def render(self) -> Text:
        width = self.content_size.width or 80
        return Text("\n").join(header_lines(self.info, max(20, width)))
