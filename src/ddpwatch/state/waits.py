"""Which collective each unfinished rank is in, kept up to date as heartbeats arrive.

The per-tick rules start from these groups (``diagnosis/facts/``: who waits in what, the
straggler, a collective mismatch). ``ServerState.apply`` keeps the index with one
comparison per heartbeat, so a diagnosis tick at 65,536 ranks reads a handful of groups
instead of regrouping every rank four times a second. ``WaitIndex.of`` builds the same
index from records in one pass: a one-shot ``diagnose``, or records made by hand.
"""

from __future__ import annotations

import math
from collections import Counter
from collections.abc import Iterable

from ddpwatch.core.protocol import Collective
from ddpwatch.state.records import RankRecord

Place = tuple[str | None, str | None, int | None, str | None]
"""A collective as a rank reports it: source, group, seq, and the op when there is no seq:
the raw fields ``diagnosis.facts.ranks.wait_key`` reads (two places may still be one
collective there, spelled two ways)."""
Call = tuple[str, tuple[int, ...] | None, str | None, str | None, int | None]
"""How a rank called its collective: op, shape, dtype, reduce op, root. Ranks in one collective
should agree."""


def place_of(c: Collective) -> Place:
    seq = c.seq
    return (c.source, c.group, seq, c.op if seq is None else None)


def call_of(c: Collective) -> Call:
    shape = c.shape
    return (c.op, None if shape is None else tuple(shape), c.dtype, c.reduce_op, c.root)


def _same_call(a: Collective, b: Collective) -> bool:
    """One collective, called the same way (only the time waited differs)."""
    return (
        a.seq == b.seq
        and a.op == b.op
        and a.source == b.source
        and a.group == b.group
        and a.shape == b.shape
        and a.dtype == b.dtype
        and a.reduce_op == b.reduce_op
        and a.root == b.root
    )


class WaitGroup:
    """The unfinished ranks reporting one collective (one ``Place``): who, the report each
    was placed by, and since when (``starts``, in the server's clock: when the report was
    seen minus the time it says the rank had waited)."""

    __slots__ = (
        "_like",
        "_odd",
        "_sorted",
        "changes",
        "latest",
        "members",
        "place",
        "reports",
        "starts",
    )

    def __init__(self, place: Place) -> None:
        self.place = place
        self.members: dict[int, RankRecord] = {}
        self.reports: dict[int, Collective] = {}
        self.starts: dict[int, float] = {}
        self.latest = -math.inf
        """The last time a member's wait was seen (at least: it never goes down)."""
        self.changes = 0
        """Bumped whenever a rank joins or leaves: what is worked out from the members (their
        sorted ranks) stands until it moves."""
        self._sorted: tuple[int, list[int]] = (-1, [])
        self._like: Collective | None = None  # the first member's call: most share it
        self._odd: set[int] = set()  # members that called it otherwise

    def __len__(self) -> int:
        return len(self.members)

    def records(self) -> list[RankRecord]:
        return list(self.members.values())

    def sorted_ranks(self) -> list[int]:
        """The members' ranks in order, sorted again only after a rank joined or left (one
        list, shared between calls: read it, do not change it)."""
        changes, ranks = self._sorted
        if changes != self.changes:
            ranks = sorted(self.members)
            self._sorted = (self.changes, ranks)
        return ranks

    def oldest_start(self, now: float) -> float | None:
        """When the longest wait began, as ``diagnosis.facts`` times a wait as of ``now`` (a
        report sent after ``now`` counts from ``now``: ``RankRecord.collective_age``); None
        when a member was seen after ``now``, and only a pass over the members can tell."""
        if self.latest > now:
            return None
        return self.first_start()

    def first_start(self) -> float:
        """When the longest wait began by the members' own reports, however late they were
        seen: the latest the collective can have begun."""
        return min(self.starts.values(), default=math.inf)

    def calls(self) -> dict[Call, int]:
        """How many members called it each way: one way, without a pass over them, unless
        some called it otherwise (a mismatch)."""
        like = self._like
        if not self._odd:
            return {} if like is None or not self.members else {call_of(like): len(self)}
        counts: dict[Call, int] = {}
        for c in self.reports.values():
            call = call_of(c)
            counts[call] = counts.get(call, 0) + 1
        return counts

    def ops(self) -> Counter[str]:
        """How many members called each op."""
        ops: Counter[str] = Counter()
        for (op, *_), n in self.calls().items():
            ops[op] += n
        return ops

    def _add(self, record: RankRecord, c: Collective) -> None:
        self._stay(record, c)
        like = self._like
        if like is None:
            self._like = c
        elif not _same_call(like, c):
            self._odd.add(record.rank)
        self.changes += 1

    def _stay(self, record: RankRecord, c: Collective) -> None:
        """A member's new report (the same call): the record (a restarted worker has a new
        one) and when its wait began, which each report restates."""
        rank = record.rank
        self.members[rank] = record
        self.reports[rank] = c
        seen = record.collective_seen
        if seen is None:  # a record that does not say when: its wait is not timed
            self.starts[rank] = math.inf
            return
        self.starts[rank] = seen - c.since_s
        if seen > self.latest:
            self.latest = seen

    def _remove(self, rank: int) -> None:
        del self.members[rank]
        del self.reports[rank]
        del self.starts[rank]
        self._odd.discard(rank)
        self.changes += 1


class WaitIndex:
    """Every rank in one place: unfinished ranks in the ``WaitGroup`` of their collective or
    ``idle`` (in none); crashed or exited ranks ``finished``."""

    def __init__(self) -> None:
        self.groups: dict[Place, WaitGroup] = {}
        self.idle: dict[int, RankRecord] = {}
        self.finished: dict[int, RankRecord] = {}
        self._group_of: dict[int, WaitGroup] = {}

    @classmethod
    def of(cls, records: Iterable[RankRecord]) -> WaitIndex:
        index = cls()
        for record in records:
            index.place(record)
        return index

    def place(self, record: RankRecord) -> None:
        """Put ``record`` where its last report says it is. Called after every message a
        rank sends (``ServerState.apply``): a rank still where it was, as most are from one
        heartbeat to the next, costs a compare or two and no new object."""
        rank = record.rank
        c = record.collective
        if record.error is None and record.exit_time is None:
            if c is None:
                if self.idle.get(rank) is record:
                    return
            else:
                group = self._group_of.get(rank)
                if group is not None and _same_call(group.reports[rank], c):
                    group._stay(record, c)
                    return
        self._move(record)

    def drop(self, rank: int) -> None:
        """The rank is no longer in the job's state (its attempt ended): forget it."""
        group = self._group_of.pop(rank, None)
        if group is not None:
            group._remove(rank)
            if not group.members:
                del self.groups[group.place]
        self.idle.pop(rank, None)
        self.finished.pop(rank, None)

    def _move(self, record: RankRecord) -> None:
        """The rank is somewhere new: in another collective, in none, or finished; or it is
        a new record for the rank (a restarted worker)."""
        rank = record.rank
        self.drop(rank)
        if record.error is not None or record.exit_time is not None:
            self.finished[rank] = record
            return
        c = record.collective
        if c is None:
            self.idle[rank] = record
            return
        where = place_of(c)
        joined = self.groups.get(where)
        if joined is None:
            joined = self.groups[where] = WaitGroup(where)
        joined._add(record, c)
        self._group_of[rank] = joined


def merged(groups: Iterable[WaitGroup]) -> WaitGroup:
    """One group of several: one collective that ranks spell differently (``wait_key`` makes
    them one), for the tick that reads it; the index keeps them apart."""
    parts = list(groups)
    whole = WaitGroup(parts[0].place)
    for part in parts:
        for rank, record in part.members.items():
            whole._add(record, part.reports[rank])
        whole.latest = max(whole.latest, part.latest)
    return whole
