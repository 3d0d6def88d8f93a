"""How fast each rank's host memory (its own resident set plus its workers') grows, once it
has settled.

A rank's memory climbs by hundreds of MiB as it starts (torch imported, the model built, DDP
set up, the first steps, the allocator warming) and is then flat: a leak is memory that keeps
growing *after* that, not a rank reaching its plateau a few seconds after its peers. So
``ServerState.apply`` keeps a rank's window of points only once the rank has ``settled``
(``WARM_S`` and ``WARM_STEPS`` past its first step, or ``IDLE_WARM_S`` after it first
reported while it has taken none): a point (server time, bytes, step) at most every
``POINT_S``, the last ``POINTS`` of them (``note``), one ``array`` of floats per rank, no
object the garbage collector scans. ``growth`` reads a rate from them that a one-off jump
does not move (a checkpoint's buffers, an evaluation's outputs): the median of the slopes
between neighbouring points, with how many of them rise, and the steps they span (the rate
per step, what a leak that keeps something every step is measured in). Where the window as a
whole hardly moves (most ranks, most of the time) the rate is its overall slope, worked out
in constant time, so the status document and the slow rules can read it for every rank.

Imports nothing of the server: ``state/state.py`` keeps the points, ``rules/memory.py``
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
STRIDE = 3
"""Floats a point takes in the window: server time, bytes, step (``NO_STEP`` for none)."""
NO_STEP = -1.0
WARM_S = 2.0
WARM_STEPS = 5
"""A rank's memory has settled this long and this many steps past its first step: its start
(imports, model, DDP, DataLoader workers, the first steps' buffers) is behind it. With the
``SUSTAIN_S`` horizon after it, a start that climbs until 7 s past the first step is quiet."""
IDLE_WARM_S = 60.0
"""...or this long after it first reported while it has taken no step (a job the agent sees
no steps of, a rank stuck before its first): judged per second, as memory runs out."""
QUIET_RATE = 1 << 20
"""Bytes a second: a window whose overall slope is smaller (either way) is read in constant
time, its rate that slope."""
LEAK_RATE = 5 * (1 << 20)
"""A rank whose memory grows at least this fast, steadily, is leaking (``rules/memory.py``)."""
SUSTAIN_S = 7.0
"""...for at least this long after it settled: the window must span it (a one-off ramp, a
checkpoint's buffers written over a few seconds, rises for too few of its slopes)."""
RISING = 0.75
"""...with at least this share of its steps between points rising."""
NEAR_LIMIT = 0.9
"""A used share of the node's memory or the cgroup's limit at least this large is "near"."""
GIB = float(1 << 30)


class StepRecord(Protocol):
    """What ``settled`` reads of a rank's record (``RankRecord``)."""

    first_seen: float
    step: int | None
    first_step: int | None
    first_step_at: float | None


def settled(r: StepRecord, now: float) -> bool:
    """Whether the rank's start is behind it, so its memory's growth means something: it has
    stepped ``WARM_S`` and ``WARM_STEPS`` past its first step, or, having taken none, it
    first reported ``IDLE_WARM_S`` ago. A rank's first step unsettles it again (its window
    starts over): what it loaded before it was its start."""
    if r.first_step_at is None or r.first_step is None or r.step is None:
        return now - r.first_seen >= IDLE_WARM_S
    return now - r.first_step_at >= WARM_S and r.step - r.first_step >= WARM_STEPS


def note(points: array[float] | None, now: float, total: int, step: int | None) -> array[float]:
    """Add the point (``now``, ``total`` bytes, ``step``) to a rank's window (``[t0, b0, s0,
    t1, ...]``, None for none yet) unless the last one is under ``POINT_S`` old; the window
    to keep."""
    at = NO_STEP if step is None else float(step)
    if points is None:
        return array("d", (now, float(total), at))
    last = points[-STRIDE]
    if now - last >= POINT_S or now < last:
        points.extend((now, float(total), at))
        if len(points) > STRIDE * POINTS:
            del points[:STRIDE]
    return points


@dataclass(frozen=True)
class Growth:
    """What a window says: ``rate`` in bytes a second (robust), over ``span_s`` seconds,
    ``rising`` the share of its steps between points that rose, ``rising_s`` the time they
    cover and ``rising_steps`` the training steps the rank took in that time (both 0 when it
    was read in constant time)."""

    rate: float
    span_s: float
    rising: float
    rising_s: float = 0.0
    rising_steps: float = 0.0

    @property
    def steady(self) -> bool:
        """Growing at ``LEAK_RATE`` at least, for ``SUSTAIN_S``, nearly every step."""
        return self.rate >= LEAK_RATE and self.span_s >= SUSTAIN_S and self.rising >= RISING

    @property
    def per_step(self) -> float | None:
        """Bytes a training step at that rate while it grew, the unit a leak that keeps
        something every step is measured in; None for a rank that took no step as it grew
        (stalled, or no steps seen: judged per second, as memory runs out)."""
        if self.rising_steps <= 0:
            return None
        return self.rate * self.rising_s / self.rising_steps


def growth(points: array[float] | None) -> Growth | None:
    """The window's growth; None with fewer than three points."""
    if points is None or len(points) < 3 * STRIDE:
        return None
    span = points[-STRIDE] - points[0]
    if span <= 0:
        return None
    overall = (points[-2] - points[1]) / span
    if -QUIET_RATE < overall < QUIET_RATE:
        return Growth(overall, span, 0.0)
    slopes = []
    rising_s = rising_steps = 0.0
    for n in range(STRIDE, len(points), STRIDE):
        dt = points[n] - points[n - STRIDE]
        if dt > 0:
            slope = (points[n + 1] - points[n + 1 - STRIDE]) / dt
            slopes.append(slope)
            if slope > 0:
                rising_s += dt
                rising_steps += _steps_between(points[n - 1], points[n + 2])
    if not slopes:
        return None
    rate = statistics.median(slopes)
    if (rate > 0) != (overall > 0):  # e.g. a jump up in a window that slowly shrinks
        rate = min(rate, overall, key=abs)
    return Growth(rate, span, sum(s > 0 for s in slopes) / len(slopes), rising_s, rising_steps)


def _steps_between(before: float, after: float) -> float:
    """Steps taken between two points' steps (``NO_STEP`` for none yet): 0 where not known."""
    return after - before if before != NO_STEP and after > before else 0.0


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
        said.append(f"its host memory growing {mib_per_s(found.rate)} ({memory(r.host_rss_bytes)})")
    if not said:
        return ""
    return f"; its last heartbeats showed {' and '.join(said)}: likely the OOM killer"
