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

import dataclasses
import json
import sys
from collections import deque
from dataclasses import dataclass, field
from typing import IO, Any

import msgspec

from ddpwatch.core.vocabulary import AlertKind, HistoryEvent, Severity
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
    if change.event == HistoryEvent.UPDATED and change.previous is not None:
        was = ", ".join(str(r) for r in change.previous.ranks[:16])
        what += f" (now rank {culprits}, was {was or 'none'})"
    elif change.event == HistoryEvent.ESCALATED and change.previous is not None:
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


RAISE_HOLD_S = 0.5
"""A warning (or info) is raised once diagnosis has found it this long: a condition true for
one tick (a heartbeat that came late, a wait measured mid-step) is not worth a line. An error
is raised at once: it is an event that happened (a crash, an exit, a NaN) or a condition that
has already held for its own threshold (a stall)."""
CLEAR_HOLD_S = 1.0
"""An alert clears once diagnosis has not found it for this long: one that comes back sooner
(a threshold crossed back and forth, a rank set that changes) is the same episode, not
another line."""


@dataclass
class _Up:
    """An alert on show: its latest version, its episode's raise, and when diagnosis last
    found it (``gone_since``: when it first did not since, else None)."""

    alert: Alert
    raised_at: float
    episode: int
    gone_since: float | None = None


JOB_WIDE: frozenset[str] = frozenset(
    {AlertKind.STALLED, AlertKind.NOT_CONNECTED, AlertKind.SERVER_BEHIND}
)
"""Kinds whose rule says one thing about the job as a whole (one alert a tick): while it stays
up it is one episode, whichever ranks it names from tick to tick."""


TIES: frozenset[str] = frozenset({AlertKind.COLLECTIVE_MISMATCH})
"""Kinds whose alert may name no culprit at first (a tie: which side is odd cannot be told
while a rank's call is not known) and one once the evidence comes (a dead rank's black box):
the same episode, updated."""


def _overlap(a: Alert, b: Alert) -> int:
    """How alike two alerts of one kind are: their culprits in common, or 1 for two with no
    culprit or of a ``JOB_WIDE`` kind, or for two of a ``TIES`` kind, one with none and one
    with some, that speak of a rank in common; 0 for unrelated ones."""
    if a.kind != b.kind:
        return 0
    common = len(set(a.ranks) & set(b.ranks))
    if common == 0 and (a.kind in JOB_WIDE or (not a.ranks and not b.ranks)):
        return 1
    if common == 0 and a.kind in TIES and (not a.ranks or not b.ranks):
        # one names no culprit yet (a tie: a rank's call not known), the other does now:
        # the same episode where the ranks they speak of meet
        return 1 if set(a.ranks + a.waiting) & set(b.ranks + b.waiting) else 0
    return common


def match(found: list[Alert], shown: list[Alert]) -> dict[int, int]:
    """Pair this tick's alerts (``found``) with those on show: the same kind and culprits, or
    else the same kind with culprits in common (the most first); by index, each at most once.
    An alert whose rank set changed (``[0, 2]`` → ``[0, 1, 2]``) is so the same episode."""
    pairs: dict[int, int] = {}
    taken: set[int] = set()
    keys = {a.key: j for j, a in enumerate(shown)}
    for i, alert in enumerate(found):
        j = keys.get(alert.key)
        if j is not None and j not in taken:
            pairs[i] = j
            taken.add(j)
    candidates = sorted(
        (
            (-_overlap(alert, old), i, j)
            for i, alert in enumerate(found)
            if i not in pairs
            for j, old in enumerate(shown)
            if j not in taken and _overlap(alert, old) > 0
        )
    )
    for _, i, j in candidates:
        if i not in pairs and j not in taken:
            pairs[i] = j
            taken.add(j)
    return pairs


def _absorbed(alert: Alert, found: list[Alert]) -> bool:
    """True when another alert of its kind found this tick names all its culprits (two silent
    ranks' alerts become one about both): it ends at once, not after the clear hold."""
    return bool(alert.ranks) and any(
        a.kind == alert.kind and set(alert.ranks) <= set(a.ranks) for a in found
    )


def diff_alerts(before: dict[Any, Alert], after: list[Alert]) -> list[AlertChange]:
    """Alerts that appeared, went away, became more severe or moved to other ranks between two
    ticks, with no hysteresis (``AlertTracker`` adds it)."""
    tracker = AlertTracker(raise_hold_s=0.0, clear_hold_s=0.0)
    tracker.up = [_Up(alert, 0.0, 0) for alert in before.values()]
    return [
        AlertChange(c.event, c.alert, previous=c.previous) for c in tracker.update(after, 0.0, 0.0)
    ]


@dataclass
class AlertTracker:
    """The alerts on show, when each episode went up, and the bounded timeline of changes.

    Diagnosis is judged afresh each tick; the tracker turns its findings into episodes with
    hysteresis: a warning goes up after ``raise_hold_s`` of being found, any alert comes down
    after ``clear_hold_s`` of not being found, and an alert whose culprits change while up
    (``match``) is ``updated`` in its episode rather than cleared and raised again."""

    raise_hold_s: float = RAISE_HOLD_S
    clear_hold_s: float = CLEAR_HOLD_S
    up: list[_Up] = field(default_factory=list)
    pending: dict[Any, float] = field(default_factory=dict)
    """Warnings found but not yet on show: since when, by key."""
    history: deque[AlertChange] = field(default_factory=lambda: deque(maxlen=HISTORY_KEPT))
    total: int = 0
    """Changes ever recorded; ``len(history)`` stops at HISTORY_KEPT."""
    episodes: int = 0
    """Episodes ever raised: the last one's number."""
    attempt: int = 1
    _entries: deque[HistoryEntry] = field(default_factory=lambda: deque(maxlen=HISTORY_KEPT))

    @property
    def shown(self) -> list[Alert]:
        """The alerts on show now, each with its episode and raise time: what the status
        document, the dashboard and the summary list as up."""
        return [u.alert for u in self.up]

    def update(
        self, alerts: list[Alert], now: float, started: float, attempt: int = 1
    ) -> list[AlertChange]:
        """Take one tick's alerts; return the changes, stamped, in the order they happened.
        ``attempt``: the launcher's attempt the job is in (``ServerState.attempt``); when it
        moves on, what was up is closed as part of the attempt before."""
        stamped: list[AlertChange] = []
        if attempt > self.attempt:
            stamped += [
                self._change(HistoryEvent.CLEARED, u, now, started, closed_by=NEW_ATTEMPT)
                for u in self.up
            ]
            self.up, self.pending = [], {}
            self.attempt = attempt
        pairs = match(alerts, [u.alert for u in self.up])
        found = set(pairs.values())
        fresh = [a for i, a in enumerate(alerts) if i not in pairs]
        for i, j in pairs.items():
            stamped += self._carry_on(self.up[j], alerts[i], now, started)
        paired = [alerts[i] for i in pairs]
        kept: list[_Up] = []
        for j, u in enumerate(self.up):
            if j in found:
                u.gone_since = None
            elif self._escalated_by(u, fresh, now, started, stamped):
                pass
            elif _absorbed(u.alert, paired):
                u.gone_since = now  # its ranks are in another episode's alert now
                stamped.append(self._change(HistoryEvent.CLEARED, u, now, started))
                continue
            elif u.gone_since is None:
                u.gone_since = now
            if u.gone_since is not None and now - u.gone_since >= self.clear_hold_s:
                stamped.append(self._change(HistoryEvent.CLEARED, u, now, started))
                continue
            kept.append(u)
        self.up = kept
        stamped += self._raise(fresh, now, started)
        self.history.extend(stamped)
        self._entries.extend(change.entry() for change in stamped)
        self.total += len(stamped)
        return stamped

    def _carry_on(self, u: _Up, alert: Alert, now: float, started: float) -> list[AlertChange]:
        """An alert on show found again: its numbers move on without an event; more severe is
        ``escalated``, other culprits ``updated``, both in its episode."""
        before = u.alert
        u.alert = self._stamped(alert, u)
        if severity_level(alert.severity) > severity_level(before.severity):
            return [self._change(HistoryEvent.ESCALATED, u, now, started, previous=before)]
        if alert.ranks != before.ranks:
            return [self._change(HistoryEvent.UPDATED, u, now, started, previous=before)]
        return []

    def _escalated_by(
        self, u: _Up, fresh: list[Alert], now: float, started: float, out: list[AlertChange]
    ) -> bool:
        """A shown alert not found this tick whose culprits now have a more severe alert of
        another kind (a ``straggler`` that became ``stalled``): that one takes its place, in
        its episode, as an escalation. True when it did."""
        for alert in fresh:
            if (
                alert.ranks
                and alert.ranks == u.alert.ranks
                and severity_level(alert.severity) > severity_level(u.alert.severity)
            ):
                fresh.remove(alert)
                before = u.alert
                u.alert, u.gone_since = self._stamped(alert, u), None
                out.append(self._change(HistoryEvent.ESCALATED, u, now, started, previous=before))
                return True
        return False

    def _raise(self, fresh: list[Alert], now: float, started: float) -> list[AlertChange]:
        """New alerts: raised once found long enough (errors at once); the rest wait."""
        changes = []
        pending: dict[Any, float] = {}
        for alert in fresh:
            since = self.pending.get(alert.key, now)
            hold = 0.0 if alert.severity == Severity.ERROR else self.raise_hold_s
            if now - since < hold:
                pending[alert.key] = since
                continue
            self.episodes += 1
            u = _Up(alert, now, self.episodes)
            u.alert = self._stamped(alert, u)
            self.up.append(u)
            changes.append(self._change(HistoryEvent.RAISED, u, now, started))
        self.pending = pending
        return changes

    @staticmethod
    def _stamped(alert: Alert, u: _Up) -> Alert:
        return dataclasses.replace(alert, episode=u.episode, raised_at=u.raised_at)

    def _change(
        self,
        event: HistoryEvent,
        u: _Up,
        now: float,
        started: float,
        *,
        previous: Alert | None = None,
        closed_by: str | None = None,
    ) -> AlertChange:
        cleared = event == HistoryEvent.CLEARED
        end = u.gone_since if cleared and u.gone_since is not None else now
        return AlertChange(
            event,
            u.alert,
            at=now,
            elapsed_s=max(0.0, now - started),
            previous=previous,
            duration_s=max(0.0, end - u.raised_at) if cleared else None,
            episode=u.episode,
            attempt=self.attempt,
            closed_by=closed_by,
        )

    def restart(self) -> None:
        """A new server session (replay): nothing is up any more; the timeline stays."""
        self.up, self.pending = [], {}
        self.attempt = 1

    def entries(self) -> list[HistoryEntry]:
        """The timeline for the status document, oldest first (each entry built once)."""
        return list(self._entries)
