"""The Textual app: wires the dashboard screen, the help screen and the global keys.

``run_dashboard(server)`` is ``ddpwatch serve``'s view (the server runs on a
daemon thread in this process); ``run_client(host, port)`` is ``ddpwatch top``,
a dashboard for a server elsewhere.
"""

from __future__ import annotations

import logging
import sys
import threading
from typing import Any, ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.logging import TextualHandler
from textual.screen import Screen

from ddpwatch.tui.help import HelpScreen
from ddpwatch.tui.output import OutputScreen
from ddpwatch.tui.screen import DashboardScreen
from ddpwatch.tui.sources import LocalSource, RemoteSource, StatusSource


class DashboardApp(App[int]):
    """ddpwatch's dashboard over any ``StatusSource``."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "ddpwatch"
    ENABLE_COMMAND_PALETTE = False

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit", id="quit"),
        Binding("question_mark", "help", "Help", key_display="?", id="help"),
        Binding("o", "output", "Output", id="output"),
    ]

    def __init__(self, source: StatusSource, *, interval: float = 0.5, history: int = 60) -> None:
        super().__init__()
        self.source = source
        self.interval = interval
        self.history_len = history

    def get_default_screen(self) -> Screen[Any]:
        return DashboardScreen(self.source, interval=self.interval, history=self.history_len)

    @property
    def dashboard(self) -> DashboardScreen:
        """The dashboard screen (under the help screen when that is open)."""
        return next(s for s in self.screen_stack if isinstance(s, DashboardScreen))

    def action_help(self) -> None:
        if isinstance(self.screen, HelpScreen):
            self.screen.dismiss(None)
        else:
            self.push_screen(HelpScreen())

    def check_action(self, action: str, parameters: tuple[object, ...]) -> bool | None:
        """``o`` (the job's output) exists only under ``ddpwatch run --tui``."""
        if action == "output":
            return self.output_path is not None
        return True

    @property
    def output_path(self) -> str | None:
        return getattr(self.source, "output_path", None)

    def action_output(self) -> None:
        if isinstance(self.screen, OutputScreen):
            self.screen.dismiss(None)
        elif self.output_path is not None:
            self.push_screen(OutputScreen(self.output_path))

    def on_unmount(self) -> None:
        close = getattr(self.source, "close", None)
        if close is not None:
            close()


class _QuietLogs:
    """While the dashboard owns the terminal, route log records to Textual's log, not stderr."""

    def __enter__(self) -> None:
        root = logging.getLogger()
        self._removed = [h for h in root.handlers if isinstance(h, logging.StreamHandler)]
        for handler in self._removed:
            root.removeHandler(handler)
        self._handler = TextualHandler()
        root.addHandler(self._handler)

    def __exit__(self, *exc: object) -> None:
        root = logging.getLogger()
        root.removeHandler(self._handler)
        for handler in self._removed:
            root.addHandler(handler)


def run_dashboard(server: Any, source: StatusSource | None = None) -> int:
    """Run ``server`` on a daemon thread and the dashboard over it (``source``: a ``LocalSource``
    of it by default); stop the server on exit."""
    thread = threading.Thread(target=server.run, name="ddpwatch-server", daemon=True)
    thread.start()
    try:
        with _QuietLogs():
            DashboardApp(source or LocalSource(server)).run()
    finally:
        server.stop()
        thread.join(timeout=5)
    return 0


def run_client(host: str, port: int, timeout: float = 1.0, interval: float = 0.5) -> int:
    """``ddpwatch top``: the dashboard of a ``ddpwatch serve`` running elsewhere."""
    from ddpwatch.security import CurveKeyError, client_curve_keys

    try:
        client_curve_keys()
    except CurveKeyError as exc:
        print(f"ddpwatch top: {exc}", file=sys.stderr)
        return 1
    with _QuietLogs():
        DashboardApp(RemoteSource(host, port, timeout), interval=interval).run()
    return 0
