"""The Textual app: wires the dashboard screen, the help screen and the global keys.

``run_dashboard(server)`` is ``ddpwatch serve``'s view (the server runs on a
daemon thread in this process); ``show_dashboard(source)`` the same over a server the caller
runs (``ddpwatch run --tui``); ``run_client(host, port)`` is ``ddpwatch top``,
a dashboard for a server elsewhere.
"""

from __future__ import annotations

import logging
import sys
from typing import Any, ClassVar

from textual.app import App
from textual.binding import Binding, BindingType
from textual.logging import TextualHandler
from textual.screen import Screen

from ddpwatch.status.provider import StatusProvider, in_background
from ddpwatch.status.schema import StatusDocument
from ddpwatch.tui.data.sources import RemoteSource, StatusSource, local_source
from ddpwatch.tui.screens.dashboard import DashboardScreen
from ddpwatch.tui.screens.help import HelpScreen
from ddpwatch.tui.screens.output import OutputScreen
from ddpwatch.tui.screens.quit import QuitChoice, QuitScreen
from ddpwatch.tui.screens.timeline import TimelineScreen


class DashboardApp(App[int]):
    """ddpwatch's dashboard over any ``StatusSource``."""

    CSS_PATH = "dashboard.tcss"
    TITLE = "ddpwatch"
    ENABLE_COMMAND_PALETTE = False

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("q", "quit", "Quit", id="quit"),
        Binding("question_mark", "help", "Help", key_display="?", id="help"),
        Binding("o", "output", "Output", id="output"),
        # o outside run --tui: says where output is instead of doing nothing (not in the footer)
        Binding("o", "no_output", "Output", show=False, id="output.none"),
        Binding("t", "timeline", "Timeline", id="timeline"),
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
        self.history_len = history
        self.ring_bell = bell

    def get_default_screen(self) -> Screen[Any]:
        return DashboardScreen(
            self.source, interval=self.interval, history=self.history_len, bell=self.ring_bell
        )

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
        """``o`` (the job's output) exists only under ``ddpwatch run --tui``; elsewhere ``o``
        says so (``no_output``)."""
        if action == "output":
            return self.output_path is not None
        if action == "no_output":
            return self.output_path is None
        return True

    @property
    def running_job(self) -> Any:
        """The job of ``ddpwatch run --tui`` while it runs (a ``Popen``), else None."""
        job = getattr(self.source, "job", None)
        return job if job is not None and job.poll() is None else None

    async def action_quit(self) -> None:
        """Quit; under ``ddpwatch run --tui`` with the job still running, ask first."""
        job = self.running_job
        if job is None:
            self.exit()
        elif not isinstance(self.screen, QuitScreen):
            self.push_screen(QuitScreen(job.pid, self.output_path), self._quit_chosen)

    def _quit_chosen(self, choice: QuitChoice | None) -> None:
        if choice == "detach":
            getattr(self.source, "detach")()  # noqa: B009 (only a JobSource has a job)
        if choice is not None:
            self.exit()  # "stop": ddpwatch run stops the job once the dashboard is gone

    def action_no_output(self) -> None:
        self.notify(
            "the job's output is only available under ddpwatch run --tui; "
            "each rank's last output lines are in its detail pane (enter on its row)",
            title="no job output here",
            severity="warning",
            markup=False,
        )

    @property
    def output_path(self) -> str | None:
        return getattr(self.source, "output_path", None)

    @property
    def latest_document(self) -> StatusDocument | None:
        """The dashboard's newest status document (screens over it read this)."""
        return self.dashboard.document

    def action_timeline(self) -> None:
        if isinstance(self.screen, TimelineScreen):
            self.screen.dismiss(None)
        else:
            self.push_screen(TimelineScreen(self.latest_document))

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


def run_dashboard(
    server: StatusProvider, source: StatusSource | None = None, *, bell: bool = True
) -> int:
    """Run ``server`` on a daemon thread and the dashboard over it (``source``: a ``LocalSource``
    of it by default); stop the server on exit. ``bell``: ring on a new error (``--no-bell``)."""
    with in_background(server):
        show_dashboard(source or local_source(server), bell=bell)
    return 0


def show_dashboard(source: StatusSource, *, bell: bool = True) -> None:
    """The dashboard over ``source`` until the user quits, its server run by the caller
    (``ddpwatch run --tui`` keeps it running while it stops the job, to hear how it ended)."""
    with _QuietLogs():
        DashboardApp(source, bell=bell).run()


def run_client(
    host: str, port: int, timeout: float = 1.0, interval: float = 0.5, *, bell: bool = True
) -> int:
    """``ddpwatch top``: the dashboard of a ``ddpwatch serve`` running elsewhere."""
    from ddpwatch.core.security import CurveKeyError, client_curve_keys

    try:
        client_curve_keys()
    except CurveKeyError as exc:
        print(f"ddpwatch top: {exc}", file=sys.stderr)
        return 1
    with _QuietLogs():
        DashboardApp(RemoteSource(host, port, timeout), interval=interval, bell=bell).run()
    return 0
