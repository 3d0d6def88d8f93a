"""Two live processes that report the same rank: a duplicate RANK, not a restart.

A rank whose reports come from a new pid is normally a restarted worker (its old process is
gone), and ``ServerState`` starts its record afresh. Two processes launched with the same
RANK (an ``srun`` line that takes ``SLURM_LOCALID`` for the rank on two nodes, two
``torchrun --standalone`` jobs on two nodes, a job started twice) both keep reporting: the
pid that was replaced comes back. A replaced process that had not ended and is heard again
more than ``LATE_S`` after its replacement is alive, not a late frame (a relay holds a frame
one heartbeat at most): the two are duplicates. From then on the record is kept, not
restarted on every flip, and the claims are what ``duplicate_rank`` reads. A replaced
process heard again sooner is a late frame: dropped, so that its record is not restarted for
it and then again for the process that replaced it.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from enum import Enum

WINDOW_S = 60.0
"""How long a replaced process is remembered."""
LATE_S = 2.0
"""A replaced process heard again later than this after its replacement is still alive."""


class NewPid(Enum):
    """What a report from a new pid for a rank is (``RankClaims.changed``)."""

    RESTART = "restart"  # a new process: its record starts afresh
    LATE = "late"  # a frame of a process already replaced: dropped
    DUPLICATE = "duplicate"  # two live processes claim the rank: its record is kept


@dataclass
class Claim:
    """One process that reports a rank: where it runs and when it last said so."""

    pid: int
    host: str | None
    last_seen: float


@dataclass
class RankClaims:
    """Processes replaced per rank while they had not ended (few: only ranks whose pid
    changed), and the ranks found claimed by two or more live processes."""

    replaced: dict[int, dict[int, tuple[float, Claim]]] = field(default_factory=dict)
    """rank -> pid -> (when a new pid replaced it, its claim then)."""
    duplicates: dict[int, dict[int, Claim]] = field(default_factory=dict)
    """rank -> pid -> its claim, for ranks reported by two or more processes at once."""

    def changed(
        self, rank: int, old: Claim, new_pid: int, new_host: str | None, now: float
    ) -> NewPid:
        """A report of ``rank`` from ``new_pid`` where its unfinished record has ``old``'s."""
        claims = self.duplicates.get(rank)
        if claims is not None:
            claims[old.pid] = Claim(old.pid, old.host, now)
            claims[new_pid] = Claim(new_pid, new_host, now)
            return NewPid.DUPLICATE
        replaced = {
            pid: seen
            for pid, seen in self.replaced.get(rank, {}).items()
            if now - seen[0] <= WINDOW_S
        }
        self.replaced[rank] = replaced
        back = replaced.get(new_pid)
        if back is not None and now - back[0] <= LATE_S:
            return NewPid.LATE
        if back is not None:
            del self.replaced[rank]
            self.duplicates[rank] = {
                old.pid: Claim(old.pid, old.host, now),
                new_pid: Claim(new_pid, new_host or back[1].host, now),
            }
            return NewPid.DUPLICATE
        replaced[old.pid] = (now, old)
        return NewPid.RESTART
