"""The help screen (``?``): keys, filter syntax, what the colours and marks mean."""

from __future__ import annotations

from typing import ClassVar

from rich.table import Table
from rich.text import Text
from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.containers import VerticalScroll
from textual.screen import ModalScreen
from textual.widgets import Static

from ddpwatch.core.vocabulary import RankState
from ddpwatch.tui.data.model import state_text

KEYS = (
    (
        "q",
        "quit; under ddpwatch run --tui, while the job runs, asks: stop the job, "
        "detach (it runs on, unwatched) or cancel",
    ),
    ("?", "this help (esc closes it)"),
    (
        "↑ ↓ PgUp PgDn Home End",
        "move the cursor (also k / j); from then on it stays where you put it",
    ),
    (
        "f",
        "follow: the cursor goes to the worst rank now, then to the culprit of each new error "
        "(or warning, while no error names one) until you move it; on at start",
    ),
    ("enter", "detail pane of the cursor rank; on a host row (g): show that host's ranks"),
    ("/", "filter: words match host, state or phase; r:0-15 or 3,5-7 selects ranks"),
    ("esc", "clear the filter"),
    ("< >", "sort by the previous / next column (first: worst first)"),
    ("r", "reverse the order"),
    ("a", "flagged ranks only: named by an alert, or not running"),
    ("g", "group by host: one row per host"),
    ("p", "pause updates (the view freezes; polling stops)"),
    (
        "e",
        "export the status JSON to ddpwatch-status-<time>.json, beside the job's log "
        "under run --tui, else in the working directory",
    ),
    (
        "o",
        "the job's output, followed live (ddpwatch run --tui only; elsewhere each rank's "
        "last lines are in its detail pane)",
    ),
    (
        "t",
        "timeline: every alert raised, escalated and cleared, when and for how long; "
        "↑ ↓ j k PgUp PgDn Home End move in it, the selected change is shown whole below",
    ),
    ("tab", "focus the next panel: table, alerts, the stack under them, detail"),
    ("alerts: enter / click", "select the alert's first culprit rank in the table"),
)

STATES = (
    (RankState.RUNNING, "green", "making progress"),
    (RankState.WAITING, "yellow", "inside a collective, waiting for peers"),
    (RankState.STALLED, "yellow", "no progress for longer than the stall threshold"),
    (RankState.BUSY, "cyan", "no step for the stall threshold, but its stack moves: working"),
    (RankState.SILENT, "red", "no heartbeat: the process is gone or frozen"),
    (RankState.CRASHED, "red", "raised an exception or died on a signal"),
    (RankState.NOT_CONNECTED, "red", "not_connected: never reported"),
    (RankState.STOPPED, "dim italic", "ended by SIGTERM/SIGINT: stopped, often after a failure"),
    (RankState.EXITED, "dim", "finished on its own (a code other than 0 shows as exit N)"),
)
"""The legend: every rank state (as the views write it), its colour and its meaning."""

MARKS = (
    (
        "▶ culprit",
        "named by an open alert as its culprit: ▶ before its state (▶ crashed, ▶ silent), "
        "▶ culprit where it runs while others wait for it",
    ),
    ("waits for 1", "a live rank that an open alert lists as held up by its culprits (rank 1)"),
)
"""The state cell's marks for what the alerts say about a rank (``columns._state``)."""

SPLIT = (
    "▒███░░  31%",
    "step split: where the rank's step goes, ▒ input wait, █ compute, ░ waiting for the other "
    "ranks (DDP's gradient all-reduce, collectives), and the wait's share of the step: the rank "
    "the others wait for has a short wait. Empty where a rank reports no split (a model on a "
    "GPU); the header's 'waiting 31% of step time' is the same for the whole job",
)
"""The step split column's legend (``columns._split``)."""

WORST_FIRST = (
    "culprits of errors, crashed, culprits of warnings, "
    "silent, stalled, absent, busy, waiting, then running, stopped and exited; ties by rank"
)
"""The table's default order: the states in ``vocabulary.RANK_STATES``'s order."""


def help_text() -> Table:
    table = Table.grid(padding=(0, 2))
    table.add_column(style="bold cyan", no_wrap=True)
    table.add_column()
    for key, what in KEYS:
        table.add_row(key, what)
    table.add_row("", "")
    for state, colour, meaning in STATES:
        table.add_row(Text(state_text(state), style=f"bold {colour}"), meaning)
    for mark, meaning in MARKS:
        table.add_row(Text(mark, style="bold"), meaning)
    table.add_row(Text(SPLIT[0], style="bold"), SPLIT[1])
    table.add_row("", "")
    table.add_row(Text("worst first", style="bold"), WORST_FIRST)
    table.add_row(Text("sim", style="italic magenta"), "a simulated rank (ddpwatch demo)")
    return table


class HelpScreen(ModalScreen[None]):
    """Keys and colours; any of esc, q, ? closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,question_mark", "dismiss_help", "Close", id="help.close"),
    ]

    def compose(self) -> ComposeResult:
        with VerticalScroll(id="help-panel") as panel:
            panel.border_title = "ddpwatch keys"
            panel.border_subtitle = "esc closes"
            yield Static(help_text(), id="help-text")

    def action_dismiss_help(self) -> None:
        self.dismiss(None)
