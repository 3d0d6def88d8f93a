"""The stack panel: the free space under the alerts shows the cursor rank's stack or traceback.

The cursor goes to the culprit of each new alert (``DashboardScreen.following``), so the panel
usually shows what the culprit is doing, without a key; ``enter`` opens the whole detail pane
(which shows the same stack, so the panel steps aside while it is open).
"""

from __future__ import annotations

from typing import Any

from rich.text import Text
from textual.app import ComposeResult
from textual.containers import VerticalScroll
from textual.widgets import Static

from ddpwatch.status.schema import RankEntry
from ddpwatch.tui.data.model import AlertIndex
from ddpwatch.tui.widgets.detail import stack_text

NO_RANK = "no rank under the cursor: select a rank to see its stack here"


def stack_title(row: RankEntry, index: AlertIndex) -> str:
    """``traceback of rank 3 (culprit)``, ``stack of rank 0 (waits for 1)``, ``stack of rank 2``."""
    rank = row.rank
    what = "traceback" if row.error is not None else "stack"
    title = f"{what} of rank {rank}"
    if rank in index.culprit:
        title += " (culprit)"
    elif rank in index.waits_for:
        title += f" (waits for {index.waits_for[rank]})"
    return title


class StackPanel(VerticalScroll, can_focus=True):
    """The cursor rank's stack (``detail.stack_text``), redrawn only when it changed."""

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self._shown: tuple[Any, ...] | None = None

    def compose(self) -> ComposeResult:
        yield Static(id="stack-text")

    def show(self, row: RankEntry | None, index: AlertIndex) -> None:
        """The stack of ``row`` (None: no rank selected, as on a host row)."""
        if row is None:
            shown: tuple[Any, ...] = (None,)
            title = "stack"
        else:
            title = stack_title(row, index)
            error = row.error
            traceback = None if error is None else error.traceback
            shown = (row.rank, title, row.stack, traceback, error is not None)
        if shown == self._shown:
            return
        body = Text(NO_RANK, style="dim italic") if row is None else stack_text(row)
        if self._shown is None or shown[:1] != self._shown[:1]:
            self.scroll_home(animate=False)
        self._shown = shown
        self.border_title = title if row is None else f"{title} · enter: detail"
        self.query_one("#stack-text", Static).update(body)
