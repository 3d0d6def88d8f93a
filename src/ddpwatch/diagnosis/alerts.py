"""The alert type and the thresholds diagnosis runs with."""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field
from typing import Any

import msgspec

from ddpwatch.core.vocabulary import Severity
from ddpwatch.status.fmt import iso_time
from ddpwatch.status.schema import AlertEntry

STARTUP_SILENT_S = 15.0
"""A rank still starting may go this long unheard: its heartbeats wait behind imports, model
building and DataLoader workers on a busy host; the startup_hang rule has a minute anyway."""


@dataclass(frozen=True)
class Alert:
    """One problem: ``ranks`` are the culprits, ``waiting`` the ranks blocked because of them.

    ``waited_s``: how long ``waiting`` have waited so far (a straggler's); ``phase``: the
    culprit's phase. Both are for the end-of-run account (how long the others were held up,
    and doing what), where the message is only words.
    """

    kind: str
    severity: Severity
    ranks: tuple[int, ...]
    waiting: tuple[int, ...]
    message: str
    hint: str
    waited_s: float | None = None
    phase: str | None = None
    lost_share: float | None = None
    """``slow_rank``'s: the share of the ``waiting`` ranks' time they spend waiting for the
    culprits (their wait per step over the step), which the time lost counts."""
    episode: int = field(default=0, compare=False)
    """Set by the tracker (``diagnosis/history.py``) on an alert on show: its episode, the
    id that stays while its numbers and culprits change; 0 for a rule's finding."""
    raised_at: float | None = field(default=None, compare=False)
    """...and when that episode was raised (server time)."""

    @property
    def key(self) -> tuple[str, tuple[int, ...]]:
        """Identity across ticks: the same kind about the same culprits is the same alert."""
        return (self.kind, self.ranks)

    def entry(self) -> AlertEntry:
        """The alert as the status document shows it (``status.schema.AlertEntry``)."""
        return AlertEntry(
            kind=self.kind,
            severity=self.severity,
            ranks=list(self.ranks),
            waiting=list(self.waiting),
            message=self.message,
            hint=self.hint,
            waited_s=None if self.waited_s is None else round(self.waited_s, 3),
            phase=self.phase,
            episode=self.episode or None,
            raised=None if self.raised_at is None else iso_time(self.raised_at),
            lost_share=None if self.lost_share is None else round(self.lost_share, 4),
        )

    def to_dict(self) -> dict[str, Any]:
        """``entry()`` as plain JSON values."""
        found: dict[str, Any] = msgspec.to_builtins(self.entry())
        return found


@dataclass(frozen=True)
class Thresholds:
    """Seconds after which each condition is flagged (CLI flags ``--stall-after`` etc.)."""

    interval: float = 0.5
    stall_after: float = 10.0
    silent_after: float | None = None
    startup_after: float = 60.0
    connect_after: float = 10.0

    @property
    def silent(self) -> float:
        """Default: three missed heartbeats plus a second of slack."""
        return self.silent_after if self.silent_after is not None else 3 * self.interval + 1.0

    @property
    def startup_silent(self) -> float:
        """The same for a rank that has not started training: ``STARTUP_SILENT_S`` at least."""
        return max(self.silent, STARTUP_SILENT_S)

    def stall(self, step_times: list[float]) -> float:
        """The stall threshold, raised to 5x the median step time for slow jobs."""
        if not step_times:
            return self.stall_after
        return max(self.stall_after, 5.0 * statistics.median(step_times))
