"""Stragglers: the collective most ranks wait in and the live ranks that, on their own
evidence, have not entered it; one waits-for graph across process groups finds the ranks
at the end of the chains, and the process group's timeout says how long is left. And the
straggler that never stops: each rank's ``Lag``, where its steps go since its last episode,
which ``slow_rank`` compares."""

from __future__ import annotations

import math
from array import array
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddpwatch.core.protocol import Collective
from ddpwatch.diagnosis.facts.census import Census, median_step_time
from ddpwatch.diagnosis.facts.ranks import WaitKey, entered, is_p2p, normal_op, wait_key
from ddpwatch.diagnosis.text import collective_name
from ddpwatch.state.records import BEAT_WIDTH, Beat, RankRecord, stands_for
from ddpwatch.state.relays import RELAY_HOLD_S
from ddpwatch.state.waits import WaitGroup


@dataclass(frozen=True)
class Hop:
    """Ranks blocked in another collective than the most-waited one, whose wait leads to the
    same culprits: victims that wait in ``name`` for ``blockers`` (``find_straggle``'s
    waits-for graph across process groups)."""

    ranks: tuple[int, ...]
    name: str
    blockers: tuple[int, ...]
    p2p: bool = False  # a send or receive: ``name`` says its peer ("recv from rank 0")


@dataclass(frozen=True)
class Deadlock:
    """A wait that closes on itself through a point-to-point op: ``waiter`` is blocked in
    ``call`` (a send or a receive) for ``peer``, which is itself blocked in ``peer_in``
    (a collective ``waiter`` must enter, or ``peer``'s own send or receive, waiting back).
    Through a collective, ``peer`` holds everyone: the send (or receive) it did not make."""

    waiter: RankRecord
    call: Collective
    peer: RankRecord
    peer_in: Collective


@dataclass
class Straggle:
    """The collective most ranks wait in, and the live ranks that have not entered it."""

    op: str
    seq: int | None
    age: float
    waiting: list[RankRecord]
    culprits: list[RankRecord]
    timeout_left: float | None = None  # until the process group's timeout ends the wait
    group: WaitGroup | None = None
    """Where ``waiting`` comes from: all of it, unless some of its ranks went silent."""
    via: list[Hop] = field(default_factory=list)
    """The victims between ``waiting`` and ``culprits``, blocked in other groups' collectives
    or in a send or receive that waits for them."""
    deadlock: Deadlock | None = None
    """The culprit waits in this collective too, for a rank blocked in a send or receive
    that it alone can complete: the job is deadlocked, not late."""

    def ops(self) -> Counter[str]:
        """How many waiting ranks called each op."""
        return waiting_ops(self.group, self.waiting)

    def waiting_ranks(self) -> list[int]:
        """The waiting ranks in order, each once (the group's own sorted list when it is all
        of it: read it, do not change it)."""
        group = self.group
        if group is not None and len(group) == len(self.waiting):
            return group.sorted_ranks()
        return sorted(r.rank for r in self.waiting)


def find_straggle(census: Census, now: float, limit: float, interval: float) -> Straggle | None:
    """The most-waited collective older than ``limit``, with the live ranks missing from it.

    A rank is named only on its own evidence: its collective counts, sent after the
    collective began, show it has not entered it. Ranks that passed it are never named,
    and a rank whose last report predates the collective waits for its next one.
    Publishers that send no counts fall back to what their in-flight collective and
    their steps suggest.

    "Sent after it began" is judged on what the server can vouch for. The collective began
    at the latest when its first waiter, as reported, entered it (``_first_entry``); a report
    read after ``now`` (a server behind its queue judges as of it) may have been sent as
    early as ``SENT_BEFORE_READ_S`` before ``now``, however late it was read: relays' and
    ranks' queues drain unevenly, so a stale report can come in among fresh ones.
    """
    most_waited = _most_waited(census, now, limit)
    if most_waited is None:
        return None
    key, age, group, waiting = most_waited
    seq = group.place[2]  # every member reports this number (``Place``)
    op = _usual_op(group, waiting)
    legacy: list[RankRecord] = []
    culprits = _not_entered(census, key, group, waiting, now, legacy)
    if legacy:
        culprits += _legacy_culprits(legacy, waiting, key, seq, now, interval, census.live)
    culprits.sort(key=lambda r: r.rank)
    culprits, via, deadlock = follow_waits(census, culprits, now)
    if culprits:
        via += _also_waiting(census, group, culprits, via, now)
    if deadlock is not None:
        named = {r.rank for r in culprits}
        waiting = [r for r in waiting if r.rank not in named]  # it waits, but holds them all
    timeouts = [r.pg_timeout_s for r in waiting if r.pg_timeout_s]
    left = min(timeouts) - age if timeouts else None
    return Straggle(op, seq, age, waiting, culprits, left, group, via, deadlock)


def _not_entered(
    census: Census,
    key: WaitKey,
    group: WaitGroup,
    waiting: list[RankRecord],
    now: float,
    legacy: list[RankRecord] | None = None,
) -> list[RankRecord]:
    """The live ranks outside ``group`` whose own report, sent after its collective began,
    shows they have not entered it (ranks of another group say nothing: not members);
    ``legacy`` collects the ranks that send no counts at all."""
    began = _first_entry(group, waiting)
    sent_by = now - SENT_BEFORE_READ_S  # the latest a report read after ``now`` vouches for
    found = []
    for r in census.live_outside(group):
        evidence = entered(r, key)
        seen = r.sample_seen or 0.0
        vouched = sent_by if r.relayed < 2 else sent_by - RELAY_HOLD_S * (r.relayed - 1)
        if evidence is False and (seen if seen < vouched else vouched) >= began:
            if began <= r.wait_ended_at and now - r.wait_ended_at < RELEASED_S:
                continue  # just released from another wait: on its way here (not stale yet)
            found.append(r)
        elif evidence is None and r.collectives is None and legacy is not None:
            legacy.append(r)
    found.sort(key=lambda r: r.rank)  # the same, whatever order the index keeps them in
    return found


def follow_waits(
    census: Census, culprits: list[RankRecord], now: float
) -> tuple[list[RankRecord], list[Hop], Deadlock | None]:
    """One waits-for graph across process groups: a culprit that is itself blocked in
    another collective (a subgroup's, a mesh dimension's) is a victim; the culprits are the
    ranks at the end of the chains, in no collective. A rank blocked in a send or receive
    waits for its one peer; a peer that waits in a collective which a rank on the chain has
    not entered closes the chain on itself (``Deadlock``): that peer is the culprit, the
    send or receive it did not make. A chain that ends nowhere (no member of that group is
    known to be missing, a peer not live, or a cycle of collectives) keeps the culprits as
    they were."""
    if all(r.collective is None for r in culprits):
        return culprits, [], None
    roots: dict[int, RankRecord] = {}
    hops: list[Hop] = []
    seen: set[int] = set()
    deadlock = None
    frontier = list(culprits)
    while frontier:
        r = frontier.pop(0)
        if r.rank in seen:
            continue
        seen.add(r.rank)
        c = r.collective
        if c is None:
            roots[r.rank] = r
            continue
        step = _p2p_step(census, r, c, seen, now) if is_p2p(c) else _wait_step(census, r, c, now)
        if step is None:
            return culprits, [], None  # it waits, but for whom is not known: say no more
        hop, onward, closed = step
        hops.append(hop)
        if closed is not None:  # the chain closed on itself: its ends are the roots
            deadlock = deadlock or closed  # the first found (from the lowest rank) is told
            roots[closed.peer.rank] = closed.peer
            if is_p2p(closed.peer_in):
                roots[r.rank] = r
        frontier.extend(onward)
    if not roots:
        return culprits, [], None
    return sorted(roots.values(), key=lambda r: r.rank), hops, deadlock


_Step = tuple[Hop, list[RankRecord], Deadlock | None]
"""One rank followed in the waits-for graph: its hop, the ranks it waits for, and the deadlock
its wait closes, if any."""


def _wait_step(census: Census, r: RankRecord, c: Collective, now: float) -> _Step | None:
    """A rank in a collective waits for the live ranks that have not entered it."""
    key = wait_key(c)
    blockers = _blockers(census, key, census.waits.get(key), now)
    if not blockers:
        return None
    blocked_by = tuple(sorted(b.rank for b in blockers))
    return Hop((r.rank,), collective_name(c.op, c.seq), blocked_by), blockers, None


def _p2p_step(
    census: Census, r: RankRecord, c: Collective, seen: set[int], now: float
) -> _Step | None:
    """A rank in a send or receive waits for its one peer, heard since it began to wait; a
    peer that waits back (in a collective a rank on the chain has not entered, or in a send
    or receive toward the chain) closes a deadlock."""
    peer = p2p_peer(census, r, c)
    if peer is None or not _heard_since(peer, r, c):
        return None  # a peer not live, or not heard since: not here
    hop = Hop((r.rank,), p2p_name(c), (peer.rank,), p2p=True)
    back = peer.collective
    if peer.rank in seen and back is not None and is_p2p(back):
        return hop, [], Deadlock(r, c, peer, back)  # each waits for the other
    closing = _closes_on(census, peer, seen, now)
    if closing is not None:
        return hop, [], Deadlock(r, c, peer, closing)
    return hop, [] if peer.rank in seen else [peer], None  # a rank seen is followed already


def _blockers(
    census: Census, key: WaitKey, group: WaitGroup | None, now: float
) -> list[RankRecord]:
    """The live ranks that hold collective ``key`` (its group): those not in it."""
    if group is None:
        return []
    return _not_entered(census, key, group, _live_members(group, census.quiet_ranks), now)


def _closes_on(census: Census, peer: RankRecord, chain: set[int], now: float) -> Collective | None:
    """What ``peer`` waits in, where that wait is held by a rank of ``chain`` (the ranks
    followed to it): a collective one of them has not entered, on their own evidence. None
    where ``peer`` is in no collective, in a send or receive, or waits for others."""
    c = peer.collective
    if c is None or is_p2p(c):
        return None
    key = wait_key(c)
    if any(b.rank in chain for b in _blockers(census, key, census.waits.get(key), now)):
        return c
    return None


def _heard_since(peer: RankRecord, waiter: RankRecord, c: Collective) -> bool:
    """``peer`` reported after ``waiter`` began to wait in ``c`` for it: its own evidence that
    it did not send (or receive) in the meantime."""
    seen = waiter.collective_seen
    return seen is not None and (peer.sample_seen or 0.0) >= seen - c.since_s


def p2p_peer(census: Census, record: RankRecord, c: Collective) -> RankRecord | None:
    """The live rank a send or receive waits for: its peer, when that is another live rank
    (a receive from any source names none)."""
    if c.peer is None or c.peer == record.rank:
        return None
    return census.live_rank(c.peer)


def p2p_name(c: Collective) -> str:
    """A send or receive as the messages say it: "recv from rank 0", "isend to rank 2"."""
    toward = "from" if normal_op(c.op) in ("recv", "irecv") else "to"
    return f"{c.op} {toward} rank {c.peer}" if c.peer is not None else c.op


@dataclass
class P2PHold:
    """Ranks blocked in sends or receives whose waits lead to the same ``culprits``, outside
    the straggler's collective: a pipeline's stages waiting for the one before, or a
    deadlock (``find_p2p_holds``)."""

    culprits: list[RankRecord]
    via: list[Hop]
    waiting: set[int]
    age: float  # the longest of their waits
    deadlock: Deadlock | None = None


def find_p2p_holds(
    census: Census, straggle: Straggle | None, now: float, limit: float
) -> list[P2PHold]:
    """Each live rank blocked in a send or receive for longer than ``limit`` that the
    straggle does not cover, followed to the ranks it waits for (``follow_waits``); waits
    that lead to the same ranks are one hold. A wait whose end is not known names nobody."""
    covered: set[int] = set()
    if straggle is not None and (straggle.culprits or straggle.deadlock is not None):
        covered.update(r.rank for r in straggle.waiting)
        covered.update(r.rank for r in straggle.culprits)
        covered.update(rank for hop in straggle.via for rank in hop.ranks)
    holds: dict[tuple[int, ...], P2PHold] = {}
    for waiter in census.p2p:
        age = waiter.collective_age(now)
        if waiter.rank in covered or age is None or age <= limit:
            continue
        roots, hops, deadlock = follow_waits(census, [waiter], now)
        if roots == [waiter] and deadlock is None:
            continue  # for whom it waits is not known (yet)
        key = tuple(r.rank for r in roots)
        hold = holds.get(key)
        if hold is None:
            hold = holds[key] = P2PHold(roots, [], set(), age, deadlock)
        known = {hop.ranks for hop in hold.via}
        hold.via += [hop for hop in hops if hop.ranks not in known]
        hold.waiting.update(rank for hop in hops for rank in hop.ranks)
        hold.waiting.difference_update(key)
        hold.age = max(hold.age, age)
    return [holds[key] for key in sorted(holds)]


RELEASED_S = 1.5
"""How long a rank released from a collective the others waited in is not named for the
next one: its report may predate its entering it (three heartbeats at 2 Hz at most)."""
OTHER_WAITS = 8
"""Other collectives ``_also_waiting`` follows at most per tick (a job has a few groups)."""


def _also_waiting(
    census: Census, top: WaitGroup, culprits: list[RankRecord], via: list[Hop], now: float
) -> list[Hop]:
    """The ranks waiting in other collectives whose waits lead to the same culprits (rank 1
    in the world's all-reduce, waiting for rank 0, which waits in a subgroup for the culprit):
    victims too, listed with what they wait in. At most ``OTHER_WAITS`` collectives."""
    named = {r.rank for r in culprits}
    known = {rank for hop in via for rank in hop.ranks}
    hops: list[Hop] = []
    others = sorted(census.waits.items(), key=lambda item: (-len(item[1]), repr(item[0])))
    for key, group in others[:OTHER_WAITS]:
        if group is top:
            continue
        members = _live_members(group, census.quiet_ranks)
        if not members or all(r.rank in known for r in members):
            continue
        blockers = _not_entered(census, key, group, members, now)
        if not blockers:
            continue
        roots, chain, _ = follow_waits(census, blockers, now)
        if {r.rank for r in roots} <= named:
            c = members[0].collective
            name = collective_name(c.op, c.seq) if c is not None else "a collective"
            ranks = tuple(sorted(r.rank for r in members))
            hops.append(Hop(ranks, name, tuple(sorted(b.rank for b in blockers))))
            hops += [hop for hop in chain if not set(hop.ranks) & known]
            known.update(ranks)
    return hops


SENT_BEFORE_READ_S = 1.0
"""How long before the server's horizon (``ServerState.heard_until``: its queue found empty) a
frame it reads later may have been sent: a relay holds frames up to its beat (0.5 s), then
transit. Its arrival time says no more than that about when the rank reported. A relay at a
slower pace (``Batch.every``) holds them a beat longer for each beat it lets pass."""


def _first_entry(group: WaitGroup, waiting: list[RankRecord]) -> float:
    """When the first of ``waiting`` entered the collective, by its own report (when it was
    seen minus how long it said it had waited): the latest the collective can have begun."""
    if len(waiting) == len(group):
        return group.first_start()  # kept as they report
    first = math.inf
    for r in waiting:
        c, seen = r.collective, r.collective_seen
        if c is not None and seen is not None and seen - c.since_s < first:
            first = seen - c.since_s
    return first


def _usual_op(group: WaitGroup, waiting: list[RankRecord]) -> str:
    """The op most waiters are in (they share a collective number, so usually one op); of
    two as common, the first by name: whatever order the ranks came in."""
    ops = waiting_ops(group, waiting)
    return min(ops, key=lambda op: (-ops[op], op))


def waiting_ops(group: WaitGroup | None, waiting: list[RankRecord]) -> Counter[str]:
    """How many of ``waiting`` (live members of ``group``) called each op: the group counts
    them as they join, unless some of its ranks went silent."""
    if group is not None and len(waiting) == len(group):
        return group.ops()
    return Counter(r.collective.op for r in waiting if r.collective)


def _most_waited(
    census: Census, now: float, limit: float
) -> tuple[WaitKey, float, WaitGroup, list[RankRecord]] | None:
    """The collective the most live ranks wait in (the longest-waited of those tied) among
    those older than ``limit``: its key, its age, its group and its live waiters; None when
    there is none."""
    quiet = census.quiet_ranks
    best: tuple[int, float, WaitKey, WaitGroup] | None = None
    for key, group in census.waits.items():
        members = group.members
        size = len(members)
        began = None
        if quiet and any(rank in members for rank in quiet):
            size -= sum(1 for rank in quiet if rank in members)
        else:
            began = group.oldest_start(now)
        if began is None:
            age = _oldest_wait(_live_members(group, quiet), now)
        else:
            age = now - (began if began < now else now)
        if age > limit and (best is None or (size, age) > best[:2]):
            best = (size, age, key, group)
    if best is None:
        return None
    _, age, key, group = best
    return key, age, group, _live_members(group, quiet)


def _live_members(group: WaitGroup, quiet: frozenset[int]) -> list[RankRecord]:
    if not quiet:
        return group.records()
    return [r for r in group.members.values() if r.rank not in quiet]


def _oldest_wait(members: list[RankRecord], now: float) -> float:
    """The longest any of ``members`` has waited in its collective (``collective_age``)."""
    began = now
    for r in members:
        c, seen = r.collective, r.collective_seen
        if c is not None and seen is not None:
            start = (seen if seen < now else now) - c.since_s
            if start < began:
                began = start
    return now - began


def _legacy_culprits(
    candidates: list[RankRecord],
    waiting: list[RankRecord],
    key: WaitKey,
    seq: int | None,
    now: float,
    interval: float,
    live: Sequence[RankRecord],
) -> list[RankRecord]:
    """Ranks without collective counts (other publishers): not in the collective and not
    stepping on since the waiters last reported."""
    reported = max(r.collective_seen or 0.0 for r in waiting)
    lag = max(0.0, now - reported) + interval  # how stale the waiters' view may be
    steps_in_lag = math.ceil(lag / (median_step_time(live) or interval))
    max_step = max((r.step or 0) for r in waiting) + 1 + steps_in_lag
    return [
        r
        for r in candidates
        if _has_not_entered(r, key, seq) and not _moved_on(r, reported, max_step)
    ]


def _moved_on(record: RankRecord, since: float, max_step: int) -> bool:
    """The rank stepped within the waiters' reporting lag: the collective is likely done.

    The waiters' next heartbeat will say so: without this, every recovery from a
    straggler (or a stopped rank) would briefly blame the ranks that went on
    first. A rank further ahead than heartbeats can explain (extra batches while
    the others wait) still counts as a culprit.
    """
    return record.last_step_at > since and (record.step or 0) <= max_step


def _has_not_entered(record: RankRecord, key: WaitKey, seq: int | None) -> bool:
    c = record.collective
    if c is None:
        return True
    if seq is not None and c.seq is not None:
        return c.seq < seq
    return wait_key(c) != key


class Lag:
    """Where a rank's steps go since its last episode, as medians over its heartbeats
    (``RankRecord.beats``): ``slow_rank``'s evidence.

    Medians, because a mean remembers one long step (a stall of 8 s) as a lag on every step
    for many seconds; and a window that starts afresh after an episode (a step gap longer
    than a collective may wait: a stall, a stop, the start), so what a rank did before it
    counts for nothing after: a one-off stall is the straggler alert's, never a slow rank.
    Each median is worked out once, when asked: a tick at 8,192 ranks reads only the waits.
    """

    __slots__ = ("_medians", "_window", "beats")

    def __init__(self, window: array[float]) -> None:
        self._window = window
        self._medians: dict[Beat, tuple[float, int] | None] = {}
        self.beats = len(window) // BEAT_WIDTH
        """Beats since the episode: how much evidence the medians hold."""

    @property
    def heartbeats(self) -> float:
        """The heartbeats its beats stand for (``Beat.STANDS_FOR``): how long it spans."""
        return stands_for(self._window)

    def median(self, column: Beat) -> float | None:
        """The column's median over the beats that timed it; None where none did."""
        found = self._median_of(column)
        return None if found is None else found[0]

    def _median_of(self, column: Beat) -> tuple[float, int] | None:
        """(median, beats that timed it) of a column, once."""
        if column not in self._medians:
            values = [v for v in self._window[column::BEAT_WIDTH] if v == v]
            self._medians[column] = (_median(values), len(values)) if values else None
        return self._medians[column]

    @property
    def waited_s(self) -> float:
        """All the rank waits for the others per step, on most steps."""
        return self.median(Beat.WAITED) or 0.0

    def own_step(self) -> tuple[float, int] | None:
        """The rank's own step, less its waits for the others, and the beats it rests on: its
        compute and input wait where the agent split the step, else its step less the waits."""
        compute = self._median_of(Beat.COMPUTE)
        if compute is not None:
            return compute[0] + (self.median(Beat.INPUT_WAIT) or 0.0), compute[1]
        step = self._median_of(Beat.STEP)
        return None if step is None else (max(0.0, step[0] - self.waited_s), step[1])


def timed(beats: array[float], column: Beat) -> bool:
    """The last of a rank's non-empty ``beats`` timed the column (its agent measures it)."""
    value = beats[column - BEAT_WIDTH]
    return value == value  # NaN: untimed


def _median(values: list[float]) -> float:
    """The median of a non-empty list, sorted in place (``statistics.median``, less its
    checks: one per rank and column)."""
    values.sort()
    mid = len(values) // 2
    return values[mid] if len(values) % 2 else (values[mid - 1] + values[mid]) / 2


def lag_since_episode(record: RankRecord, episode_s: float) -> Lag | None:
    """The rank's ``Lag`` over its beats after the last whose step gap exceeds
    ``episode_s`` (that beat's own steps held the episode); None before any beat."""
    beats = record.beats
    if beats is None:
        return None
    gaps = beats[Beat.GAP :: BEAT_WIDTH]
    if max(gaps) <= episode_s:  # most ranks, most of the time
        return Lag(beats)
    start = next(at + 1 for at in range(len(gaps) - 1, -1, -1) if gaps[at] > episode_s)
    return Lag(beats[start * BEAT_WIDTH :])
