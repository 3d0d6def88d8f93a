"""The dashboard screen: layout and logic (the App only wires screens and global keys).

Polling follows dolphie: a thread worker fetches one document, posts it back,
and the handler re-arms a timer, so polls never overlap however slow the
source is; while paused nothing is fetched or redrawn.
"""

from __future__ import annotations

import dataclasses
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any, ClassVar

import msgspec
from textual import on, work
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.events import Resize
from textual.message import Message
from textual.screen import Screen
from textual.timer import Timer
from textual.widgets import Footer, Input, Static

from ddpwatch.core.vocabulary import Severity
from ddpwatch.status.schema import AlertEntry, RankEntry, StatusDocument, SummaryReply
from ddpwatch.tui.data.large_job import host_names, is_summary, scope_of, select_summary_groups
from ddpwatch.tui.data.model import (
    WORST,
    AlertIndex,
    HostGroup,
    Row,
    TableQuery,
    index_alerts,
    select_groups,
    select_rows,
    worst_first,
)
from ddpwatch.tui.data.sources import StatusSource
from ddpwatch.tui.data.sparklines import METRICS, History
from ddpwatch.tui.data.story import cleared_alerts, ended_banner, ranks_finished
from ddpwatch.tui.widgets.alerts_panel import AlertList, row_has_stack
from ddpwatch.tui.widgets.columns import GROUP_COLUMNS, RANK_COLUMNS
from ddpwatch.tui.widgets.detail import RankDetail
from ddpwatch.tui.widgets.fmt import TIMES
from ddpwatch.tui.widgets.header import HeaderInfo, StatusHeader, summarize
from ddpwatch.tui.widgets.rank_table import RankTable
from ddpwatch.tui.widgets.stack_panel import StackPanel

MIN_WIDTH, MIN_HEIGHT = 60, 15
"""Below this the dashboard shows "terminal too small" instead of a cramped view."""
WIDE = 120
"""From this width the detail pane sits beside the alerts instead of replacing them."""

_TITLES = {c.key: c.title for c in RANK_COLUMNS} | {
    "local_rank": "local rank",
    "step_time": "step time",
}
_GROUP_TITLES = {c.key: c.title for c in GROUP_COLUMNS}


class StatusFetched(Message):
    """A poll finished: the document, or None when the source could not be reached."""

    def __init__(self, document: StatusDocument | None) -> None:
        super().__init__()
        self.document = document


class DashboardScreen(Screen[None]):
    """Header, rank table, alerts panel, detail pane, filter box and footer."""

    BINDINGS: ClassVar[list[BindingType]] = [
        # q and ? are the App's; repeated here so the footer lists them first
        Binding("q", "app.quit", "Quit", id="quit"),
        Binding("question_mark", "app.help", "Help", key_display="?", id="help"),
        # f: not in the footer; the header names it once the user has moved the cursor
        Binding("f", "follow", "Follow", show=False, id="follow"),
        Binding("slash", "filter", "Filter", key_display="/", id="filter"),
        Binding(
            "less_than_sign", "sort(-1)", "Sort", key_display="<", show=False, id="sort.previous"
        ),
        Binding("greater_than_sign", "sort(1)", "Sort", key_display="<>", id="sort.next"),
        Binding("r", "reverse", "Rev", id="sort.reverse"),
        Binding("a", "flagged", "Flagged", id="flagged"),
        Binding("g", "group", "Hosts", id="group"),
        Binding("p", "pause", "Pause", id="pause"),
        Binding("e", "export", "Export", id="export"),
        Binding("t", "app.timeline", "Timeline", id="timeline"),
        Binding("escape", "clear_filter", "Clear filter", show=False, id="filter.clear"),
    ]

    def __init__(
        self,
        source: StatusSource,
        *,
        interval: float = 0.5,
        history: int = 60,
        bell: bool = True,
    ) -> None:
        super().__init__()
        self.source = source
        self.interval = interval
        self.bell = bell
        self._errors: set[tuple[Any, ...]] | None = None  # error alerts of the last document
        self._warned: set[tuple[Any, ...]] = set()  # its error and warning alerts
        self.following = True
        """The cursor goes to the culprit of each new alert (``follow_new_alerts``) until the
        user moves it; ``f`` turns this back on."""
        self.document: StatusDocument | None = None
        self.connected: bool | None = None
        self.paused = False
        self.query_state = TableQuery()
        self.index = AlertIndex()
        self.history = History(history)
        self.started: float | None = getattr(source, "started", None)
        self.msg_rate: float | None = None
        self.show_detail = False
        self._previous: tuple[float, int] | None = None
        self._timer: Timer | None = None
        self._polling = False
        self._rank_pos: dict[int, int] = {}
        self.last_export: Path | None = None
        self._poll_started = 0.0
        self._summary: dict[str, Any] = {}  # ``header.summarize`` of the document
        self._cursor_placed = False  # on the worst rank, at the first document with ranks
        self.ended_at: float | None = None
        """The server's time when the dashboard first saw the job ended (``story``), else None."""

    # ------------------------------------------------------------------ layout

    def compose(self) -> ComposeResult:
        yield StatusHeader(id="header")
        with Vertical(id="main"):
            yield RankTable(id="ranks")
            with Horizontal(id="bottom"):
                with Vertical(id="left"):
                    yield AlertList(id="alerts")
                    yield StackPanel(id="stack")
                yield RankDetail(id="detail")
        yield Input(
            placeholder="filter: host/state/phase words, or ranks r:0-15 or 3,5-7 (esc clears)",
            id="filter",
        )
        yield Static(id="too-small")
        yield Footer(compact=True)

    @property
    def table(self) -> RankTable:
        return self.query_one(RankTable)

    @property
    def alert_list(self) -> AlertList:
        return self.query_one(AlertList)

    @property
    def detail(self) -> RankDetail:
        return self.query_one(RankDetail)

    def on_mount(self) -> None:
        self.query_one(AlertList).show([], empty=self.no_ranks)
        self.detail.border_title = "detail"
        self.table.focus()
        self._update_header()
        self.poll_now()

    def on_resize(self, event: Resize) -> None:
        width, height = event.size
        small = width < MIN_WIDTH or height < MIN_HEIGHT
        self.set_class(small, "-too-small")
        self.set_class(width < WIDE, "-narrow")
        if small:
            self.query_one("#too-small", Static).update(
                f"terminal too small: {width}{TIMES}{height}\n"
                f"ddpwatch needs at least {MIN_WIDTH}{TIMES}{MIN_HEIGHT}\n\n"
                "enlarge the window, or use: ddpwatch status"
            )

    # ------------------------------------------------------------------ polling

    @work(thread=True, group="poll", exit_on_error=False)
    def poll(self) -> None:
        """Fetch one document off the UI thread (one at a time: the next is armed after)."""
        self._poll_started = time.monotonic()
        try:
            document = self.source.fetch()
        except Exception:
            document = None
        self.post_message(StatusFetched(document))

    def poll_now(self) -> None:
        """Fetch at once (used by unpause and by tests); no-op while a fetch is running."""
        if self._polling:
            return
        if self._timer is not None:
            self._timer.stop()
            self._timer = None
        self._polling = True
        self.poll()

    def _arm(self) -> None:
        """The next poll, ``interval`` after this one began (never before this one ended)."""
        elapsed = time.monotonic() - self._poll_started
        self._timer = self.set_timer(max(0.02, self.interval - elapsed), self._tick)

    def _tick(self) -> None:
        self._timer = None
        if not self.paused:  # paused: no timer; unpausing polls at once
            self.poll_now()

    @on(StatusFetched)
    def _fetched(self, message: StatusFetched) -> None:
        self._polling = False
        if self.paused:
            return
        self.apply_document(message.document)
        if self._timer is None:
            self._arm()

    # ------------------------------------------------------------------ document in

    def apply_document(self, document: StatusDocument | None) -> None:
        """Show a new status document (None: the source is unreachable)."""
        if document is None:
            self.connected = False
            self._update_header()
            return
        self.connected = True
        self.document = document
        now, received = document.server_time, document.stats.received
        if self.started is None:
            self.started = now
        if self._previous is not None and now > self._previous[0]:
            self.msg_rate = max(0.0, (received - self._previous[1]) / (now - self._previous[0]))
        self._previous = (now, received)
        ranks = document.ranks
        self._rank_pos = {}
        self._summary = summarize(document)
        self._note_ending(document)
        alerts = document.alerts
        self.index = index_alerts(alerts)
        news = self._new_alerts(alerts)
        self.history.update(ranks)
        self.refresh_view()
        if not self._cursor_placed and self.table.rows:
            self._cursor_placed = True
            self._cursor_to_worst()
        elif self.following:
            self.follow_new_alerts(news, alerts)

    @property
    def job_ended(self) -> bool:
        """Whether the job is over: the source's job process ended (``run --tui``, ``demo``:
        its ``ended``), else every rank seen has finished (``story.ranks_finished``)."""
        ended = getattr(self.source, "ended", None)
        if ended is not None:
            return bool(ended)
        return self.document is not None and ranks_finished(self.document)

    def _note_ending(self, document: StatusDocument) -> None:
        """Remember when the job was first seen ended (forget it if it runs again)."""
        if not self.job_ended:
            self.ended_at = None
        elif self.ended_at is None:
            self.ended_at = document.server_time

    def _cursor_to_worst(self) -> None:
        """Start the cursor on the worst rank (host, when grouped) whatever the sort, so enter
        opens the rank to look at; only once: later the cursor is the user's."""
        table = self.table
        key: int | str | None
        groups = [row for row in table.rows if isinstance(row, HostGroup)]
        if groups:
            key = min(groups, key=lambda g: (g.worst, g.host or "")).host
        else:
            ranks = [row for row in table.rows if isinstance(row, RankEntry)]
            key = worst_first(ranks, self.index)[0].rank
        table.move_cursor_to_key(key)

    def _new_alerts(self, alerts: list[AlertEntry]) -> list[AlertEntry]:
        """The error and warning alerts (kind and culprits) that the last document did not have
        at their severity or above, in the document's order (errors first); none for the first
        document (its alerts were there before anyone looked).

        Rings the terminal bell once when a new one is an error, so a hang at 3 am is heard;
        warnings stay quiet."""
        errors: set[tuple[Any, ...]] = set()
        warned: set[tuple[Any, ...]] = set()
        news: list[AlertEntry] = []
        first = self._errors is None
        for alert in alerts:
            severity = alert.severity
            if severity not in (Severity.ERROR, Severity.WARNING):
                continue
            key = (alert.kind, tuple(alert.ranks))
            warned.add(key)
            if severity == Severity.ERROR:
                errors.add(key)
                if not first and key not in (self._errors or ()):
                    news.append(alert)
            elif not first and key not in self._warned:
                news.append(alert)
        if self.bell and any(a.severity == Severity.ERROR for a in news):
            self.app.bell()
        self._errors, self._warned = errors, warned
        return news

    def follow_new_alerts(self, news: list[AlertEntry], alerts: list[AlertEntry]) -> None:
        """Put the cursor on the first culprit of the first new error alert; with no error
        alert naming a culprit open, of the first new warning. Not on a host row, and not
        through a filter: a culprit the table does not show is left to the alert's jump."""
        if not news or self.table.grouped:
            return
        errors = [a for a in news if a.severity == Severity.ERROR and a.ranks]
        held = any(a.severity == Severity.ERROR and a.ranks for a in alerts)
        candidates = errors or ([] if held else [a for a in news if a.ranks])
        if candidates:
            self.table.move_cursor_to_key(candidates[0].ranks[0])

    def action_follow(self) -> None:
        """``f``: the cursor follows the culprits again, starting on the worst rank now."""
        self.following = True
        if self.table.rows:
            self._cursor_to_worst()
        self._update_header()
        self.notify(
            "the cursor now goes to the culprit of each new alert (until you move it)",
            title="following culprits",
            timeout=4,
        )

    def refresh_view(self) -> None:
        """Re-select and re-order rows for the current query, then redraw once."""
        document = self.document
        if document is None:
            self._update_header()
            return
        self._update_scope()
        ranks = document.ranks
        query = self.query_state
        rows: list[RankEntry] | list[HostGroup]
        if query.grouped and isinstance(document, SummaryReply):
            rows = select_summary_groups(document, query, self.index)
        elif query.grouped:
            rows = select_groups(ranks, query, self.index)
        else:
            rows = select_rows(ranks, query, self.index)
        sort_key = None if query.sort == WORST else query.sort
        self.table.set_rows(
            rows, self.index, grouped=query.grouped, sort_key=sort_key, sort_reverse=query.reverse
        )
        ended = self.ended_at is not None
        self.alert_list.show(
            document.alerts,
            empty=None if ranks or ended else self.no_ranks,
            past=cleared_alerts(document, everything=ended),
            banner=ended_banner(document) if ended else None,
            has_stack=self.has_stack,
        )
        self._update_header()
        self._update_detail()

    def has_stack(self, rank: int) -> bool | None:
        """Whether ``rank``'s stack or traceback is in the document (what its detail pane
        shows); None where the rank is not in it."""
        row = self.rank_row(rank)
        return None if row is None else row_has_stack(row)

    def _update_scope(self) -> None:
        """On a large job, have the source ask the server for the ranks, host or state the
        filter names (``large_job.scope_of``), and poll at once when that changed."""
        if not hasattr(self.source, "scope") or not is_summary(self.document):
            return
        scope = scope_of(self.query_state.filter, host_names(self.document))
        if scope != self.source.scope:
            self.source.scope = scope
            self.poll_now()

    def _update_header(self) -> None:
        document = self.document
        query = self.query_state
        info = HeaderInfo(
            source=self.source.label,
            connected=self.connected,
            query=query,
            paused=self.paused,
            msg_rate=self.msg_rate,
            shown=len(self.table.rows) if self.is_mounted else 0,
            following=self.following,
            note=getattr(self.source, "note", None),
        )
        titles = _GROUP_TITLES if query.grouped else _TITLES
        info.sort_title = (
            "worst first" if query.sort == WORST else titles.get(query.sort, query.sort)
        )
        if document is not None:
            info.has_document = True
            for key, value in self._summary.items():
                setattr(info, key, value)
            info.alerts = dict(self.index.counts)
            now = document.server_time
            if self.started is not None:
                info.uptime_s = now - self.started
            if self.ended_at is not None:
                info.ended_s = max(0.0, now - self.ended_at)
        self.query_one(StatusHeader).show(info)

    def rank_row(self, rank: int) -> Row | None:
        """The selected rank's entry in the current document."""
        if self.document is None:
            return None
        ranks = self.document.ranks
        if 0 <= rank < len(ranks) and ranks[rank].rank == rank:
            return ranks[rank]
        if not self._rank_pos:
            self._rank_pos = {row.rank: i for i, row in enumerate(ranks)}
        pos = self._rank_pos.get(rank)
        return None if pos is None else ranks[pos]

    def _update_detail(self) -> None:
        table = self.table
        rank = None if table.grouped else table.cursor_key
        row = None if rank is None else self.rank_row(rank)
        if not self.show_detail:
            self.query_one(StackPanel).show(row, self.index)
            return
        series = {m: self.history.series(rank, m) for m in METRICS} if rank is not None else {}
        alerts = [] if self.document is None else self.document.alerts
        self.detail.show(row, series, alerts)

    # ------------------------------------------------------------------ table events

    @on(RankTable.CursorMoved)
    def _cursor_moved(self, event: RankTable.CursorMoved) -> None:
        self._update_detail()

    @on(RankTable.UserMoved)
    def _user_moved(self, event: RankTable.UserMoved) -> None:
        self._hold_cursor()

    def _hold_cursor(self) -> None:
        """The user put the cursor somewhere: new alerts no longer move it (``f`` undoes)."""
        if self.following:
            self.following = False
            self._update_header()

    @on(RankTable.Selected)
    def _row_selected(self, event: RankTable.Selected) -> None:
        if self.table.grouped:
            host = event.key
            self.query_state = TableQuery(
                sort=WORST,
                reverse=False,
                filter=str(host),
                flagged=self.query_state.flagged,
                grouped=False,
            )
            self._show_filter_box(str(host))
            self.refresh_view()
            return
        self.toggle_detail()

    @on(RankTable.HeaderClicked)
    def _header_clicked(self, event: RankTable.HeaderClicked) -> None:
        query = self.query_state
        reverse = not query.reverse if query.sort == event.column else False
        self._set_query(sort=event.column, reverse=reverse)

    @on(AlertList.Jump)
    def _jump(self, event: AlertList.Jump) -> None:
        self._hold_cursor()
        self.select_rank(event.rank)

    def select_rank(self, rank: int) -> bool:
        """Put the table's cursor on ``rank``, clearing a filter or grouping that hides it."""
        table = self.table
        if table.grouped or not any(table.row_key(r) == rank for r in table.rows):
            self.query_state = TableQuery(
                sort=self.query_state.sort, reverse=self.query_state.reverse
            )
            self._show_filter_box("")
            self.refresh_view()
        found = table.move_cursor_to_key(rank)
        table.focus()
        return found

    def toggle_detail(self) -> None:
        self.show_detail = not self.show_detail
        self.set_class(self.show_detail, "-detail")
        self._update_detail()

    # ------------------------------------------------------------------ actions

    def _set_query(self, **changes: Any) -> None:
        self.query_state = dataclasses.replace(self.query_state, **changes)
        self.refresh_view()

    def sort_keys(self) -> list[str]:
        """Worst first, then the columns on screen, left to right."""
        keys = [k for k in self.table.visible_columns if k != "sim"]
        return [WORST, *keys]

    def action_sort(self, step: int) -> None:
        keys = self.sort_keys()
        current = self.query_state.sort
        position = keys.index(current) if current in keys else 0
        self._set_query(sort=keys[(position + step) % len(keys)], reverse=False)

    def action_reverse(self) -> None:
        self._set_query(reverse=not self.query_state.reverse)

    def action_flagged(self) -> None:
        self._set_query(flagged=not self.query_state.flagged)

    def action_group(self) -> None:
        self._set_query(grouped=not self.query_state.grouped, sort=WORST, reverse=False)

    def action_pause(self) -> None:
        self.paused = not self.paused
        self._update_header()
        if not self.paused:
            self.poll_now()

    def action_filter(self) -> None:
        self._show_filter_box(self.query_state.filter, focus=True)

    def _show_filter_box(self, value: str, focus: bool = False) -> None:
        box = self.query_one("#filter", Input)
        if box.value != value:
            with box.prevent(Input.Changed):
                box.value = value
        self.set_class(bool(value) or focus, "-filtering")
        if focus:
            box.focus()
            box.cursor_position = len(box.value)

    def action_clear_filter(self) -> None:
        self._show_filter_box("")
        self.table.focus()
        if self.query_state.filter:
            self._set_query(filter="")

    @on(Input.Changed, "#filter")
    def _filter_changed(self, event: Input.Changed) -> None:
        self._set_query(filter=event.value)

    @on(Input.Submitted, "#filter")
    def _filter_submitted(self, event: Input.Submitted) -> None:
        self.set_class(bool(event.value), "-filtering")
        self.table.focus()

    def action_export(self) -> None:
        """Write the status document to ``ddpwatch-status-<time>.json`` in ``export_dir`` and
        say where: beside the job's log under ``ddpwatch run --tui``, else the working
        directory. On a large job the screen holds a summary: the whole document, every rank,
        is fetched for the file, off the UI thread."""
        if self.document is None:
            self.notify("nothing to export yet: no status document received", severity="warning")
            return
        if is_summary(self.document) and hasattr(self.source, "whole"):
            self.notify("fetching every rank's status to export…", timeout=5)
            self._export_whole(self.source.whole)
            return
        self._exported(*write_export(self.document, self.export_dir), "the status JSON on screen")

    @work(thread=True, group="export", exclusive=True, exit_on_error=False)
    def _export_whole(self, whole: Callable[[], StatusDocument | None]) -> None:
        document = whole()
        if document is None:
            result: tuple[Path | None, str] = (None, "the server sent no whole status document")
        else:
            result = write_export(document, self.export_dir)
        self.app.call_from_thread(self._exported, *result, "every rank's status JSON")

    def _exported(self, path: Path | None, error: str, what: str) -> None:
        if path is None:
            self.notify(f"export failed: {error}", severity="error", markup=False)
            return
        self.notify(f"{what} is in {path}", title="exported", timeout=10, markup=False)
        self.last_export = path

    @property
    def export_dir(self) -> Path:
        """Where ``e`` writes: the source's ``export_dir`` (the run's folder), else the cwd."""
        folder = getattr(self.source, "export_dir", None)
        return Path(folder) if folder else Path.cwd()

    @property
    def no_ranks(self) -> str:
        """The alerts panel's line while no rank has reported (where ranks should report)."""
        return getattr(self.source, "no_ranks", None) or "waiting for ranks"


def write_export(document: StatusDocument, folder: Path) -> tuple[Path | None, str]:
    """Write ``document`` as indented JSON to a new ``ddpwatch-status-<time>[-n].json`` in
    ``folder`` (never over an earlier export): the path, or None and why not."""
    stamp = time.strftime("%Y%m%d-%H%M%S")
    path = folder / f"ddpwatch-status-{stamp}.json"
    n = 1
    while path.exists():
        path = folder / f"ddpwatch-status-{stamp}-{n}.json"
        n += 1
    try:
        path.write_bytes(msgspec.json.format(msgspec.json.encode(document), indent=2) + b"\n")
    except OSError as exc:
        return None, f"could not write {path}: {exc.strerror}"
    return path, ""
