"""Host memory: a rank whose memory grows until the kernel's OOM killer ends it (and the
others hang), and a rank that holds far more host memory than the others on its host.

The growth of each rank (its own resident set plus its workers') is read from the window
``ServerState`` keeps (``state/host_memory.py``) once the rank's memory settled: its start
(imports, model, DDP, the first steps) is no leak, however late it reaches its plateau. The
window is robust to a one-off jump, so the first epoch's allocation or a checkpoint's buffers
say nothing; ranks that grow alike (a cache every rank fills) are quiet unless the memory
they share runs out soon. Ranks are compared for how much they hold only once settled too.
"""

from __future__ import annotations

import statistics
from bisect import bisect_left
from collections import defaultdict

from ddpwatch.core.vocabulary import AlertKind, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.diagnosis.text import format_ranks
from ddpwatch.state.host_memory import (
    GIB,
    LEAK_RATE,
    WHERE,
    Growth,
    growth,
    headroom,
    settled,
)
from ddpwatch.state.records import RankRecord
from ddpwatch.status.fmt import memory, mib_per_s, wait
from ddpwatch.status.fmt import per_step as fmt_per_step

PEERS_FACTOR = 3.0
"""A leaking rank grows at least this many times as fast as the median of the others."""
SOON_S = 600.0
"""Memory running out sooner than this is worth a warning even when every rank grows alike."""
ERROR_S = 60.0
"""...and an error sooner than this."""
UNEVEN_FACTOR = 2.0
UNEVEN_BYTES = 2 * GIB
"""A rank holding this many times the median resident set of its host's ranks, and this
much more, holds far more than the others."""

LEAK_HINT = (
    "something keeps host memory every step: tensors kept for logging (keep loss.item() or "
    ".detach().cpu() values, never the tensors, whose graph holds every activation), lists of "
    "losses or outputs appended each step, caches that never evict; or DataLoader workers "
    "reading a dataset held as Python lists of objects, which copy it page by page as they "
    "touch the reference counts (pytorch#13246: hold it in numpy arrays or tensors). When "
    "memory runs out the kernel's OOM killer ends a rank with SIGKILL and the others hang: "
    "tracemalloc or memray on the rank shows what grows"
)
UNEVEN_HINT = (
    "the heavy rank holds what the others do not: evaluation outputs, gathered metrics, a "
    "dataset or checkpoint loaded on it alone (torch.load(..., mmap=True) maps it instead), "
    "or DataLoader workers copying Python objects (pytorch#13246); watch whether it grows"
)


@rule(AlertKind.HOST_MEMORY, every="slow")
def rule_host_memory(f: Facts) -> list[Alert]:
    """A rank whose host memory grows steadily towards the node's or its cgroup's limit;
    a rank that holds far more host memory than the others on its host."""
    live = [r for r in f.live if r.host_rss_bytes is not None]
    if not live:
        return []
    pace = _Pace(live)
    leaking = [r for r in live if pace.leaking(r)]
    alerts = [_leak_alert(r, pace) for r in leaking]
    alerts += _uneven([r for r in live if settled(r, f.now)], {r.rank for r in leaking})
    return alerts


class _Pace:
    """Every live rank's growth (constant time for most: ``host_memory.growth``), their
    rates sorted, and each host's total pace: worked out once per run of the rule."""

    def __init__(self, live: list[RankRecord]) -> None:
        self.rates: dict[int, Growth] = {}
        self.host_pace: dict[str | None, float] = defaultdict(float)
        for r in live:
            found = growth(r.host_mem_points)
            if found is not None:
                self.rates[r.rank] = found
                self.host_pace[r.host] += max(0.0, found.rate)
        self.sorted = sorted(g.rate for g in self.rates.values())

    def others(self, rate: float) -> float | None:
        """The median rate of the ranks but one whose rate is ``rate``; None for none."""
        values, n = self.sorted, len(self.sorted) - 1
        if n < 1:
            return None
        i = bisect_left(values, rate)

        def at(j: int) -> float:
            return values[j if j < i else j + 1]

        return (at((n - 1) // 2) + at(n // 2)) / 2

    def leaking(self, r: RankRecord) -> bool:
        """Growing steadily, far faster than the others, or fast enough that the memory
        left runs out within ``SOON_S``."""
        g = self.rates.get(r.rank)
        if g is None or not g.steady:
            return False
        peers = max(0.0, self.others(g.rate) or 0.0)
        if g.rate >= PEERS_FACTOR * peers and g.rate - peers >= LEAK_RATE:
            return True
        left = self.time_left(r)
        return left is not None and left[0] < SOON_S

    def time_left(self, r: RankRecord) -> tuple[float, str] | None:
        """Seconds until the memory ``r`` draws on runs out at the pace of every rank on its
        host that grows, and where (``host_memory.WHERE``); None when no limit is known."""
        room = headroom(r)
        g = self.rates.get(r.rank)
        if room is None or g is None:
            return None
        pace = max(self.host_pace[r.host], g.rate)
        return (room[0] / pace, room[1]) if pace > 0 else None


def _leak_alert(r: RankRecord, pace: _Pace) -> Alert:
    g = pace.rates[r.rank]
    held = memory(r.host_rss_bytes)
    if r.workers_rss_bytes:
        held += f", its workers {memory(r.workers_rss_bytes)}"
    message = (
        f"rank {r.rank}'s host memory grows {mib_per_s(g.rate)}, steadily for {_span(g)} "
        f"(the rank {held})"
    )
    peers = pace.others(g.rate)
    if peers is not None:
        message += f"; the others' median {mib_per_s(peers)}"
    left = pace.time_left(r)
    room = headroom(r)
    severity = Severity.WARNING
    if left is None or room is None:
        message += "; how much memory is left is not known"
    else:
        seconds, where = left
        message += f"; {WHERE[where]} ({memory(room[0])} left) runs out in about {wait(seconds)}"
        if seconds < ERROR_S:
            severity = Severity.ERROR
            message += ": the OOM killer will end it with SIGKILL and the others will hang"
    return alert(AlertKind.HOST_MEMORY, severity, [r.rank], [], message, LEAK_HINT)


def _span(g: Growth) -> str:
    """How long (and over how many steps, a leak's unit) the growth went on: "8 s and 190
    steps, 1.0 MiB a step", "9 of the last 11 s, taking no step"."""
    span = f"{g.span_s:.0f} s"
    if g.rising_s < g.span_s - 0.5:  # it began inside the window
        span = f"{g.rising_s:.0f} of the last {span}"
    per_step = g.per_step
    if per_step is None:
        return f"{span}, taking no step"
    return f"{span} and {g.rising_steps:.0f} steps, {fmt_per_step(per_step)}"


def _uneven(live: list[RankRecord], named: set[int]) -> list[Alert]:
    """Per host, the ranks whose own resident set is far above its ranks' median (the
    workers' sets count shared pages again: left out of the comparison)."""
    hosts: dict[str | None, list[RankRecord]] = defaultdict(list)
    for r in live:
        hosts[r.host].append(r)
    alerts = []
    for host, ranks in sorted(hosts.items(), key=lambda item: str(item[0])):
        if len(ranks) < 2:
            continue
        median = statistics.median(float(r.host_rss_bytes or 0) for r in ranks)
        heavy = [
            r
            for r in ranks
            if r.rank not in named
            and (value := float(r.host_rss_bytes or 0)) >= UNEVEN_FACTOR * median
            and value - median >= UNEVEN_BYTES
        ]
        if not heavy:
            continue
        top = max(heavy, key=lambda r: (r.host_rss_bytes or 0, -r.rank))
        most = float(top.host_rss_bytes or 0)
        held = (
            f"holds {memory(most)}"
            if len(heavy) == 1
            else f"hold up to {memory(most)} (rank {top.rank})"
        )
        ratio = f"{most / median:.1f}x" if median > 0 else "far above"
        on = f" on {host}" if host else ""
        message = (
            f"{format_ranks(r.rank for r in heavy)} {held} of host memory, {ratio} the median "
            f"{memory(median)} of the {len(ranks)} ranks{on}"
        )
        alerts.append(
            alert(
                AlertKind.HOST_MEMORY,
                Severity.WARNING,
                [r.rank for r in heavy],
                [],
                message,
                UNEVEN_HINT,
            )
        )
    return alerts
