"""The attribution model every rule family shares, worked out once per ``diagnose`` call.

Who failed first and who only failed because of it (the cascade), which collective most
ranks wait in and which live ranks have not entered it (the straggle), and the thresholds
derived from the job's own step times. The principle: a rank is named only on its own
evidence; a rank whose data cannot tell is left out until fresh data arrives.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from functools import cached_property, lru_cache
from typing import TypeVar, cast

from ddpwatch.core.protocol import Collective, ErrorInfo
from ddpwatch.core.vocabulary import STARTUP_PHASES, AlertKind, RankState
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.knowledge import WAIT_NAMES, Signature, explain_error, named_ranks
from ddpwatch.diagnosis.rules.text import collective_name, first_line
from ddpwatch.server.host_memory import oom_note
from ddpwatch.server.records import RankRecord
from ddpwatch.server.relays import RELAY_HOLD_S, LostRelay, lost_relays
from ddpwatch.server.state import ServerState
from ddpwatch.server.waits import WaitGroup, WaitIndex, call_of, merged

T = TypeVar("T")
MISMATCH_SETTLE_S = 1.0  # a live rank's call counts once it has waited in it this long


_TERM_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP"})


_TERM_CODES = frozenset({-15, -2, -1, 143, 130, 129})
_STARTING = frozenset(STARTUP_PHASES) - {"train"}


def silent_after(record: RankRecord, th: Thresholds, stepping: bool = False) -> float:
    """How long this rank may go unheard before it counts as silent.

    Longer while it starts (no step yet, in a startup phase): its heartbeat thread then
    waits seconds for the GIL behind imports, model building and DataLoader workers on a
    busy host (seen: 2.5 to 10 s at a load average above 4 on 2 cores). Not once a peer is
    ``stepping`` (``ServerState.stepping_since``): in lockstep, the peers' steps say this
    rank started too, and one that only never reported a step (killed at step 12 in the
    job's first second) is not starting (seen: named silent 15 s late). A relayed rank gets
    the beat its relay may hold its frames on top.
    """
    limit = th.silent
    if not stepping and record.step is None and (record.phase is None or record.phase in _STARTING):
        limit = max(limit, th.startup_silent)
    return limit + RELAY_HOLD_S if record.relayed else limit


def is_silent(
    record: RankRecord, now: float, th: Thresholds, since: float, stepping: bool = False
) -> bool:
    """Unheard for longer than ``silent_after``, counting only time the server listened
    through without a break (``since``: ``ServerState.listening_since``)."""
    return now - max(record.last_seen, since) > silent_after(record, th, stepping)


def rank_state(
    record: RankRecord,
    now: float,
    th: Thresholds,
    stall_after: float,
    since: float = -math.inf,
    stepping: bool = False,
) -> str:
    """One word for a rank (a ``RankState``): running, waiting, stalled, silent, crashed,
    stopped or exited, as of ``now`` (``ServerState.as_of``); silence and stalls count from
    ``since`` at the earliest (``ServerState.listening_since``); ``stepping``: a rank of the
    job has reported a step (``silent_after``).

    ``stopped``: ended by a signal from outside (SIGTERM, SIGINT, SIGHUP), usually the
    launcher stopping the rest after one rank failed; ``exited``: ended on its own.
    """
    if record.error is not None:
        return RankState.CRASHED
    if record.exit_time is not None:
        return RankState.STOPPED if is_term_exit(record) else RankState.EXITED
    if is_silent(record, now, th, since, stepping):
        return RankState.SILENT
    if record.collective is not None:
        return RankState.WAITING
    if record.step is not None and now - max(record.last_progress, since) > stall_after:
        return RankState.BUSY if is_busy(record, now, th) else RankState.STALLED
    return RankState.RUNNING


def is_busy(record: RankRecord, now: float, th: Thresholds) -> bool:
    """No step, but working: a stack that differs from the last one at the same step came
    within the silent threshold (the agent samples it every heartbeat once the rank idles).

    A rank evaluating or saving alone moves through Python code; a stuck one (a lock, a
    dead peer, a hung read) shows the same stack beat after beat. A long call into C++
    (one big kernel, a GPU sync) looks stuck too: that is the conservative side."""
    moved = record.stack_moved_at
    return moved is not None and moved > record.last_progress and now - moved <= th.silent


@dataclass(frozen=True)
class OddMark:
    """Ranks whose count at a marked step differs from a strict majority's (``odd_at_mark``)."""

    step: int
    usual: int  # the majority's count
    majority: list[RankRecord]
    odd: list[RankRecord]  # by rank


def odd_at_mark(
    live: list[RankRecord], marks_of: Callable[[RankRecord], dict[int, int]]
) -> OddMark | None:
    """At the latest step every live rank has marked (each mark: step -> its count then), the
    ranks whose count differs from a strict majority's; None when every live rank has not
    marked, fewer than 3 have, all agree, or no side is a clear majority."""
    marked = [r for r in live if marks_of(r)]
    if len(marked) < 3 or len(marked) < len(live):
        return None
    step = _latest_common_mark([marks_of(r) for r in marked])
    if step is None:
        return None
    by_count: dict[int, list[RankRecord]] = defaultdict(list)
    for r in marked:
        by_count[marks_of(r)[step]].append(r)
    if len(by_count) < 2:
        return None
    ranked = sorted(by_count.items(), key=lambda item: (-len(item[1]), item[0]))
    (usual, majority), (_, second) = ranked[0], ranked[1]
    if len(majority) <= len(second) or len(majority) * 2 <= len(marked):
        return None  # no clear majority: which side is odd cannot be told
    odd = sorted((r for _, group in ranked[1:] for r in group), key=lambda r: r.rank)
    return OddMark(step, usual, majority, odd)


def _latest_common_mark(marks: list[dict[int, int]]) -> int | None:
    """The latest step every rank has marked. Usually the earliest of their latest marks
    (ranks keep the last few); only when some rank lacks it, the full intersection."""
    step = min(max(m) for m in marks)
    if all(step in m for m in marks):
        return step
    common = set.intersection(*(set(m) for m in marks))
    return max(common) if common else None


def median(values: Iterable[float | None]) -> float | None:
    data = [v for v in values if v is not None and v > 0]
    return statistics.median(data) if data else None


def median_step_time(records: Iterable[RankRecord]) -> float | None:
    return median(
        r.avg_step_time_s if r.avg_step_time_s is not None else r.step_time_s for r in records
    )


def effective_stall_after(state: ServerState, th: Thresholds) -> float:
    """The stall threshold for this job: longer for jobs with slow steps."""
    times = [
        r.avg_step_time_s
        for r in state.ranks.values()
        if r.avg_step_time_s is not None and r.avg_step_time_s > 0
    ]
    return th.stall(times)


def collective_threshold(live: Sequence[RankRecord], stall_after: float) -> float:
    """How long a wait in a collective is suspicious: ~3 s, longer for slow steps.

    Healthy ranks sit in all_reduce for milliseconds, so 2 s never flickers.
    """
    median = median_step_time(live)
    typical = 3.0 * median if median is not None else 3.0
    return max(2.0, min(stall_after, typical))


def is_term_exit(record: RankRecord) -> bool:
    """Stopped from outside (the launcher's SIGTERM after a peer failed, Ctrl-C)."""
    return record.exit_signal in _TERM_SIGNALS or (
        record.exit_signal is None and record.exit_code in _TERM_CODES
    )


def is_clean_exit(record: RankRecord) -> bool:
    return record.exit_signal is None and record.exit_code in (0, None)


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
    quiet_ranks: frozenset[int] = frozenset()

    def live_outside(self, group: WaitGroup) -> list[RankRecord]:
        """Live ranks not in ``group``: in no collective, or in another one."""
        quiet = self.quiet_ranks
        outside = list(self.idle)
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
    if done or quiet:
        census.finished = [r for r in records if r.rank in done] if done else []
        census.live = [r for r in records if r.rank not in done and r.rank not in quiet_ranks]
    else:
        census.live = list(records)
    census.idle = [r for r in index.idle.values() if r.rank not in quiet_ranks]
    by_key: dict[WaitKey, list[WaitGroup]] = {}
    for place, group in index.groups.items():  # ``wait_key`` once per group, not per rank
        by_key.setdefault(_wait_key(*place), []).append(group)
    census.waits = {
        key: groups[0] if len(groups) == 1 else merged(groups) for key, groups in by_key.items()
    }
    return census


class Facts:
    """What several rules need, worked out at most once per ``diagnose`` call.

    A rule called alone builds its own; ``diagnose`` shares one between all rules so
    that 8192 ranks cost a few linear passes, not one per rule.
    """

    def __init__(
        self,
        state: ServerState,
        now: float,
        th: Thresholds,
        pace: Pace | None = None,
        waits: WaitIndex | None = None,
    ) -> None:
        self.state = state
        self._waits = waits
        self.clock = now  # the server's clock, for a rule called with these facts
        self.now = state.as_of(now)
        """As of what the server has read: a server behind its queue judges the ranks as
        they were when it last caught up, never by messages it has not read yet."""
        self.lag = now - self.now
        self.th = th
        self.since = state.listening_since
        self._pace = pace
        self._memo: dict[str, object] = {}

    def silent(self, record: RankRecord) -> bool:
        """Unheard for too long, over time the server really listened (``is_silent``)."""
        return is_silent(record, self.now, self.th, self.since, self.stepping)

    @cached_property
    def stepping(self) -> bool:
        """A rank of this attempt has reported a step: nobody is still starting up."""
        return self.state.stepping_since is not None

    def idle(self, record: RankRecord) -> float:
        """Seconds without progress the server can vouch for (from ``since`` at most)."""
        return self.now - max(record.last_progress, self.since)

    @cached_property
    def records(self) -> list[RankRecord]:
        return list(self.state.ranks.values())

    @cached_property
    def live(self) -> list[RankRecord]:
        """Ranks still sending heartbeats and not finished."""
        return self.census.live

    @property
    def quiet(self) -> frozenset[int]:
        """Unfinished ranks that are silent (``silent``)."""
        return self.census.quiet_ranks

    @cached_property
    def census(self) -> Census:
        """Every rank sorted once (``take_census``): what the per-tick rules start from."""
        return take_census(self.records, self.now - self.th.silent, self.silent, self._waits)

    @cached_property
    def lost_relays(self) -> list[LostRelay]:
        """Per-node relays gone quiet while ranks still ran (``server/relays.py``)."""
        state = self.state
        return lost_relays(
            state.relays, state.ranks, self.live, self.now, self.since, self.th.silent, self.silent
        )

    @cached_property
    def relay_silent(self) -> frozenset[int]:
        """Ranks that went silent with their relay: the relay is named, not each of them."""
        return frozenset(r.rank for lost in self.lost_relays for r in lost.silent)

    @cached_property
    def pace(self) -> Pace:
        """The job's step-time thresholds: given (a ticking server's, from its last slow
        run), else worked out now."""
        if self._pace is not None:
            return self._pace
        stall_after = effective_stall_after(self.state, self.th)
        return Pace(stall_after, collective_threshold(self.live, stall_after))

    @property
    def stall_after(self) -> float:
        return self.pace.stall_after

    @property
    def collective_limit(self) -> float:
        return self.pace.collective_limit

    @cached_property
    def mismatch(self) -> Mismatch | None:
        return find_mismatch(self.census, self.now, MISMATCH_SETTLE_S)

    @cached_property
    def signatures(self) -> dict[int, Signature | None]:
        """The knowledge base's reading of every crashed rank's error."""
        return {r.rank: explain_error(r.error) for r in self.records if r.error is not None}

    @cached_property
    def cascade(self) -> Cascade:
        return find_cascade(self)

    @cached_property
    def straggle(self) -> Straggle | None:
        return find_straggle(self.census, self.now, self.collective_limit, self.th.interval)

    def memo(self, key: str, compute: Callable[[], T]) -> T:
        """Work one rule family shares between its rules, done once per ``diagnose`` call."""
        if key not in self._memo:
            self._memo[key] = compute()
        return cast(T, self._memo[key])

    def crashes_of_kind(self, kind: str) -> list[RankRecord]:
        """Crashed ranks whose error the knowledge base ties to alert ``kind``, by rank."""
        found = [
            self.state.ranks[rank]
            for rank, sig in self.signatures.items()
            if sig is not None and sig.kind == kind
        ]
        return sorted(found, key=lambda r: r.rank)


@dataclass
class Root:
    """One group of ranks that failed first for the same reason."""

    kind: str
    ranks: list[int]
    time: float
    records: list[RankRecord]
    signature: Signature | None = None
    named: bool = False  # ``ranks`` come from the error text; ``records`` only reported it
    timed_out: list[RankRecord] = field(default_factory=list)
    """A ``straggler`` root: the ranks whose collective timed out waiting for it."""


@dataclass
class Cascade:
    """Who failed first (roots) and who only failed or blocks because of them (victims)."""

    roots: list[Root]
    symptoms: list[RankRecord]  # peer failures (and timeouts when a real root exists)
    stopped: list[RankRecord]  # SIGTERM/SIGINT exits
    blocked: list[int]  # live ranks waiting in a collective
    mismatched: list[RankRecord] = field(default_factory=list)
    """Ranks that died of a collective mismatch: the mismatch rule decides who caused it."""
    missing: list[int] = field(default_factory=list)
    """Ranks of the world that never connected: the ones a rendezvous timeout waited for."""
    together: list[RankRecord] = field(default_factory=list)
    """Every rank fell silent at once with no failure: the job or the path to us is gone."""


def _crash_key(error: ErrorInfo, signature: Signature | None) -> tuple[str, str]:
    if signature is not None:
        return ("sig", signature.name)
    return (error.type, first_line(error.message))


def _group(
    roots: dict[tuple[object, ...], Root],
    key: tuple[object, ...],
    kind: str,
    record: RankRecord,
    t: float,
    signature: Signature | None = None,
) -> None:
    """Add ``record`` to the root group ``key``: the same error on many ranks is one alert.

    An error whose text blames other ranks ("Rank 1 failed to pass monitoredBarrier",
    "did not receive grad for rank 1") makes those ranks the root; the rank that raised
    it only reported it.
    """
    blamed = _blamed_by(record)
    if blamed:
        key = ("named", *blamed, *key)
    root = roots.get(key)
    if root is None:
        ranks = list(blamed) if blamed else [record.rank]
        roots[key] = Root(kind, ranks, t, [record], signature, named=bool(blamed))
        return
    if not blamed:
        root.ranks.append(record.rank)
    root.records.append(record)
    root.time = min(root.time, t)


def _blamed_by(record: RankRecord) -> tuple[int, ...]:
    """Ranks other than itself that a rank's error text names as at fault."""
    if record.error is None:
        return ()
    return tuple(rank for rank in named_ranks(record.error) if rank != record.rank)


def find_cascade(facts: Facts) -> Cascade:
    """Split finished and silent ranks into roots and victims (one linear pass).

    Roots: ranks that crashed with an error of their own, exited with a failure code, or
    went silent before anything else failed; and a rank that exited cleanly while the
    others still trained, once its peers fail or are stopped because of it. Victims: peer
    failures (a lost connection is never a cause), timeouts when a real root exists, and
    ranks stopped by a signal from outside (the launcher's SIGTERM).
    """
    buckets = _classify_ranks(facts)
    _blame_clean_exits(buckets, facts.now)
    together: list[RankRecord] = []
    if _silent_together(facts, buckets):
        together = buckets.silent  # nobody to tell apart: no culprit
    elif buckets.silent:
        _place_silent(facts, buckets)
    roots = _pick_roots(facts, buckets)
    missing = missing_ranks(facts.state)
    return Cascade(
        roots,
        buckets.symptoms,
        buckets.stopped,
        buckets.blocked,
        buckets.mismatched,
        missing,
        together,
    )


@dataclass
class _Buckets:
    """``find_cascade``'s buckets: what its pass over the ranks buckets, then where the later
    stages put the clean exits and the silent ranks."""

    primary: dict[tuple[object, ...], Root] = field(default_factory=dict)
    """Failures of their own, grouped by cause: the roots."""
    timeouts: dict[tuple[object, ...], Root] = field(default_factory=dict)
    """Crashes that only waited too long: roots only when nothing else failed."""
    silent: list[RankRecord] = field(default_factory=list)
    symptoms: list[RankRecord] = field(default_factory=list)
    stopped: list[RankRecord] = field(default_factory=list)
    clean: list[RankRecord] = field(default_factory=list)
    mismatched: list[RankRecord] = field(default_factory=list)
    blocked: list[int] = field(default_factory=list)


def _classify_ranks(facts: Facts) -> _Buckets:
    """The linear pass: each crashed, exited, silent or blocked rank into its bucket."""
    quiet = facts.quiet
    buckets = _Buckets()
    mismatch = facts.mismatch  # a crash inside a mismatched collective is that mismatch's doing
    in_mismatch = {r.rank for r in mismatch.culprits + mismatch.others} if mismatch else set()
    relay_silent = facts.relay_silent  # their relay's alert names them
    census = facts.census
    for record in census.finished:
        if record.error is not None:
            _classify_crash(facts, buckets, record, record.error, record.rank in in_mismatch)
        elif is_term_exit(record):
            buckets.stopped.append(record)
        elif not is_clean_exit(record):
            _group(
                buckets.primary,
                ("exit", record.exit_code, record.exit_signal),
                AlertKind.EXITED,
                record,
                record.exit_time or record.last_seen,
            )
        else:
            buckets.clean.append(record)
    buckets.silent.extend(r for r in census.quiet if r.rank not in relay_silent)
    buckets.blocked.extend(
        rank for group in census.waits.values() for rank in group.members if rank not in quiet
    )
    return buckets


def _classify_crash(
    facts: Facts, buckets: _Buckets, record: RankRecord, error: ErrorInfo, in_mismatch: bool
) -> None:
    """A crashed rank (``error`` is its error): the symptom of a peer's failure, a victim of
    a collective mismatch, a timeout, or a root of its own."""
    signature = facts.signatures[record.rank]
    t = record.error_time if record.error_time is not None else record.last_seen
    if signature is not None and signature.peer_failure:
        buckets.symptoms.append(record)
    elif in_mismatch or (signature is not None and signature.kind == AlertKind.COLLECTIVE_MISMATCH):
        buckets.mismatched.append(record)
    elif signature is not None and signature.name in WAIT_NAMES and not _blamed_by(record):
        _group(
            buckets.timeouts, _crash_key(error, signature), AlertKind.CRASHED, record, t, signature
        )
    else:
        _group(
            buckets.primary, _crash_key(error, signature), AlertKind.CRASHED, record, t, signature
        )


def _blame_clean_exits(buckets: _Buckets, now: float) -> None:
    """When peers failed or were stopped but nothing failed of its own accord, the ranks
    that left early (exited cleanly) broke the others: they become the roots."""
    others_failed = buckets.symptoms or buckets.stopped
    if buckets.clean and others_failed and not buckets.primary and not buckets.mismatched:
        for record in buckets.clean:
            _group(
                buckets.primary,
                ("exit", "clean"),
                AlertKind.EXITED,
                record,
                record.exit_time or now,
            )


def _silent_together(facts: Facts, buckets: _Buckets) -> bool:
    """Two or more ranks fell silent within about one report interval of each other, with
    no failure and no rank still live: the job or the path to us is gone."""
    silent = buckets.silent
    failed = (
        buckets.primary
        or buckets.symptoms
        or buckets.stopped
        or buckets.mismatched
        or buckets.timeouts
    )
    if len(silent) < 2 or failed or facts.live:
        return False
    seen = [r.last_seen for r in silent]
    return max(seen) - min(seen) <= 2 * facts.th.interval + 0.5


def _place_silent(facts: Facts, buckets: _Buckets) -> None:
    """The silent ranks: victims of a collective mismatch when they fell silent as it broke;
    else a root if silent before anything else failed, stopped (a victim) if after."""
    silent = buckets.silent
    # A rank that still sent heartbeats after another one failed was alive when the
    # cascade began (the launcher killed it later): a victim, not a second root.
    cutoff = min(
        [root.time for root in buckets.primary.values()]
        + [r.error_time or r.last_seen for r in buckets.symptoms]
        + [r.exit_time or r.last_seen for r in buckets.stopped],
        default=math.inf,
    )
    mismatch = facts.mismatch
    if buckets.mismatched or mismatch is not None:
        # gloo aborts (SIGABRT, no report) whichever rank receives the odd rank's data:
        # a rank that fell silent as the mismatch broke is one of its victims
        involved = buckets.mismatched + (mismatch.culprits + mismatch.others if mismatch else [])
        begun = min((r.error_time or r.last_seen for r in involved), default=facts.now)
        lost = [r for r in silent if r.last_seen >= begun - facts.th.silent]
        buckets.mismatched.extend(lost)
        silent = [r for r in silent if r not in lost]
    early = [r for r in silent if r.last_seen < cutoff]
    buckets.stopped.extend(r for r in silent if r.last_seen >= cutoff)
    early = _first_to_die(facts, buckets, early)
    if early:
        root = Root(
            AlertKind.SILENT, [r.rank for r in early], min(r.last_seen for r in early), early
        )
        buckets.primary[("silent",)] = root


def _first_to_die(facts: Facts, buckets: _Buckets, early: list[RankRecord]) -> list[RankRecord]:
    """Ranks that fell silent within a heartbeat of each other cannot be told apart by when
    they were last heard (seen: the OOM killer's SIGKILL on rank 1, and gloo aborting rank 0
    from C++ the moment its peer vanished, 0.2 s apart, the victim's heartbeat the older).
    Where some of them showed the OOM killer coming (``oom_note``: memory growing steadily
    or near a limit) and the others did not, those are the ones that died first; the others
    died of it."""
    if len(early) < 2:
        return early
    seen = [r.last_seen for r in early]
    if max(seen) - min(seen) > 2 * facts.th.interval + 0.5:
        return early
    dying = [r for r in early if oom_note(r)]
    if not dying or len(dying) == len(early):
        return early
    buckets.stopped.extend(r for r in early if r not in dying)
    return dying


def _pick_roots(facts: Facts, buckets: _Buckets) -> list[Root]:
    """The roots, earliest first: the failures of their own, the timeouts then being
    symptoms; only when there are none (and no rank is missing), the ranks the timeouts
    waited for (``_held_up_by``), else the timeouts themselves."""
    timeouts = list(buckets.timeouts.values())
    held = None
    if not buckets.primary and not missing_ranks(facts.state) and timeouts:
        held = _held_up_by(facts, timeouts)
    if buckets.primary or missing_ranks(facts.state) or held is not None:
        # a timeout waited for someone: the rank that failed, one that never came, or one
        # that had not entered the collective (saving, evaluating alone)
        for root in timeouts:
            buckets.symptoms.extend(root.records)
        roots = list(buckets.primary.values()) + ([held] if held is not None else [])
    else:
        roots = timeouts
    roots.sort(key=lambda root: (root.time, min(root.ranks)))
    return roots


def _held_up_by(facts: Facts, timeouts: list[Root]) -> Root | None:
    """The ranks a collective timed out waiting for (LLaMA-Factory #2424: rank 0 saves alone
    past the process group's timeout, the others' barrier times out, and torchrun's "Root
    Cause" names them). Named only on their own evidence: every timed-out rank failed in
    the same numbered collective, and a rank's report, sent after that collective began,
    shows it had not entered it. A rank itself blocked in another collective, or crashed,
    is not one (it waits for someone else, or is a root of its own)."""
    waited = [r for root in timeouts for r in root.records]
    places = {wait_key(c) for r in waited if (c := r.final_collective) is not None}
    if len(places) != 1 or any(r.final_collective is None for r in waited):
        return None
    (place,) = places
    out = {r.rank for r in waited}
    began = min(
        (r.error_time or r.last_seen) - (r.pg_timeout_s or 0.0) for r in waited
    )  # when their wait began, at the latest
    held = [
        r
        for r in facts.records
        if r.rank not in out
        and r.error is None
        and r.last_seen > began
        and entered(r, place) is False
        and not (r.collective is not None and r.exit_time is None)
    ]
    if not held:
        return None
    held.sort(key=lambda r: r.rank)
    time = min(r.error_time or r.last_seen for r in waited)
    return Root(AlertKind.STRAGGLER, [r.rank for r in held], time, held, timed_out=waited)


@lru_cache(maxsize=1024)
def normal_op(op: str) -> str:
    """One spelling per collective: "nccl:all_reduce", "ALLREDUCE", "_allreduce_base"."""
    name = op.rsplit(":", 1)[-1].lower()
    name = re.sub(r"[^a-z]", "", name)
    for suffix in ("intotensor", "coalesced", "base", "tensor"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    return name


@dataclass(frozen=True)
class Hop:
    """Ranks blocked in another collective than the most-waited one, whose wait leads to the
    same culprits: victims that wait in ``name`` for ``blockers`` (``find_straggle``'s
    waits-for graph across process groups)."""

    ranks: tuple[int, ...]
    name: str
    blockers: tuple[int, ...]


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
    """The victims between ``waiting`` and ``culprits``, blocked in other groups' collectives."""

    def ops(self) -> Counter[str]:
        """How many waiting ranks called each op."""
        return waiting_ops(self.group, self.waiting)

    def waiting_ranks(self) -> list[int]:
        """The waiting ranks in order (the group's own sorted list when it is all of it)."""
        group = self.group
        if group is not None and len(group) == len(self.waiting):
            return group.sorted_ranks()
        return sorted(r.rank for r in self.waiting)


WaitKey = tuple[object, ...]


def wait_key(c: Collective) -> WaitKey:
    """Which collective a rank waits in, comparable across ranks: the counter its number
    comes from (flight recorder per group, or the agent's Python-level count), else the op."""
    return _wait_key(c.source, c.group, c.seq, c.op)


def _wait_key(source: str | None, group: str | None, seq: int | None, op: str | None) -> WaitKey:
    if seq is None:
        return ("op", normal_op(op or ""))
    return (source, (group or "0") if source == "fr" else None, seq)


def entered(record: RankRecord, key: WaitKey) -> bool | None:
    """The rank's own evidence that it has entered collective ``key``: True, False, or None
    when its report cannot tell (no counts, another counter, a group it is not in)."""
    counts = record.collectives
    source, group, seq = key if len(key) == 3 else (None, None, None)
    if counts is None or not isinstance(seq, int):
        return None
    if source == "py":
        return counts.py >= seq
    if source == "fr" and counts.fr is not None and group in counts.fr:
        return counts.fr[str(group)] >= seq
    return None


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
    culprits, via = _follow_waits(census, culprits, now)
    if culprits:
        via += _also_waiting(census, group, culprits, via, now)
    timeouts = [r.pg_timeout_s for r in waiting if r.pg_timeout_s]
    left = min(timeouts) - age if timeouts else None
    return Straggle(op, seq, age, waiting, culprits, left, group, via)


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
        if evidence is False and (seen if seen < sent_by else sent_by) >= began:
            if began <= r.wait_ended_at and now - r.wait_ended_at < RELEASED_S:
                continue  # just released from another wait: on its way here (not stale yet)
            found.append(r)
        elif evidence is None and r.collectives is None and legacy is not None:
            legacy.append(r)
    found.sort(key=lambda r: r.rank)  # the same, whatever order the index keeps them in
    return found


def _follow_waits(
    census: Census, culprits: list[RankRecord], now: float
) -> tuple[list[RankRecord], list[Hop]]:
    """One waits-for graph across process groups: a culprit that is itself blocked in
    another collective (a subgroup's, a mesh dimension's) is a victim; the culprits are the
    ranks at the end of the chains, in no collective. A chain that ends nowhere (no member
    of that group is known to be missing, or a cycle) keeps the culprits as they were."""
    if all(r.collective is None for r in culprits):
        return culprits, []
    roots: dict[int, RankRecord] = {}
    hops: list[Hop] = []
    seen: set[int] = set()
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
        key = wait_key(c)
        group = census.waits.get(key)
        blockers = (
            _not_entered(census, key, group, _live_members(group, census.quiet_ranks), now)
            if group is not None
            else []
        )
        if not blockers:
            return culprits, []  # it waits, but for whom is not known: say no more
        blocked_by = tuple(sorted(b.rank for b in blockers))
        hops.append(Hop((r.rank,), collective_name(c.op, c.seq), blocked_by))
        frontier.extend(blockers)
    if not roots:
        return culprits, []
    return sorted(roots.values(), key=lambda r: r.rank), hops


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
        roots, chain = _follow_waits(census, blockers, now)
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
transit. Its arrival time says no more than that about when the rank reported."""


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


_SIZE_FREE_OPS = frozenset({"alltoall", "alltoallsingle", "send", "recv"})
"""Ops whose ranks may legitimately pass tensors of different sizes (split sizes)."""


@dataclass
class Mismatch:
    """Ranks that reached the same collective number with different calls."""

    key: WaitKey
    calls: list[tuple[str, list[RankRecord]]]  # (what they called, who), most ranks first
    culprits: list[RankRecord]  # the odd ones out; empty when no majority tells them apart
    others: list[RankRecord]


def call_text(c: Collective) -> str:
    """How a rank called a collective: "all_gather with 5 elements (float32)"."""
    text = c.op.split("[", 1)[0].rsplit(":", 1)[-1]
    if c.shape is not None:
        numel = math.prod(c.shape)
        text += f" with {numel} {'element' if numel == 1 else 'elements'}"
    return text + (f" ({c.dtype})" if c.dtype else "")


def find_mismatch(census: Census, now: float, settle: float) -> Mismatch | None:
    """The first collective number where ranks made different calls: another op, or the
    same op with another size or dtype. Live ranks count once they have been in it for
    ``settle`` seconds; dead ranks with the collective they died in."""
    finals: dict[WaitKey, list[tuple[RankRecord, Collective]]] = defaultdict(list)
    for r in census.finished:
        c = r.final_collective
        if c is not None and c.seq is not None:
            finals[wait_key(c)].append((r, c))
    numbered = [key for key in census.waits if key[0] != "op"]  # comparable across ranks
    for key in sorted({*numbered, *finals}, key=lambda k: (str(k[0]), str(k[1]), k[2])):
        group = census.waits.get(key)
        died = finals.get(key, [])
        if _all_alike(group, died):  # and so are those settled in it: the common case, cheaply
            continue
        waiting = group.records() if group is not None else []
        members = [(r, r.collective) for r in waiting if r.collective is not None]
        settled = [m for m in members if _settled(*m, now, settle)] + died
        found = _mismatch_in(key, sorted(settled, key=lambda m: m[0].rank)) if settled else None
        if found is not None:
            return found
    return None


def _settled(record: RankRecord, c: Collective, now: float, settle: float) -> bool:
    seen = record.collective_seen
    return seen is not None and c.since_s + max(0.0, now - seen) >= settle


def _mismatch_in(key: WaitKey, members: list[tuple[RankRecord, Collective]]) -> Mismatch | None:
    """The calls made at one collective number, when they differ; the odd ones out are the
    culprits (none on a tie)."""
    sized = all(c.shape is not None for _, c in members) and not any(
        normal_op(c.op) in _SIZE_FREE_OPS for _, c in members
    )
    calls: dict[tuple[object, ...], list[RankRecord]] = defaultdict(list)
    texts: dict[tuple[object, ...], str] = {}
    for r, c in members:
        numel = math.prod(c.shape) if sized and c.shape is not None else None
        signature = (normal_op(c.op), numel, c.dtype if sized else None)
        calls[signature].append(r)
        texts.setdefault(signature, call_text(c) if sized else c.op)
    if len(calls) < 2:
        return None
    ranked = sorted(calls.items(), key=lambda item: (-len(item[1]), min(r.rank for r in item[1])))
    majority = ranked[0][1]
    if len(majority) == len(ranked[1][1]):
        culprits: list[RankRecord] = []  # a tie: either side may be the odd one
        others = [r for _, group in ranked for r in group]
    else:
        culprits = [r for _, group in ranked[1:] for r in group]
        others = list(majority)
    described = [(texts[signature], group) for signature, group in ranked]
    return Mismatch(key, described, culprits, others)


def _all_alike(group: WaitGroup | None, died: list[tuple[RankRecord, Collective]]) -> bool:
    """Every call is exactly the same (op, shape, dtype): no mismatch, and no need to work
    out each call's signature (thousands of ranks in one all_reduce). The group counts its
    calls as ranks join it."""
    calls = set(group.calls()) if group is not None else set()
    calls.update(call_of(c) for _, c in died)
    return len(calls) == 1


def missing_ranks(state: ServerState) -> list[int]:
    """Ranks below the reported world size that never sent anything."""
    return state.missing_ranks()
