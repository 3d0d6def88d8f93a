"""The alerts panel: one option per alert, severity-coloured message and hint.

Selecting an alert (enter or click) posts ``AlertList.Jump`` with its first
culprit rank (or first waiting rank), which the screen selects in the table.
"""

from __future__ import annotations

import re
from collections.abc import Sequence
from typing import Any

from rich.console import Group
from rich.padding import Padding
from rich.text import Text
from textual import on
from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from ddpwatch.server.rules.text import STACKS_IN
from ddpwatch.tui.fmt import rank_ranges
from ddpwatch.tui.header import SEVERITY_GLYPH, SEVERITY_STYLE
from ddpwatch.vocabulary import Severity

_RANK_NAMED = re.compile(r"\brank (\d+)")
_SHOWS_IT = " shows it"


def dashboard_hint(hint: str, culprits: Sequence[int] = ()) -> str:
    """``hint`` as the dashboard writes it: where the server sends people to a shell for a
    rank's stack or traceback (``rules.text.STACKS_IN``, "ddpwatch status --json"), the key
    that shows it here, for the rank the hint names just before (else the first culprit).

    "look at rank 3's stack (ddpwatch status --json) or …" becomes "look at rank 3's stack
    (the detail pane: press enter on rank 3) or …"; "(ddpwatch status --json shows it)"
    becomes "(press enter on rank 3: the detail pane shows it)"."""
    if STACKS_IN not in hint:
        return hint
    first, *rest = hint.split(STACKS_IN)
    text = first
    for after in rest:
        named = _RANK_NAMED.findall(text)
        rank = int(named[-1]) if named else (culprits[0] if culprits else None)
        key = "press enter on its row" if rank is None else f"press enter on rank {rank}"
        if after.startswith(_SHOWS_IT):
            text += f"{key}: the detail pane shows it{after[len(_SHOWS_IT) :]}"
        else:
            text += f"the detail pane: {key}{after}"
    return text


def alert_prompt(alert: dict[str, Any]) -> Group:
    severity = alert.get("severity", Severity.INFO)
    style = SEVERITY_STYLE.get(severity, "bold")
    head = Text.assemble(
        (f"{SEVERITY_GLYPH.get(severity, '●')} {alert.get('kind', '?')}", style),
    )
    ranks = alert.get("ranks") or []
    if ranks:
        head.append(f"  rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}", style="bold")
    waiting = alert.get("waiting") or []
    if waiting:
        head.append(f"  waiting {rank_ranges(waiting, limit=4)}", style="dim")
    body = Text(alert.get("message") or "")
    hint = alert.get("hint")
    if hint:
        body.append("\n")
        hint = dashboard_hint(hint, alert.get("ranks") or ())
        body.append_text(Text.assemble(("→ ", "green"), (hint, "italic dim")))
    return Group(head, Padding(body, (0, 0, 0, 2)))


def alert_signature(alert: dict[str, Any]) -> tuple[Any, ...]:
    return (
        alert.get("kind"),
        alert.get("severity"),
        tuple(alert.get("ranks") or ()),
        tuple(alert.get("waiting") or ()),
        alert.get("message"),
        alert.get("hint"),
    )


class AlertList(OptionList):
    """The current alerts, worst first (the order diagnosis gives them)."""

    class Jump(Message):
        """Select ``rank`` in the rank table."""

        def __init__(self, rank: int, alert: dict[str, Any]) -> None:
            super().__init__()
            self.rank = rank
            self.alert = alert

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.alerts: list[dict[str, Any]] = []
        self._signature: tuple[Any, ...] | None = None

    def show(self, alerts: list[dict[str, Any]], empty: str | None = None) -> None:
        """Replace the options only when the alerts changed; keep the highlight.

        ``empty``: the line to show instead of "every rank looks healthy" when there is no
        rank to be healthy (such as where ranks should report)."""
        signature = (*(alert_signature(a) for a in alerts), empty)
        if signature == self._signature:
            return
        keep = self.highlighted
        self._signature = signature
        self.alerts = list(alerts)
        self.clear_options()
        if alerts:
            self.add_options(Option(alert_prompt(a), id=f"alert-{i}") for i, a in enumerate(alerts))
            if keep is not None:
                self.highlighted = min(keep, len(alerts) - 1)
        elif empty is not None:
            self.add_option(Option(Text(empty, style="yellow"), disabled=True))
        else:
            self.add_option(
                Option(Text("✔ no alerts: every rank looks healthy", style="green"), disabled=True)
            )
        counts = len(alerts)
        self.border_title = f"alerts {counts}" if counts else "alerts"

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        index = event.option_index
        if not 0 <= index < len(self.alerts):
            return
        alert = self.alerts[index]
        targets = list(alert.get("ranks") or []) or list(alert.get("waiting") or [])
        if targets:
            self.post_message(self.Jump(targets[0], alert))
