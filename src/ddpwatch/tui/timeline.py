"""The timeline (key ``t``): every alert raised, escalated and cleared, with when and for how
long, so a fault that came and went while nobody looked is still there.

It reads the status document's ``history`` (kept by the server, bounded, newest last) and
refreshes from the dashboard's latest document while open.
"""

from __future__ import annotations

from typing import Any, ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import ModalScreen
from textual.widgets import DataTable

from ddpwatch.tui.fmt import rank_ranges

COLUMNS = ("time", "elapsed", "event", "severity", "kind", "ranks", "up", "message")
MESSAGE_WIDTH = 120


def timeline_rows(history: list[dict[str, Any]]) -> list[tuple[str, ...]]:
    """One row per change, newest first: what the table shows (pure, for tests and exports)."""
    rows: list[tuple[str, ...]] = []
    for entry in reversed(history):
        alert = entry.get("alert") or {}
        event = str(entry.get("event", ""))
        if event == "escalated" and entry.get("from"):
            event = f"escalated from {entry['from'].get('kind')}"
        duration = entry.get("duration_s")
        rows.append(
            (
                _clock(str(entry.get("time", ""))),
                f"+{float(entry.get('elapsed_s') or 0.0):.1f} s",
                event,
                str(alert.get("severity", "")),
                str(alert.get("kind", "")),
                rank_ranges(alert.get("ranks") or []) or "-",
                f"{duration:.1f} s" if isinstance(duration, (int, float)) else "",
                str(alert.get("message", ""))[:MESSAGE_WIDTH],
            )
        )
    return rows


def _clock(iso: str) -> str:
    """The time of day of an ISO-8601 stamp: "19:02:05" (the date is in the export)."""
    _, _, time_part = iso.partition("T")
    return time_part[:8] if time_part else iso


class TimelineScreen(ModalScreen[None]):
    """What happened so far, newest first; esc, q or t closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,t", "close", "Close", id="timeline.close"),
    ]

    def __init__(self, document: dict[str, Any] | None, interval: float = 0.5) -> None:
        super().__init__()
        self.document = document
        self.interval = interval
        self._shown: tuple[int, object] | None = None

    def compose(self) -> ComposeResult:
        table: DataTable[str] = DataTable(id="timeline-table", zebra_stripes=True)
        table.border_title = "timeline: every alert raised and cleared"
        table.border_subtitle = "newest first  (esc closes)"
        yield table

    def on_mount(self) -> None:
        table = self.query_one(DataTable)
        table.add_columns(*COLUMNS)
        self.show(self.document)
        self.set_interval(self.interval, self.follow)
        table.focus()

    def follow(self) -> None:
        """Take the dashboard's newest document (it keeps polling under this screen)."""
        document = getattr(self.app, "latest_document", None)
        if document is not None:
            self.show(document)

    def show(self, document: dict[str, Any] | None) -> None:
        history = (document or {}).get("history") or []
        marker = (len(history), history[-1].get("time") if history else None)
        if marker == self._shown:
            return
        self._shown = marker
        table = self.query_one(DataTable)
        table.clear()
        rows = timeline_rows(history)
        if rows:
            table.add_rows(rows)
        else:
            table.add_row("", "", "no alerts yet", "", "", "", "", "")

    def action_close(self) -> None:
        self.dismiss(None)
