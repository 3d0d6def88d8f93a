"""The orders and roll-ups every reader of the status document shares, written once: the
server's summaries, ``ddpwatch status``, the dashboard, Prometheus, notify and diagnosis
itself agree on which state is worse, which severity is higher, which rank is flagged, which
ranks are the worst, and what a host's row counts.
"""

from __future__ import annotations

import heapq
from collections import Counter
from collections.abc import Collection, Iterable, Mapping
from typing import Final

from ddpwatch.core.vocabulary import RANK_STATES, SEVERITIES, RankState
from ddpwatch.status.schema import HostRow, RankEntry

STATE_ORDER: Final[dict[str, int]] = {state: n for n, state in enumerate(RANK_STATES)}
"""Each rank state's place, worst first (``vocabulary.RANK_STATES``)."""
UNKNOWN_STATE: Final = len(RANK_STATES)
"""The place of a state ``STATE_ORDER`` does not list (a newer server's), or of none: last."""

SEVERITY_LEVEL: Final[dict[str, int]] = {
    severity: n for n, severity in enumerate(reversed(SEVERITIES))
}
"""How severe each severity is: 0 for info, up to error (``SEVERITIES`` is most severe first)."""
UNKNOWN_SEVERITY: Final = -1
"""The level of a severity ``SEVERITY_LEVEL`` does not list: below info."""

UNFLAGGED_STATES: Final = frozenset({RankState.RUNNING, RankState.EXITED, RankState.STOPPED})
"""A rank's usual states: a rank in another one is flagged."""


def state_order(state: str | None) -> int:
    """``state``'s place, worst first; unknown states and None last."""
    return UNKNOWN_STATE if state is None else STATE_ORDER.get(state, UNKNOWN_STATE)


def severity_level(severity: str | None) -> int:
    """How severe ``severity`` is (higher is worse); unknown ones below info."""
    return UNKNOWN_SEVERITY if severity is None else SEVERITY_LEVEL.get(severity, UNKNOWN_SEVERITY)


def is_flagged(state: str | None, named: bool) -> bool:
    """Named by an alert (``named``: as culprit or waiting), or in a state other than a
    rank's usual ones (running, exited, stopped): the dashboard's ``a``, a summary's
    ``flagged``."""
    return named or state not in UNFLAGGED_STATES


def worst_ranks(
    ranks: Iterable[int], states: Mapping[int, str], culprits: Collection[int], n: int
) -> list[int]:
    """The ``n`` worst of ``ranks``, worst first: the worst state first (``STATE_ORDER``),
    within a state the culprits of the active alerts, then by rank. ``states``: each rank's."""
    order = STATE_ORDER

    def key(rank: int) -> tuple[int, bool, int]:
        return (order.get(states[rank], UNKNOWN_STATE), rank not in culprits, rank)

    return heapq.nsmallest(n, ranks, key=key)


class HostTally:
    """One host's row of a summary (``summary.hosts``), counted a rank at a time."""

    __slots__ = (
        "allocated",
        "flagged",
        "gpu_max",
        "host",
        "ranks",
        "states",
        "step_max",
        "step_min",
        "step_time_max",
    )

    def __init__(self, host: str | None) -> None:
        self.host = host
        self.ranks = self.flagged = 0
        self.states: Counter[str] = Counter()
        self.step_min: int | None = None
        self.step_max: int | None = None
        self.step_time_max: float | None = None
        self.allocated: int | None = None
        self.gpu_max: int | None = None

    def add(
        self,
        state: str,
        flagged: bool,
        step: int | None = None,
        step_time_s: float | None = None,
        mem_allocated_bytes: int | None = None,
        gpu_mem_used_bytes: int | None = None,
    ) -> None:
        self.ranks += 1
        self.states[state] += 1
        self.flagged += flagged
        if step is not None:
            self.step_min = step if self.step_min is None else min(self.step_min, step)
            self.step_max = step if self.step_max is None else max(self.step_max, step)
        if step_time_s is not None and (
            self.step_time_max is None or step_time_s > self.step_time_max
        ):
            self.step_time_max = step_time_s
        if mem_allocated_bytes is not None:
            self.allocated = (self.allocated or 0) + mem_allocated_bytes
        if gpu_mem_used_bytes is not None and (
            self.gpu_max is None or gpu_mem_used_bytes > self.gpu_max
        ):
            self.gpu_max = gpu_mem_used_bytes

    def row(self) -> HostRow:
        """The host's row: its states worst first, the ones it has."""
        counts = self.states
        return HostRow(
            host=self.host,
            ranks=self.ranks,
            states={state: counts[state] for state in sorted(counts, key=state_order)},
            flagged=self.flagged,
            step_min=self.step_min,
            step_max=self.step_max,
            step_time_max_s=self.step_time_max,
            mem_allocated_sum_bytes=self.allocated,
            gpu_mem_used_max_bytes=self.gpu_max,
        )


def host_rows(tallies: Mapping[str | None, HostTally], most: int) -> tuple[list[HostRow], int]:
    """The first ``most`` hosts' rows by host name (ranks with no host last, as null), and
    how many hosts were left out."""
    names = sorted(tallies, key=lambda h: (h is None, h or ""))
    return [tallies[name].row() for name in names[:most]], len(names[most:])


def median_steps(ranks: Iterable[RankEntry]) -> dict[int, float]:
    """Each rank's median step (the server's: every step it timed, one step one vote), for
    the ranks that reported and timed one: what the verdict's median and the summary's
    "median step" are made of."""
    return {
        r.rank: r.median_step_s
        for r in ranks
        if r.median_step_s is not None and r.state != RankState.NOT_CONNECTED
    }
