"""Alert episodes: the timeline's entries paired up, one alert from its raise to its clearing,
with its own times and the alert as it last stood.

The verdict, the time lost (``figures.py``) and the report read them. "As it last stood" is
the newest word on it: the entry that cleared it (it holds the alert's last numbers), else,
for an episode still up, the alert on show (``live``): its numbers and its fix move on
between entries, and what a user read last on the dashboard is what the summary and the
report repeat.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from ddpwatch.core.vocabulary import HistoryEvent, Severity
from ddpwatch.status.order import severity_level
from ddpwatch.status.schema import UNSET, AlertEntry, EpisodeEntry, HistoryEntry


@dataclass(frozen=True)
class Episode:
    """One alert from its raise to its clearing (or the end of what was seen): its own times,
    in seconds of the job's elapsed time, and the alert as it last stood."""

    kind: str
    severity: str  # the most severe it reached
    ranks: tuple[int, ...]
    waiting: tuple[int, ...]  # every rank it ever said waited
    message: str
    raised_s: float
    attempt: int = 1
    first_severity: str | None = None  # what it was raised as, when it escalated since
    first_kind: str | None = None  # a straggler that became ``stalled``: what it began as
    escalated_s: float | None = None
    cleared_s: float | None = None
    closed_by: str | None = None  # ``history.NEW_ATTEMPT``: its attempt ended, it did not clear
    waited_s: float | None = None  # how long ``waiting`` had waited at ``waited_at_s``
    waited_at_s: float | None = None  # the last time an entry said (stragglers)
    phase: str | None = None
    hint: str = ""  # the fix as it last stood
    lost_share: float | None = None  # ``slow_rank``'s share of the others' time, last said

    def duration_s(self, end_s: float) -> float:
        """How long it was up: to its clearing, else to ``end_s`` (the end of the run)."""
        return max(0.0, self._end(end_s) - self.raised_s)

    def wait_s(self, end_s: float) -> float:
        """How long its ``waiting`` ranks waited: the last wait measured, carried on to its
        clearing (else ``end_s``); without a measure, how long it was up."""
        if self.waited_s is None or self.waited_at_s is None:
            return self.duration_s(end_s)
        return self.waited_s + max(0.0, self._end(end_s) - self.waited_at_s)

    def _end(self, end_s: float) -> float:
        return self.cleared_s if self.cleared_s is not None else end_s

    def entry(self, end_s: float) -> EpisodeEntry:
        """The episode as the verdict (and the report) writes it, up until ``end_s``."""
        return EpisodeEntry(
            kind=self.kind,
            severity=self.severity,
            ranks=list(self.ranks),
            waiting=list(self.waiting),
            message=self.message,
            raised_s=self.raised_s,
            attempt=self.attempt,
            first_severity=self.first_severity,
            first_kind=self.first_kind,
            escalated_s=self.escalated_s,
            cleared_s=self.cleared_s,
            closed_by=self.closed_by,
            waited_s=self.waited_s,
            waited_at_s=self.waited_at_s,
            phase=self.phase,
            hint=self.hint,
            lost_share=self.lost_share,
            duration_s=round(self.duration_s(end_s), 3),
        )


def episodes(
    history: Iterable[HistoryEntry], live: Sequence[AlertEntry] = (), now_s: float | None = None
) -> list[Episode]:
    """The timeline's entries paired into episodes, in raise order. An escalation continues
    its episode (under its new kind), an update too (about other culprits); an entry whose
    raise fell off the bounded timeline starts one from what it says. ``live``: the alerts
    on show (the document's ``alerts``), each the last word on its episode still up, as of
    ``now_s`` (the document's time, in the job's elapsed seconds)."""
    found: list[_Open] = []
    open_by_key: dict[object, _Open] = {}
    for entry in history:
        alert = entry.alert
        # an episode's number is its id (its culprits may change: ``updated``); a timeline
        # without numbers pairs by kind and culprits
        key: object = entry.episode or (alert.kind, tuple(alert.ranks))
        event, at = entry.event, entry.elapsed_s
        current = open_by_key.pop(key, None)
        if event == HistoryEvent.ESCALATED and entry.previous is not UNSET and not entry.episode:
            current = current or open_by_key.pop((entry.previous.kind, tuple(alert.ranks)), None)
        if current is None:
            up = entry.duration_s if entry.duration_s is not UNSET else 0.0
            since = at - up if event == HistoryEvent.CLEARED else at
            current = _Open(since, entry.attempt or 1, alert)
            found.append(current)
        current.take(entry, at)
        if event != HistoryEvent.CLEARED:
            open_by_key[key] = current
    for alert in live:
        current = open_by_key.get(alert.episode) if alert.episode else None
        if current is not None and current.alert.kind == alert.kind:
            current.last(alert, now_s)
    return [e.episode() for e in found]


class _Open:
    """An episode while its entries are read."""

    def __init__(self, raised_s: float, attempt: int, first: AlertEntry) -> None:
        self.raised_s, self.attempt = raised_s, attempt
        self.alert = self.first = first
        self.severity: str = Severity.INFO
        self.waiting: set[int] = set()
        self.escalated_s: float | None = None
        self.cleared_s: float | None = None
        self.closed_by: str | None = None
        self.waited: tuple[float, float] | None = None  # the last wait measured, and when

    def take(self, entry: HistoryEntry, at: float) -> None:
        alert = self.alert = entry.alert
        self.waiting.update(alert.waiting)
        if severity_level(alert.severity) > severity_level(self.severity):
            self.severity = alert.severity
        if entry.event == HistoryEvent.ESCALATED:
            self.escalated_s = at
        elif entry.event == HistoryEvent.CLEARED:
            # when it went away, not when the clear hold said so: "cleared after 15.6 s" in
            # the alert stream is 15.6 s in the summary too
            up = entry.duration_s
            self.cleared_s = at if up is UNSET else min(at, self.raised_s + up)
            self.closed_by = entry.closed_by if entry.closed_by is not UNSET else None
        if alert.waited_s is not None:
            self.waited = (alert.waited_s, at)

    def last(self, alert: AlertEntry, now_s: float | None) -> None:
        """The alert on show now, as of ``now_s``: its numbers, its fix and who waits, as
        they last stood."""
        self.alert = alert
        self.waiting.update(alert.waiting)
        if alert.waited_s is not None and now_s is not None:
            self.waited = (alert.waited_s, now_s)

    def episode(self) -> Episode:
        alert, first = self.alert, self.first
        waited, waited_at = self.waited if self.waited is not None else (None, None)
        changed = self.escalated_s is not None
        return Episode(
            kind=alert.kind,
            severity=self.severity,
            ranks=tuple(alert.ranks),
            waiting=tuple(sorted(self.waiting - set(alert.ranks))),
            message=alert.message,
            raised_s=self.raised_s,
            attempt=self.attempt,
            first_severity=first.severity if changed else None,
            first_kind=first.kind if first.kind != alert.kind else None,
            escalated_s=self.escalated_s,
            cleared_s=self.cleared_s,
            closed_by=self.closed_by,
            waited_s=waited,
            waited_at_s=waited_at,
            phase=alert.phase or first.phase,
            hint=alert.hint,
            lost_share=alert.lost_share,
        )
