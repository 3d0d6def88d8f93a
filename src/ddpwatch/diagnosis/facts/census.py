"""Census and pace: every rank sorted once per tick into live, quiet and finished, grouped by
the collective it waits in; and the thresholds the job's own step times set."""

from __future__ import annotations

import statistics
from collections.abc import Callable, Container, Iterable, Sequence
from dataclasses import dataclass, field
from operator import attrgetter

from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts.ranks import WaitKey, is_p2p_place, key_of_place
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState
from ddpwatch.state.waits import WaitGroup, WaitIndex, merged

_AVG_STEP_TIME = attrgetter("avg_step_time_s")
_POSITIVE = (0.0).__lt__  # False for a negative, a zero and a NaN a bad agent sent


def positive(values: Iterable[float | None]) -> list[float]:
    """The values that are numbers above zero, in C loops (131,072 ranks: a pass each)."""
    return list(filter(_POSITIVE, filter(None, values)))


def median(values: Iterable[float | None]) -> float | None:
    data = positive(values)
    return statistics.median(data) if data else None


def median_step_time(records: Sequence[RankRecord]) -> float | None:
    """The ranks' median step time, each by its average if it has one, else its last."""
    averages = list(map(_AVG_STEP_TIME, records))
    if None not in averages:  # most ticks: every rank has an average
        return median(averages)
    return median(
        r.avg_step_time_s if r.avg_step_time_s is not None else r.step_time_s for r in records
    )


def effective_stall_after(state: ServerState, th: Thresholds) -> float:
    """The stall threshold for this job: longer for jobs with slow steps."""
    return th.stall(positive(map(_AVG_STEP_TIME, state.ranks.values())))


def collective_threshold(live: Sequence[RankRecord], stall_after: float) -> float:
    """How long a wait in a collective is suspicious: ~3 s, longer for slow steps.

    Healthy ranks sit in all_reduce for milliseconds, so 2 s never flickers.
    """
    median = median_step_time(live)
    typical = 3.0 * median if median is not None else 3.0
    return max(2.0, min(stall_after, typical))


def world_complete(state: ServerState, live: Sequence[RankRecord]) -> bool:
    """Every rank of the job is connected and alive."""
    size = state.world_size
    if size is None:
        return len(live) == len(state.ranks)
    return sum(1 for r in live if r.rank < size) == size


@dataclass(frozen=True)
class Pace:
    """Thresholds from the job's own step times: medians over every rank, so a ticking
    server (``Diagnosis``) works them out on its slow cadence, not four times a second."""

    stall_after: float
    collective_limit: float


@dataclass
class Census:
    """Every rank in one pass, in the order they first reported."""

    live: list[RankRecord] = field(default_factory=list)
    quiet: list[RankRecord] = field(default_factory=list)  # unfinished and silent
    finished: list[RankRecord] = field(default_factory=list)  # crashed or exited
    waits: dict[WaitKey, WaitGroup] = field(default_factory=dict)
    """Unfinished ranks (live or quiet) by the collective they are in (``wait_key``)."""
    idle: list[RankRecord] = field(default_factory=list)
    """Live ranks in no collective."""
    p2p: list[RankRecord] = field(default_factory=list)
    """Live ranks blocked in a point-to-point op (``send``, ``recv``, a batch's ``isend`` or
    ``irecv``): kept out of ``waits``, since only the one peer each names can release it."""
    quiet_ranks: frozenset[int] = frozenset()
    finished_ranks: Container[int] = frozenset()
    _by_rank: dict[int, RankRecord] | None = None

    def is_live(self, rank: int) -> bool:
        """Whether a rank of the state's records is live (neither finished nor quiet), at
        the cost of two lookups: for rules that start from a few flagged ranks."""
        return rank not in self.finished_ranks and rank not in self.quiet_ranks

    def live_rank(self, rank: int | None) -> RankRecord | None:
        """The live record of ``rank``, None when it is not live (finished, quiet, unknown);
        the index is built on the first call only (ticks without point-to-point make none)."""
        if rank is None:
            return None
        if self._by_rank is None:
            self._by_rank = {r.rank: r for r in self.live}
        return self._by_rank.get(rank)

    def live_outside(self, group: WaitGroup) -> list[RankRecord]:
        """Live ranks not in ``group``: in no collective, in another one, or in a
        point-to-point op."""
        quiet = self.quiet_ranks
        outside = list(self.idle)
        outside.extend(self.p2p)
        for other in self.waits.values():
            if other is not group:
                outside.extend(r for r in other.members.values() if r.rank not in quiet)
        return outside


def take_census(
    records: Sequence[RankRecord],
    recent: float,
    silent: Callable[[RankRecord], bool],
    waits: WaitIndex | None = None,
) -> Census:
    """Sort every rank into live, quiet or finished, and group the unfinished ones by the
    collective they wait in, from ``waits`` (``ServerState.waits``, kept as heartbeats
    arrive; None: an index of ``records`` made here). Most ranks were heard after ``recent``
    (now minus the plain silent threshold, which no rank's own threshold is below): only
    the others need ``silent``. A pass over every rank, every tick: kept to one compare."""
    census = Census()
    index = WaitIndex.of(records) if waits is None else waits
    done = index.finished
    quiet = census.quiet = [
        r for r in records if r.last_seen < recent and r.rank not in done and silent(r)
    ]
    quiet_ranks = census.quiet_ranks = frozenset(r.rank for r in quiet)
    census.finished_ranks = done
    if done or quiet:
        census.finished = [r for r in records if r.rank in done] if done else []
        census.live = [r for r in records if r.rank not in done and r.rank not in quiet_ranks]
    else:
        census.live = list(records)
    census.idle = [r for r in index.idle.values() if r.rank not in quiet_ranks]
    by_key: dict[WaitKey, list[WaitGroup]] = {}
    for place, group in index.groups.items():  # ``wait_key`` once per group, not per rank
        if is_p2p_place(place):
            census.p2p.extend(r for r in group.members.values() if r.rank not in quiet_ranks)
            continue
        by_key.setdefault(key_of_place(*place), []).append(group)
    census.p2p.sort(key=lambda r: r.rank)
    census.waits = {
        key: groups[0] if len(groups) == 1 else merged(groups) for key, groups in by_key.items()
    }
    return census


def missing_ranks(state: ServerState) -> list[int]:
    """Ranks below the reported world size that never sent anything."""
    return state.missing_ranks()
