"""The alerts panel: one option per alert, severity-coloured message and hint.

Selecting an alert (enter or click) posts ``AlertList.Jump`` with its first
culprit rank (or first waiting rank), which the screen selects in the table.
"""

from __future__ import annotations

import re
from collections.abc import Callable, Sequence
from typing import Any

from rich.console import Group
from rich.padding import Padding
from rich.text import Text
from textual import on
from textual.message import Message
from textual.widgets import OptionList
from textual.widgets.option_list import Option

from ddpwatch.core.ranges import rank_ranges
from ddpwatch.status.fmt import STACKS_IN_ANY_PORT, elapsed, seconds
from ddpwatch.status.schema import UNSET, AlertEntry, HistoryEntry, RankEntry
from ddpwatch.tui.widgets.header import SEVERITY_GLYPH, SEVERITY_STYLE

_RANK_NAMED = re.compile(r"\brank (\d+)")
_SHOWS_IT = " shows it"
_ITS_STACK_IN = "its stack in "


HasStack = Callable[[int], "bool | None"]
"""Whether a rank's stack or traceback is in the document: None where the rank is not in it
(a large job's summary)."""


def stacks_in(ranks: Sequence[RankEntry]) -> HasStack:
    """``HasStack`` over a document's ranks (found at their own index when the list is whole,
    else searched)."""

    def has_stack(rank: int) -> bool | None:
        if 0 <= rank < len(ranks) and ranks[rank].rank == rank:
            row: RankEntry | None = ranks[rank]
        else:
            row = next((r for r in ranks if r.rank == rank), None)
        return None if row is None else row_has_stack(row)

    return has_stack


def row_has_stack(row: RankEntry) -> bool:
    """Whether the detail pane has a stack or traceback to show for this rank."""
    return bool(row.stack) or row.error is not None


def dashboard_hint(
    hint: str, culprits: Sequence[int] = (), has_stack: HasStack | None = None
) -> str:
    """``hint`` as the dashboard writes it: where the server sends people to a shell for a
    rank's stack or traceback (``diagnosis.text.STACKS_IN``, "ddpwatch status --json", with
    ``--port N`` where the server is not on the default one), the key
    that shows it here, for the rank the hint names just before (else the first culprit).

    "look at rank 3's stack (ddpwatch status --json) or …" becomes "look at rank 3's stack
    (the detail pane: press enter on rank 3) or …"; "(ddpwatch status --json shows it)"
    becomes "(press enter on rank 3: the detail pane shows it)". Where ``has_stack`` says the
    rank has sent neither, the hint says so instead of sending people to an empty pane:
    "look at rank 3's stack (no stack or traceback from rank 3 yet) or …"."""
    first, *rest = STACKS_IN_ANY_PORT.split(hint)
    text = first
    for after in rest:
        named = _RANK_NAMED.findall(text)
        rank = int(named[-1]) if named else (culprits[0] if culprits else None)
        if rank is not None and has_stack is not None and has_stack(rank) is False:
            text = text.removesuffix(_ITS_STACK_IN) + f"no stack or traceback from rank {rank} yet"
            text += after.removeprefix(_SHOWS_IT)
            continue
        key = "press enter on its row" if rank is None else f"press enter on rank {rank}"
        if after.startswith(_SHOWS_IT):
            text += f"{key}: the detail pane shows it{after[len(_SHOWS_IT) :]}"
        else:
            text += f"the detail pane: {key}{after}"
    return text


def append_who(head: Text, alert: AlertEntry, waiting_limit: int = 8) -> None:
    """Add an alert's culprits ("  ranks 1-3", bold) and the ranks waiting for them (at most
    ``waiting_limit`` runs of them) to ``head``."""
    ranks = alert.ranks
    if ranks:
        head.append(f"  rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}", style="bold")
    waiting = alert.waiting
    if waiting:
        head.append(f"  waiting {rank_ranges(waiting, limit=waiting_limit)}", style="dim")


def alert_prompt(alert: AlertEntry, hint: str | None = None) -> Group:
    """An alert's option; ``hint``: its hint as the dashboard writes it (``dashboard_hint``)."""
    severity = alert.severity
    style = SEVERITY_STYLE.get(severity, "bold")
    head = Text.assemble((f"{SEVERITY_GLYPH.get(severity, '●')} {alert.kind}", style))
    append_who(head, alert, waiting_limit=4)
    body = Text(alert.message)
    if alert.hint:
        body.append("\n")
        shown = hint if hint is not None else dashboard_hint(alert.hint, alert.ranks)
        body.append_text(Text.assemble(("→ ", "green"), (shown, "italic dim")))
    return Group(head, Padding(body, (0, 0, 0, 2)))


def cleared_prompt(entry: HistoryEntry) -> Group:
    """An alert that came and went (a ``cleared`` history entry): dimmed, with how long it was
    up and when it cleared, in the job's seconds."""
    alert = entry.alert
    head = Text.assemble(("✔ ", "green"), (alert.kind, "bold dim"))
    ranks = alert.ranks
    if ranks:
        head.append(f"  rank{'s' if len(ranks) > 1 else ''} {rank_ranges(ranks)}", style="dim")
    up = entry.duration_s
    when = elapsed(entry.elapsed_s)
    cleared = f"cleared after {seconds(up)}, at {when}" if up is not UNSET else when
    head.append(f"  {cleared}", style="green")
    return Group(head, Padding(Text(alert.message, style="dim"), (0, 0, 0, 2)))


def alert_signature(alert: AlertEntry) -> tuple[Any, ...]:
    return (
        alert.kind,
        alert.severity,
        tuple(alert.ranks),
        tuple(alert.waiting),
        alert.message,
        alert.hint,
    )


HEALTHY = "✔ no alerts: every rank looks healthy"


class AlertList(OptionList):
    """The current alerts, worst first (the order diagnosis gives them); below them the alerts
    that cleared (recently, or all of them once the job ended, under a banner that says so)."""

    class Jump(Message):
        """Select ``rank`` in the rank table."""

        def __init__(self, rank: int, alert: AlertEntry) -> None:
            super().__init__()
            self.rank = rank
            self.alert = alert

    def __init__(self, *, id: str | None = None) -> None:
        super().__init__(id=id)
        self.alerts: list[AlertEntry] = []
        """The open alerts shown."""
        self.past: list[HistoryEntry] = []
        """The ``cleared`` history entries shown below them."""
        self._targets: list[AlertEntry | None] = []  # the alert of each option, if any
        self._signature: tuple[Any, ...] | None = None

    def show(
        self,
        alerts: list[AlertEntry],
        empty: str | None = None,
        *,
        past: list[HistoryEntry] | None = None,
        banner: str | None = None,
        has_stack: HasStack | None = None,
    ) -> None:
        """Replace the options only when what they show changed; keep the highlight.

        ``empty``: the line to show instead of "every rank looks healthy" when there is no
        rank to be healthy (such as where ranks should report). ``past``: ``cleared`` history
        entries to list after the open alerts. ``banner``: a first line (the job ended).
        ``has_stack``: whether a rank's stack is there to see (``dashboard_hint``)."""
        past = past or []
        hints = [dashboard_hint(a.hint, a.ranks, has_stack) if a.hint else "" for a in alerts]
        signature = (
            *(alert_signature(a) for a in alerts),
            *hints,
            empty,
            banner,
            *((e.elapsed_s, e.duration_s, alert_signature(e.alert)) for e in past),
        )
        if signature == self._signature:
            return
        keep = self.highlighted
        self._signature = signature
        self.alerts, self.past = list(alerts), list(past)
        self.clear_options()
        options: list[Option] = []
        targets: list[AlertEntry | None] = []
        if banner is not None:
            options.append(Option(Text(f"■ {banner}", style="bold"), disabled=True))
            targets.append(None)
        for i, alert in enumerate(alerts):
            options.append(Option(alert_prompt(alert, hints[i]), id=f"alert-{i}"))
            targets.append(alert)
        if not alerts and empty is not None:
            options.append(Option(Text(empty, style="yellow"), disabled=True))
            targets.append(None)
        elif not alerts and banner is None:
            line = f"{HEALTHY} now" if past else HEALTHY
            options.append(Option(Text(line, style="green"), disabled=True))
            targets.append(None)
        for i, entry in enumerate(past):
            options.append(Option(cleared_prompt(entry), id=f"cleared-{i}"))
            targets.append(entry.alert)
        self._targets = targets
        self.add_options(options)
        enabled = [i for i, target in enumerate(targets) if target is not None]
        if keep is not None and enabled:
            self.highlighted = min(enabled, key=lambda i: abs(i - keep))
        title = f"alerts {len(alerts)}" if alerts else "alerts"
        self.border_title = f"{title} · {len(past)} cleared" if past else title

    @on(OptionList.OptionSelected)
    def _selected(self, event: OptionList.OptionSelected) -> None:
        event.stop()
        index = event.option_index
        alert = self._targets[index] if 0 <= index < len(self._targets) else None
        if alert is None:
            return
        targets = alert.ranks or alert.waiting
        if targets:
            self.post_message(self.Jump(targets[0], alert))
