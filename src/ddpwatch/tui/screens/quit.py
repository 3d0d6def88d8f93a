"""The quit question under ``ddpwatch run --tui``: stop the job, detach from it, or stay.

Quitting used to SIGTERM the job without a word. The job may be hours into
training, so ``q`` asks first while it still runs; everywhere else (serve, top,
replay, demo) there is nothing of the user's to stop and ``q`` quits at once.
"""

from __future__ import annotations

from typing import ClassVar, Literal

from textual import on
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import Horizontal, Vertical
from textual.screen import ModalScreen
from textual.widgets import Button, Static

QuitChoice = Literal["stop", "detach"]
"""What the user chose; the screen dismisses with None for cancel."""


def quit_question(pid: int, log_path: str | None) -> str:
    """What each choice does, in words (the pid and log file are what a detached user needs)."""
    where = f" into {log_path}" if log_path else ""
    return (
        f"The job is still running (pid {pid}).\n\n"
        "Stop the job: SIGTERM to it and every process under it, as Ctrl-C would "
        "(SIGKILL to what is left after 5 s).\n\n"
        f"Detach: leave the dashboard; the job keeps running, its output going on{where}. "
        "Monitoring ends here: the server ran in this process, so nothing watches the job "
        "any more and ddpwatch top cannot reattach."
    )


def detached_message(pid: int, log_path: str) -> str:
    """What ``ddpwatch run`` prints after "Detach": where the job is, and that nobody watches."""
    return (
        f"ddpwatch run: detached: the job keeps running as pid {pid}; its output goes on into "
        f"{log_path} (tail -f {log_path} follows it)\n"
        "ddpwatch run: monitoring has ended: the server ran in this process, so no dashboard "
        f"(ddpwatch top included) can watch this job again; kill {pid} stops it"
    )


class QuitScreen(ModalScreen[QuitChoice | None]):
    """Stop the job (s), detach (d) or cancel (esc); cancel has the focus, so enter is safe."""

    DEFAULT_CSS = """
    QuitScreen {
        align: center middle;
    }
    #quit-panel {
        width: 72;
        max-width: 95%;
        height: auto;
        border: round $warning;
        border-title-style: bold;
        padding: 0 1;
        background: $surface;
    }
    #quit-buttons {
        height: auto;
        margin-top: 1;
        align-horizontal: center;
    }
    #quit-buttons Button {
        margin: 0 1;
    }
    """

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("s", "choose('stop')", "Stop the job", id="quit.stop"),
        Binding("d", "choose('detach')", "Detach", id="quit.detach"),
        Binding("escape,c", "choose('cancel')", "Cancel", id="quit.cancel"),
    ]

    def __init__(self, pid: int, log_path: str | None) -> None:
        super().__init__()
        self.pid = pid
        self.log_path = log_path

    def compose(self) -> ComposeResult:
        with Vertical(id="quit-panel") as panel:
            panel.border_title = "quit: the job is still running"
            yield Static(quit_question(self.pid, self.log_path), id="quit-text", markup=False)
            with Horizontal(id="quit-buttons"):
                yield Button("Stop the job (s)", variant="error", id="stop")
                yield Button("Detach (d)", variant="warning", id="detach")
                yield Button("Cancel (esc)", variant="default", id="cancel")

    def on_mount(self) -> None:
        self.query_one("#cancel", Button).focus()

    @on(Button.Pressed)
    def _pressed(self, event: Button.Pressed) -> None:
        self.action_choose(event.button.id or "cancel")

    def action_choose(self, choice: str) -> None:
        if choice == "stop":
            self.dismiss("stop")
        elif choice == "detach":
            self.dismiss("detach")
        else:
            self.dismiss(None)
