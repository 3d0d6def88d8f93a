"""The timeline (key ``t``): every alert raised, escalated and cleared, with when and for how
long, so a fault that came and went while nobody looked is still there.

It reads the status document's ``history`` (kept by the server, bounded, newest last) and
refreshes from the dashboard's latest document while open. The list scrolls with the usual
keys (↑ ↓ j k PgUp PgDn Home End); its message column is cut to the width, and the panel
under it shows the selected change whole: the message wrapped, and the alert's hint.
"""

from __future__ import annotations

from typing import Any, ClassVar

from rich.cells import cell_len, set_cell_size
from rich.text import Text
from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Vertical
from textual.coordinate import Coordinate
from textual.events import Resize
from textual.screen import ModalScreen
from textual.widgets import DataTable, Static
from textual.widgets.data_table import CellDoesNotExist

from ddpwatch.core.ranges import rank_ranges
from ddpwatch.status.fmt import elapsed, event_label, seconds
from ddpwatch.status.schema import UNSET, HistoryEntry, StatusDocument
from ddpwatch.tui.widgets.alerts_panel import HasStack, append_who, dashboard_hint, stacks_in
from ddpwatch.tui.widgets.header import SEVERITY_STYLE

COLUMNS = ("time", "elapsed", "event", "severity", "kind", "ranks", "up", "message")
MESSAGE = len(COLUMNS) - 1
"""The message's place in a row: the last column, cut to the room the others leave."""
MESSAGE_MIN = 20
NO_ALERTS = "no alerts yet"


def timeline_rows(history: list[HistoryEntry]) -> list[tuple[str, ...]]:
    """One row per change, newest first: what the table shows, the message whole (pure, for
    tests and exports)."""
    rows: list[tuple[str, ...]] = []
    for entry in reversed(history):
        alert = entry.alert
        duration = entry.duration_s
        rows.append(
            (
                _clock(entry.time),
                elapsed(entry.elapsed_s),
                event_label(entry),
                alert.severity,
                alert.kind,
                rank_ranges(alert.ranks) or "-",
                seconds(duration) if duration is not UNSET else "",
                alert.message,
            )
        )
    return rows


def _clock(iso: str) -> str:
    """The time of day of an ISO-8601 stamp: "19:02:05" (the date is in the export)."""
    _, _, time_part = iso.partition("T")
    return time_part[:8] if time_part else iso


def fit(text: str, width: int) -> str:
    """``text`` in at most ``width`` cells, ending in "…" when cut."""
    if cell_len(text) <= width:
        return text
    return set_cell_size(text, max(0, width - 1)) + "…"


def entry_text(entry: HistoryEntry, has_stack: HasStack | None = None) -> Text:
    """One change whole, for the panel under the list: what, when, the message and the hint
    (``has_stack``: whether a rank's stack is there to see, ``dashboard_hint``)."""
    alert = entry.alert
    severity = alert.severity
    head = Text.assemble(
        (alert.kind, SEVERITY_STYLE.get(severity, "bold")),
        (f" ({severity}) ", "dim"),
        (event_label(entry), "bold"),
    )
    append_who(head, alert)
    head.append(f"  at {elapsed(entry.elapsed_s)}", style="dim")
    head.append(f" ({_clock(entry.time)})", style="dim")
    if entry.duration_s is not UNSET:
        head.append(f"  up {seconds(entry.duration_s)}", style="green")
    text = Text("\n").join([head, Text(alert.message)])
    if alert.hint:
        text.append("\n")
        hint = dashboard_hint(alert.hint, alert.ranks, has_stack)
        text.append_text(Text.assemble(("→ ", "green"), (hint, "italic dim")))
    return text


def _keys(history: list[HistoryEntry]) -> list[str]:
    """A row key per entry, newest first, that stays the entry's while older ones are dropped."""
    keys: list[str] = []
    seen: dict[str, int] = {}
    for entry in reversed(history):
        alert = entry.alert
        base = f"{entry.time}|{entry.event}|{alert.kind}|{alert.ranks}"
        seen[base] = seen.get(base, 0) + 1
        keys.append(f"{base}|{seen[base]}")
    return keys


class TimelineTable(DataTable[str]):
    """The changes, newest first, a row cursor; Home/End go to the first/last row (DataTable's
    own scroll sideways), j/k as down/up."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("j", "cursor_down", "Down", show=False, id="timeline.down"),
        Binding("k", "cursor_up", "Up", show=False, id="timeline.up"),
        Binding("home", "first", "First", show=False, id="timeline.first"),
        Binding("end", "last", "Last", show=False, id="timeline.last"),
    ]

    def action_first(self) -> None:
        if self.row_count:
            self.move_cursor(row=0)

    def action_last(self) -> None:
        if self.row_count:
            self.move_cursor(row=self.row_count - 1)


class TimelineScreen(ModalScreen[None]):
    """What happened so far, newest first; esc, q or t closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,t", "close", "Close", id="timeline.close"),
    ]

    def __init__(self, document: StatusDocument | None, interval: float = 0.5) -> None:
        super().__init__()
        self.document = document
        self.interval = interval
        self._shown: tuple[Any, ...] | None = None
        self._panel_text: Text | None = None
        self._entries: dict[str, HistoryEntry] = {}  # row key -> its history entry

    def compose(self) -> ComposeResult:
        with Vertical(id="timeline") as panel:
            panel.border_title = "timeline: every alert raised and cleared"
            panel.border_subtitle = "newest first  ↑↓ j k PgUp PgDn Home End  (esc closes)"
            yield TimelineTable(id="timeline-table", zebra_stripes=True, cursor_type="row")
            yield Static(id="timeline-message")

    @property
    def table(self) -> TimelineTable:
        return self.query_one(TimelineTable)

    def on_mount(self) -> None:
        table = self.table
        for name in COLUMNS[:MESSAGE]:
            table.add_column(name, key=name)
        table.add_column(COLUMNS[MESSAGE], key=COLUMNS[MESSAGE], width=MESSAGE_MIN)
        self.show(self.document)
        self.set_interval(self.interval, self.follow)
        table.focus()

    def on_resize(self, event: Resize) -> None:
        self.call_after_refresh(self.show, self.document, force=True)

    def follow(self) -> None:
        """Take the dashboard's newest document (it keeps polling under this screen)."""
        document = getattr(self.app, "latest_document", None)
        if document is not None:
            self.show(document)

    def show(self, document: StatusDocument | None, *, force: bool = False) -> None:
        """List the document's history; the cursor stays on its change (on the newest when
        it was there), and the message column takes the width the others leave."""
        self.document = document
        history = [] if document is None else document.history
        table = self.table
        rows = timeline_rows(history)
        width = self._message_width(rows)
        marker = (len(history), history[-1].time if history else None, width)
        if marker == self._shown and not force:
            if table.row_count:  # a rank's stack may have come: the hint says so
                self._show_entry(table.cursor_row)
            return
        self._shown = marker
        keys = _keys(history)
        selected = None
        if table.row_count and table.cursor_row > 0:
            selected = self._key_at(table.cursor_row)
        table.clear()
        table.columns[COLUMNS[MESSAGE]].width = width  # type: ignore[index]
        self._entries = dict(zip(keys, reversed(history), strict=True))
        for key, cells in zip(keys, rows, strict=True):
            table.add_row(*cells[:MESSAGE], fit(cells[MESSAGE], width), key=key)
        if not rows:
            table.add_row("", "", NO_ALERTS, "", "", "", "", "")
        row = table.get_row_index(selected) if selected in self._entries else 0
        table.move_cursor(row=row)
        self._show_entry(row)

    def _message_width(self, rows: list[tuple[str, ...]]) -> int:
        """The room the other columns leave the message (each column has a cell of padding
        on either side)."""
        table = self.table
        pad = 2 * table.cell_padding
        others = sum(
            max([cell_len(title), *(cell_len(row[i]) for row in rows)]) + pad
            for i, title in enumerate(COLUMNS[:MESSAGE])
        )
        room = table.scrollable_content_region.width or self.app.size.width
        return max(MESSAGE_MIN, room - others - pad)

    def _key_at(self, row: int) -> str | None:
        """The row key of row ``row`` (None: no such row, or the "no alerts yet" row)."""
        try:
            return self.table.coordinate_to_cell_key(Coordinate(row, 0)).row_key.value
        except CellDoesNotExist:
            return None

    def _show_entry(self, row: int) -> None:
        entry = self._entries.get(self._key_at(row) or "")
        panel = self.query_one("#timeline-message", Static)
        ranks = self.document.ranks if self.document is not None else []
        text = entry_text(entry, stacks_in(ranks)) if entry is not None else Text()
        if text != self._panel_text:  # followed every poll: redrawn only when it changed
            self._panel_text = text
            panel.update(text)
        panel.display = entry is not None

    @on(DataTable.RowHighlighted, "#timeline-table")
    def _highlighted(self, event: DataTable.RowHighlighted) -> None:
        self._show_entry(event.cursor_row)

    def action_close(self) -> None:
        self.dismiss(None)
