"""Driving the dashboard in tests: an app over the fixed documents of ``tui_fixtures``, polled
only when a test says so, and what its table and header show."""

from __future__ import annotations

from typing import Any

from textual.pilot import Pilot
from tui_fixtures import FixtureSource

from ddpwatch.status.schema import RankEntry
from ddpwatch.tui.app import DashboardApp
from ddpwatch.tui.data.sources import StatusSource
from ddpwatch.tui.screens.dashboard import DashboardScreen
from ddpwatch.tui.widgets.header import StatusHeader, header_lines
from ddpwatch.tui.widgets.rank_table import RankTable

SLOW = 3600.0  # poll interval for tests: only the first fetch happens by itself


def make_app(source: StatusSource | None = None, interval: float = SLOW) -> DashboardApp:
    return DashboardApp(source or FixtureSource(), interval=interval)


async def settle(pilot: Pilot[Any]) -> None:
    """Let the poll worker finish and its document be applied and drawn."""
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.pause()


async def poll(pilot: Pilot[Any]) -> None:
    """One more fetch, applied."""
    dashboard(pilot).poll_now()
    await settle(pilot)


def dashboard(pilot: Pilot[Any]) -> DashboardScreen:
    app = pilot.app
    assert isinstance(app, DashboardApp)
    return app.dashboard


def table(pilot: Pilot[Any]) -> RankTable:
    return dashboard(pilot).query_one(RankTable)


def shown_ranks(pilot: Pilot[Any]) -> list[int]:
    return [row.rank for row in table(pilot).rows if isinstance(row, RankEntry)]


def visible_lines(pilot: Pilot[Any]) -> list[str]:
    """The table's lines as drawn now (header line first)."""
    widget = table(pilot)
    return [widget.render_line(y).text for y in range(widget.size.height)]


def visible_ranks(pilot: Pilot[Any]) -> list[int]:
    """Ranks of the table rows on screen, top to bottom."""
    ranks = []
    for line in visible_lines(pilot)[1:]:
        words = line[1:].split()
        if words and words[0].isdigit():
            ranks.append(int(words[0]))
    return ranks


def header_text(pilot: Pilot[Any]) -> str:
    header = dashboard(pilot).query_one(StatusHeader)
    return "\n".join(line.plain for line in header_lines(header.info, header.content_size.width))


async def type_text(pilot: Pilot[Any], text: str) -> None:
    await pilot.press(*text)
    await pilot.pause()
