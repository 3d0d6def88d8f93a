"""The cascade: who failed first (the roots: a crash of its own, a failing exit, silence
before anything else failed) and who only failed, stopped or blocks because of them."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from functools import cached_property
from typing import Protocol

from ddpwatch.core.protocol import ErrorInfo
from ddpwatch.core.vocabulary import AlertKind, Phase
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts.census import Census, missing_ranks
from ddpwatch.diagnosis.facts.launch import Difference
from ddpwatch.diagnosis.facts.mismatch import Mismatch
from ddpwatch.diagnosis.facts.ranks import (
    WaitKey,
    entered,
    is_clean_exit,
    is_p2p,
    is_term_exit,
    wait_key,
)
from ddpwatch.diagnosis.knowledge import WAIT_NAMES, Signature, named_ranks
from ddpwatch.diagnosis.text import first_line
from ddpwatch.state.host_memory import oom_note
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState


class Evidence(Protocol):
    """What the cascade reads of ``Facts``, which works it out (a protocol, so that this
    module need not import the object that imports it)."""

    @property
    def state(self) -> ServerState: ...
    @property
    def now(self) -> float: ...
    @property
    def th(self) -> Thresholds: ...
    @property
    def records(self) -> list[RankRecord]: ...
    @property
    def live(self) -> list[RankRecord]: ...
    @property
    def census(self) -> Census: ...
    @property
    def signatures(self) -> dict[int, Signature | None]: ...
    @property
    def relay_silent(self) -> frozenset[int]: ...
    @property
    def mismatch(self) -> Mismatch | None: ...
    @property
    def rendezvous_split(self) -> list[Difference]: ...


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
    """A ``straggler`` or ``send_recv_deadlock`` root: the ranks whose collective (or send or
    receive) timed out waiting for it."""


@dataclass
class Cascade:
    """Who failed first (roots) and who only failed or blocks because of them (victims)."""

    roots: list[Root]
    symptoms: list[RankRecord]  # peer failures (and timeouts when a real root exists)
    stopped: list[RankRecord]  # SIGTERM/SIGINT exits
    census: Census = field(repr=False)
    """Where ``blocked`` is read from, when it is read."""
    mismatched: list[RankRecord] = field(default_factory=list)
    """Ranks that died of a collective mismatch: the mismatch rule decides who caused it."""
    missing: list[int] = field(default_factory=list)
    """Ranks of the world that never connected: the ones a rendezvous timeout waited for."""
    together: list[RankRecord] = field(default_factory=list)
    """Every rank fell silent at once with no failure: the job or the path to us is gone."""
    held: list[RankRecord] = field(default_factory=list)
    """Ranks that fell silent together, not yet told apart (``_first_to_die``): no culprit
    is named while a late report may still separate them."""

    @cached_property
    def blocked(self) -> list[int]:
        """Live ranks waiting in a collective, or in a send or receive: worked out only when
        an alert lists the victims (a pass over every waiting rank: all but one of 131,072
        in a hang, which most ticks do not need)."""
        census = self.census
        quiet = census.quiet_ranks
        blocked = [
            rank for group in census.waits.values() for rank in group.members if rank not in quiet
        ]
        blocked.extend(r.rank for r in census.p2p)
        return blocked


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


def find_cascade(facts: Evidence) -> Cascade:
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
        facts.census,
        buckets.mismatched,
        missing,
        together,
        buckets.held,
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
    held: list[RankRecord] = field(default_factory=list)


def _classify_ranks(facts: Evidence) -> _Buckets:
    """The linear pass: each crashed, exited or silent rank into its bucket (the blocked
    ones are ``Cascade.blocked``, worked out when read)."""
    buckets = _Buckets()
    mismatch = facts.mismatch  # a crash inside a mismatched collective is that mismatch's doing
    in_mismatch = {r.rank for r in mismatch.culprits + mismatch.others} if mismatch else set()
    census = facts.census
    # a rank that failed in a rendezvous whose ranks disagree on its values failed of that
    # disagreement (its store timed out, or found nobody at its port): config_mismatch names
    # the odd rank, never the ones that waited for it
    if any(d.odd for d in facts.rendezvous_split):
        in_mismatch |= {
            r.rank for r in census.finished if r.phase == Phase.RENDEZVOUS and r.init_method
        }
    relay_silent = facts.relay_silent  # their relay's alert names them
    for record in census.finished:
        if record.error is not None:
            _classify_crash(facts, buckets, record, record.error, record.rank in in_mismatch)
        elif is_term_exit(record):
            buckets.stopped.append(record)
        elif record.exit_signal is not None and record.rank in in_mismatch:
            # killed inside the mismatched collective (its black box says which): gloo
            # aborts the rank that receives the odd rank's data, and that one itself
            buckets.mismatched.append(record)
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
    return buckets


def _classify_crash(
    facts: Evidence, buckets: _Buckets, record: RankRecord, error: ErrorInfo, in_mismatch: bool
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


def _tie_window(th: Thresholds) -> float:
    """How close two reports' arrival times may be and still not tell their order: a
    heartbeat or two, and a receive's spread."""
    return 2 * th.interval + 0.5


def _silent_together(facts: Evidence, buckets: _Buckets) -> bool:
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
    return max(seen) - min(seen) <= _tie_window(facts.th)


def _place_silent(facts: Evidence, buckets: _Buckets) -> None:
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
    tied = _tied_with_lost_peers(facts, buckets, silent, cutoff)
    early += tied
    buckets.stopped.extend(
        r for r in silent if r.last_seen >= cutoff and r not in tied and r not in buckets.held
    )
    early = _first_to_die(facts, buckets, early)
    if early:
        root = Root(
            AlertKind.SILENT, [r.rank for r in early], min(r.last_seen for r in early), early
        )
        buckets.primary[(AlertKind.SILENT,)] = root


def _tied_with_lost_peers(
    facts: Evidence, buckets: _Buckets, silent: list[RankRecord], cutoff: float
) -> list[RankRecord]:
    """Silent ranks last heard as the first failure arrived, within a tie window, where
    every failure is a lost peer: the peer they lost is the rank that stopped talking.

    Seen under load (2 CPU hogs on 2 cores): rank 1 killed by SIGKILL, its last heartbeat
    and ranks 0 and 2's "Connection reset by peer" applied in one receive, at one time; a
    strict "silent before" made rank 1 a victim and the job had no culprit. A rank heard
    within a heartbeat or two of a failure was not shown alive after it (its heartbeat may
    have been sent before). Named only once it has been silent a tie window past the
    threshold (``Cascade.held`` until then): its own report may still be on its way."""
    if buckets.primary or buckets.stopped or buckets.timeouts or buckets.mismatched:
        return []  # a failure of its own, or a stop from outside: the usual order tells it
    window = _tie_window(facts.th)
    tied = [r for r in silent if cutoff <= r.last_seen < cutoff + window]
    if tied and facts.now - max(r.last_seen for r in tied) < facts.th.silent + window:
        buckets.held.extend(tied)
        return []
    return tied


def _first_to_die(facts: Evidence, buckets: _Buckets, early: list[RankRecord]) -> list[RankRecord]:
    """Ranks that fell silent within a heartbeat of each other cannot be told apart by when
    they were last heard (seen: the OOM killer's SIGKILL on rank 1, and gloo aborting rank 0
    from C++ the moment its peer vanished, 0.2 s apart, the victim's heartbeat the older).
    Where some of them showed the OOM killer coming (``oom_note``: memory growing steadily
    or near a limit) and the others did not, those are the ones that died first; the others
    died of it.

    A tie nothing separates is named only once it has lasted a tie window past the silent
    threshold: a victim's own report (its crash, "Connection reset by peer") can reach us
    that late from a loaded machine, and then it was never silent (seen under load: a killed
    rank named with the peer whose crash report came after the alert). Until then none of
    them is named, and the peers' failures name no culprit either (``Cascade.held``)."""
    if len(early) < 2:
        return early
    seen = [r.last_seen for r in early]
    window = _tie_window(facts.th)
    if max(seen) - min(seen) > window:
        return early
    dying = [r for r in early if oom_note(r)]
    if dying and len(dying) < len(early):
        buckets.stopped.extend(r for r in early if r not in dying)
        return dying
    if facts.now - max(seen) < facts.th.silent + window:
        buckets.held.extend(early)  # the newest-silent rank's own report may still come
        return []
    return early


def _pick_roots(facts: Evidence, buckets: _Buckets) -> list[Root]:
    """The roots, earliest first: the failures of their own, the timeouts then being
    symptoms (of them, or of a collective mismatch); only when there are none (and no rank
    is missing), the ranks the timeouts waited for (``_held_up_by``), else the timeouts
    themselves."""
    timeouts = list(buckets.timeouts.values())
    held = None
    if not buckets.primary and not missing_ranks(facts.state) and timeouts:
        held = _held_up_by(facts, timeouts)
    if buckets.primary or buckets.mismatched or missing_ranks(facts.state) or held is not None:
        # a timeout waited for someone: the rank that failed, one that never came, one that
        # had not entered the collective (saving, evaluating alone), or ranks held in a
        # mismatched collective (a broadcast whose src differs: the mismatch rule names them)
        for root in timeouts:
            buckets.symptoms.extend(root.records)
        roots = list(buckets.primary.values()) + ([held] if held is not None else [])
    else:
        roots = timeouts
    roots.sort(key=lambda root: (root.time, min(root.ranks)))
    return roots


def _held_up_by(facts: Evidence, timeouts: list[Root]) -> Root | None:
    """The ranks a collective timed out waiting for (LLaMA-Factory #2424: rank 0 saves alone
    past the process group's timeout, the others' barrier times out, and torchrun's "Root
    Cause" names them). Named only on their own evidence: every timed-out rank failed in
    the same numbered collective, and a rank's report, sent after that collective began,
    shows it had not entered it. A rank itself blocked in another collective, or crashed,
    is not one (it waits for someone else, or is a root of its own)."""
    waited = [r for root in timeouts for r in root.records]
    by_peer = _held_by_peer(facts, waited)
    if by_peer is not None:
        return by_peer
    places = {wait_key(c) for r in waited if (c := r.final_collective) is not None}
    if len(places) != 1 or any(r.final_collective is None for r in waited):
        return None
    (place,) = places
    out = {r.rank for r in waited}
    began = min(
        (r.error_time or r.last_seen) - (r.pg_timeout_s or 0.0) for r in waited
    )  # when their wait began, at the latest
    gave_up = min(r.error_time or r.last_seen for r in waited)
    held = [
        r
        for r in facts.records
        if r.rank not in out
        and r.last_seen > began
        and (
            _entered_after(r, place, gave_up)
            or (
                r.error is None
                and entered(r, place) is False
                and not _blocked_elsewhere(r, place)
            )
        )
    ]
    if not held:
        return None
    held.sort(key=lambda r: r.rank)
    return Root(AlertKind.STRAGGLER, [r.rank for r in held], gave_up, held, timed_out=waited)


def _held_by_peer(facts: Evidence, waited: list[RankRecord]) -> Root | None:
    """The peer that ranks timed out in a send or receive waited for (a pipeline stage that
    skipped its send: diffusion-pipe #409): named on its own evidence, heard after their wait
    began; in a collective (or timed out in one itself), the others' timeouts there waited
    for the rank blocked in the receive, so they are its victims too: ``SEND_RECV_DEADLOCK``; in
    none, it is the stage they waited for: ``STRAGGLER``. Ranks that wait for each other, or
    for several peers, are not one rank's doing: None."""
    blocked = [
        r
        for r in waited
        if (c := r.final_collective) is not None and is_p2p(c) and c.peer is not None
    ]
    peers = {c.peer for r in blocked if (c := r.final_collective) is not None}
    if not blocked or len(peers) != 1:
        return None
    (rank,) = peers
    peer = facts.state.ranks.get(rank) if rank is not None else None
    if peer is None or peer in blocked:
        return None
    began = min((r.error_time or r.last_seen) - (r.pg_timeout_s or 0.0) for r in blocked)
    if peer.last_seen <= began:
        return None
    victims = [r for r in waited if r.rank != rank]
    c = peer.final_collective if peer.error is not None else peer.collective
    in_collective = (
        (c is not None and not is_p2p(c)) or len(victims) > len(blocked) or peer in waited
    )
    # (ranks that timed out in a collective, not in a send or receive, the peer among them,
    # waited in one the blocked ranks never entered: the peer's record may no longer show
    # it, a dead rank waits in nothing)
    kind = AlertKind.SEND_RECV_DEADLOCK if in_collective else AlertKind.STRAGGLER
    gave_up = min(r.error_time or r.last_seen for r in blocked)
    return Root(kind, [peer.rank], gave_up, [peer], timed_out=victims)


def _blocked_elsewhere(record: RankRecord, place: WaitKey) -> bool:
    """The live rank is in another collective, which holds it: not one that comes before
    ``place`` in the same counter, which the ranks in ``place`` have passed (gloo's flight
    recorder shows a collective in flight a while after the rank left it: seen under load,
    rank 0 saving alone "inside all_reduce #45" while the others timed out in #46)."""
    c = record.collective
    if c is None or record.exit_time is not None:
        return False
    mine = wait_key(c)
    behind = (
        len(mine) == 3
        and len(place) == 3
        and mine[:2] == place[:2]
        and isinstance(mine[2], int)
        and isinstance(place[2], int)
        and mine[2] < place[2]
    )
    return not behind


def _entered_after(record: RankRecord, place: WaitKey, gave_up: float) -> bool:
    """The rank entered ``place`` only after the ranks waiting in it had timed out, and
    failed there (its peers gone: gloo's "Connection closed by peer"): torchrun slow to stop
    it, it finished what held the others and came (seen on a loaded machine, 9 s late)."""
    final = record.final_collective
    if final is None or record.error_time is None or wait_key(final) != place:
        return False
    return record.error_time - final.since_s >= gave_up
