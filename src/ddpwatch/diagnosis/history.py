"""What happened and when: each tick's alerts turned into timed changes, kept as a timeline.

Users look at a job after lunch or after a page; alerts that cleared must still be there.
``AlertTracker`` diffs one tick's alerts against the last (the same kind about the same
culprits is the same alert), stamps every change with the server's clock and the job's
elapsed time, and keeps the last ``HISTORY_KEPT`` changes: the ``history`` of the status
document, the dashboard's timeline (key ``t``) and the end-of-run summary read them.

Each change belongs to an *episode*: one alert from its raise, through its escalations, to
its clearing, numbered in raise order. The same alert raised again later (a straggler each
epoch) is a new episode with its own times, never confused with the last one. A job its
launcher restarted is a new *attempt*: the alerts still up are closed as the attempt ends
(``closed_by`` ``"new_attempt"``), not silently cleared by the new processes' reports.
"""

from __future__ import annotations

import json
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec

from ddpwatch.core.vocabulary import HistoryEvent
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.status.fmt import NEW_ATTEMPT, elapsed, iso_time, seconds
from ddpwatch.status.order import severity_level
from ddpwatch.status.schema import UNSET, HistoryEntry, PreviousAlert

HISTORY_KEPT = 1000




def describe(change: AlertChange) -> str:
    """One line for people (two with the fix), stamped: the alert stream of ``ddpwatch run``
    and the end-of-run summary. ``2026-11-23T19:02:05+01:00 +12.3 s [error] straggler: …``"""
    alert = change.alert
    when = f"{iso_time(change.at, 'seconds')} {elapsed(change.elapsed_s)}"
    culprits = ", ".join(str(r) for r in alert.ranks[:16]) + ("…" if len(alert.ranks) > 16 else "")
    if change.event == HistoryEvent.CLEARED:
        who = f" (rank {culprits})" if culprits else ""
        up = f" after {seconds(change.duration_s)}" if change.duration_s is not None else ""
        if change.closed_by == NEW_ATTEMPT:
            return (
                f"ddpwatch: {when} attempt {change.attempt + 1} began: {alert.kind}{who} "
                f"ends with attempt {change.attempt}{up}"
            )
        return f"ddpwatch: {when} cleared {alert.kind}{who}{up}"
    what = f"[{alert.severity}] {alert.kind}"
    if change.event == HistoryEvent.ESCALATED and change.previous is not None:
        what += f" (was {change.previous.kind}, {change.previous.severity})"
    return f"ddpwatch: {when} {what}: {alert.message}\nddpwatch:   fix: {alert.hint}"


def print_json_line(change: AlertChange, stream: IO[str] | None = None) -> None:
    """The alert stream of ``serve --headless``, ``demo --headless`` and ``replay --headless``:
    ``change.to_dict()`` as one JSON line on ``stream`` (default stdout), flushed."""
    out = sys.stdout if stream is None else stream
    out.write(json.dumps(change.to_dict()) + "\n")
    out.flush()


@dataclass(frozen=True)
class AlertChange:
    """An alert raised, escalated (more severe than before: a warning that became an error,
    or a straggler that became ``stalled``) or cleared, at server time ``at``.

    ``elapsed_s`` counts from the job's first report; ``previous`` is the alert an
    escalation replaces; ``duration_s`` says how long a cleared alert was up. ``episode``
    numbers the alert's raise (its escalations and clearing share it); ``attempt`` is the
    launcher's attempt it happened in (1 unless the job was restarted); ``closed_by`` is
    ``NEW_ATTEMPT`` for an alert a restart ended rather than one that cleared.
    """

    event: HistoryEvent
    alert: Alert
    at: float = 0.0
    elapsed_s: float = 0.0
    previous: Alert | None = None
    duration_s: float | None = None
    episode: int = 0
    attempt: int = 1
    closed_by: str | None = None

    def entry(self) -> HistoryEntry:
        """One entry of the status document's ``history``; also, as JSON, the line of
        ``serve --headless``, ``run``, ``demo --headless`` and ``replay``."""
        previous = self.previous
        return HistoryEntry(
            event=self.event,
            time=iso_time(self.at),
            elapsed_s=round(self.elapsed_s, 3),
            alert=self.alert.entry(),
            episode=self.episode,
            attempt=self.attempt,
            previous=UNSET if previous is None else PreviousAlert(previous.kind, previous.severity),
            duration_s=UNSET if self.duration_s is None else round(self.duration_s, 3),
            closed_by=UNSET if self.closed_by is None else self.closed_by,
        )

    def to_dict(self) -> dict[str, Any]:
        """``entry()`` as plain JSON values."""
        found: dict[str, Any] = msgspec.to_builtins(self.entry())
        return found


def diff_alerts(before: dict[Any, Alert], after: list[Alert]) -> list[AlertChange]:
    """Alerts that appeared, went away or became more severe between two ticks."""
    now = {alert.key: alert for alert in after}
    changes = [
        AlertChange(HistoryEvent.CLEARED, alert) for key, alert in before.items() if key not in now
    ]
    for key, alert in now.items():
        old = before.get(key)
        if old is None:
            changes.append(AlertChange(HistoryEvent.RAISED, alert))
        elif severity_level(alert.severity) > severity_level(old.severity):
            changes.append(AlertChange(HistoryEvent.ESCALATED, alert, previous=old))
    return _merge_escalations(changes)


def _merge_escalations(changes: list[AlertChange]) -> list[AlertChange]:
    """One tick clears a warning and raises an error about the same culprits (``straggler``
    → ``stalled``): that is one escalation, not an unrelated pair."""
    cleared = {
        c.alert.ranks: c for c in changes if c.event == HistoryEvent.CLEARED and c.alert.ranks
    }
    merged: list[AlertChange] = []
    replaced: set[int] = set()
    for change in changes:
        old = cleared.get(change.alert.ranks) if change.event == HistoryEvent.RAISED else None
        if (
            old is not None
            and severity_level(change.alert.severity) > severity_level(old.alert.severity)
        ):
            merged.append(AlertChange(HistoryEvent.ESCALATED, change.alert, previous=old.alert))
            replaced.add(id(old))
        else:
            merged.append(change)
    return [c for c in merged if id(c) not in replaced]


@dataclass
class AlertTracker:
    """The alerts up now, when each went up (and in which episode), and the bounded
    timeline of changes."""

    active: dict[Any, Alert] = field(default_factory=dict)
    since: dict[Any, tuple[float, int]] = field(default_factory=dict)
    """Per active alert: when its episode was raised, and the episode's number."""
    history: deque[AlertChange] = field(default_factory=lambda: deque(maxlen=HISTORY_KEPT))
    total: int = 0
    """Changes ever recorded; ``len(history)`` stops at HISTORY_KEPT."""
    episodes: int = 0
    """Episodes ever raised: the last one's number."""
    attempt: int = 1
    _entries: deque[HistoryEntry] = field(default_factory=lambda: deque(maxlen=HISTORY_KEPT))

    def update(
        self, alerts: list[Alert], now: float, started: float, attempt: int = 1
    ) -> list[AlertChange]:
        """Take one tick's alerts; return the changes, stamped, in the order they happened.
        ``attempt``: the launcher's attempt the job is in (``ServerState.attempt``); when it
        moves on, what was up is closed as part of the attempt before."""
        stamped: list[AlertChange] = []
        if attempt > self.attempt:
            stamped += [
                self._stamp(
                    AlertChange(HistoryEvent.CLEARED, a), now, started, closed_by=NEW_ATTEMPT
                )
                for a in self.active.values()
            ]
            self.active = {}
            self.attempt = attempt
        for change in diff_alerts(self.active, alerts):
            key = change.alert.key
            if change.event == HistoryEvent.RAISED:
                self.episodes += 1
                self.since[key] = (now, self.episodes)
            elif change.previous is not None and change.previous.key != key:
                # straggler → stalled: one problem, one episode, up since the straggler
                self.since[key] = self.since.pop(change.previous.key, (now, 0))
            stamped.append(self._stamp(change, now, started))
        self.active = {alert.key: alert for alert in alerts}
        self.history.extend(stamped)
        self._entries.extend(change.entry() for change in stamped)
        self.total += len(stamped)
        return stamped

    def _stamp(
        self, change: AlertChange, now: float, started: float, closed_by: str | None = None
    ) -> AlertChange:
        key = change.alert.key
        cleared = change.event == HistoryEvent.CLEARED
        raised_at, episode = (self.since.pop if cleared else self.since.get)(key, (now, 0))
        return AlertChange(
            change.event,
            change.alert,
            at=now,
            elapsed_s=max(0.0, now - started),
            previous=change.previous,
            duration_s=now - raised_at if cleared else None,
            episode=episode,
            attempt=self.attempt,
            closed_by=closed_by,
        )

    def restart(self) -> None:
        """A new server session (replay): nothing is up any more; the timeline stays."""
        self.active.clear()
        self.since.clear()
        self.attempt = 1

    def entries(self) -> list[HistoryEntry]:
        """The timeline for the status document, oldest first (each entry built once)."""
        return list(self._entries)
