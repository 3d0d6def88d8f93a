"""How fast each rank's host memory (its own resident set plus its workers') grows.

``ServerState.apply`` keeps, per rank, a point (server time, bytes) at most every
``POINT_S``, the last ``POINTS`` of them (``note``): one ``array`` of floats per rank, no
object the garbage collector scans. ``growth`` reads a rate from them that a one-off jump
does not move (the first epoch's allocation, a checkpoint loaded once): the median of the
slopes between neighbouring points, with how many of them rise. Where the window as a whole
hardly moves (most ranks, most of the time) the rate is its overall slope, worked out in
constant time, so the status document and the slow rules can read it for every rank.

Imports nothing of the server: ``server/state.py`` keeps the points, ``rules/memory.py``
judges them, ``rules/cascade.py`` reads ``oom_note`` for a rank that died without a word.
"""

from __future__ import annotations

import statistics
from array import array
from dataclasses import dataclass
from typing import Protocol

from ddpwatch.status.fmt import memory, mib_per_s

POINT_S = 1.0
"""The least time between two points of a rank's window."""
POINTS = 16
"""Points kept: about 15 s of history."""
QUIET_RATE = 1 << 20
"""Bytes a second: a window whose overall slope is smaller (either way) is read in constant
time, its rate that slope."""
LEAK_RATE = 5 * (1 << 20)
"""A rank whose memory grows at least this fast, steadily, is leaking (``rules/memory.py``)."""
SUSTAIN_S = 10.0
"""...for at least this long: the window must span it."""
RISING = 0.75
"""...with at least this share of its steps between points rising."""
NEAR_LIMIT = 0.9
"""A used share of the node's memory or the cgroup's limit at least this large is "near"."""
GIB = float(1 << 30)


def note(points: array[float] | None, now: float, total: int) -> array[float]:
    """Add the point (``now``, ``total`` bytes) to a rank's window (``[t0, b0, t1, b1, ...]``,
    None for none yet) unless the last one is under ``POINT_S`` old; the window to keep."""
    if points is None:
        return array("d", (now, float(total)))
    if now - points[-2] >= POINT_S or now < points[-2]:
        points.append(now)
        points.append(float(total))
        if len(points) > 2 * POINTS:
            del points[:2]
    return points


@dataclass(frozen=True)
class Growth:
    """What a window says: ``rate`` in bytes a second (robust), over ``span_s`` seconds,
    ``rising`` the share of its steps that rose and ``rising_s`` the time they cover (0 when
    it was read in constant time)."""

    rate: float
    span_s: float
    rising: float
    rising_s: float = 0.0

    @property
    def steady(self) -> bool:
        """Growing at ``LEAK_RATE`` at least, for ``SUSTAIN_S``, nearly every step."""
        return self.rate >= LEAK_RATE and self.span_s >= SUSTAIN_S and self.rising >= RISING


def growth(points: array[float] | None) -> Growth | None:
    """The window's growth; None with fewer than three points."""
    if points is None or len(points) < 6:
        return None
    span = points[-2] - points[0]
    if span <= 0:
        return None
    overall = (points[-1] - points[1]) / span
    if -QUIET_RATE < overall < QUIET_RATE:
        return Growth(overall, span, 0.0)
    slopes = []
    rising_s = 0.0
    for n in range(2, len(points), 2):
        dt = points[n] - points[n - 2]
        if dt > 0:
            slope = (points[n + 1] - points[n - 1]) / dt
            slopes.append(slope)
            rising_s += dt if slope > 0 else 0.0
    if not slopes:
        return None
    rate = statistics.median(slopes)
    if (rate > 0) != (overall > 0):  # e.g. a jump up in a window that slowly shrinks
        rate = min(rate, overall, key=abs)
    return Growth(rate, span, sum(s > 0 for s in slopes) / len(slopes), rising_s)


class HostMemoryRecord(Protocol):
    """What ``used_share`` and ``oom_note`` read of a rank's record (``RankRecord``)."""

    host_rss_bytes: int | None
    workers_rss_bytes: int | None
    host_available_bytes: int | None
    host_total_bytes: int | None
    cgroup_limit_bytes: int | None
    cgroup_used_bytes: int | None
    host_mem_points: array[float] | None


def headroom(r: HostMemoryRecord) -> tuple[float, str] | None:
    """The bytes left before memory runs out, and where: the cgroup's limit or the node's
    available memory, whichever is nearer; None when neither is known."""
    found: list[tuple[float, str]] = []
    if r.cgroup_limit_bytes is not None and r.cgroup_used_bytes is not None:
        found.append((max(0.0, float(r.cgroup_limit_bytes - r.cgroup_used_bytes)), "cgroup"))
    if r.host_available_bytes is not None:
        found.append((float(r.host_available_bytes), "node"))
    return min(found) if found else None


def used_share(r: HostMemoryRecord) -> tuple[float, str] | None:
    """The larger used share of the cgroup's limit and of the node's memory, and which."""
    found: list[tuple[float, str]] = []
    if r.cgroup_limit_bytes and r.cgroup_used_bytes is not None:
        found.append((r.cgroup_used_bytes / r.cgroup_limit_bytes, "cgroup"))
    if r.host_total_bytes and r.host_available_bytes is not None:
        found.append((1.0 - r.host_available_bytes / r.host_total_bytes, "node"))
    return max(found) if found else None


WHERE = {"cgroup": "its cgroup's memory limit", "node": "the node's memory"}


def oom_note(r: HostMemoryRecord) -> str:
    """A clause for a rank that died without a word (SIGKILL, silence), where its last
    heartbeats point at the kernel's OOM killer: memory near a limit, or growing steadily;
    "" where they do not (or told nothing of host memory)."""
    share = used_share(r)
    found = growth(r.host_mem_points)
    said = []
    if share is not None and share[0] >= NEAR_LIMIT:
        said.append(f"{share[0]:.0%} of {WHERE[share[1]]} in use")
    if found is not None and found.steady:
        said.append(
            f"its host memory growing {mib_per_s(found.rate)} ({memory(r.host_rss_bytes)})"
        )
    if not said:
        return ""
    return f"; its last heartbeats showed {' and '.join(said)}: likely the OOM killer"
