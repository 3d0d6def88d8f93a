"""The attribution model every rule family shares, worked out once per ``diagnose`` call.

Four models, one module each: ``census`` (live, quiet and finished ranks, grouped by the
collective they wait in, and the thresholds the job's step times set), ``cascade`` (who
failed first and who only failed because of it), ``stragglers`` (which collective most
ranks wait in and which live ranks have not entered it, across process groups) and
``mismatch`` (ranks that called different collectives, or drifted apart in their counts);
``ranks`` is what one rank's own record says, which they all read. ``Facts`` holds them
for the rules. The principle: a rank is named only on its own evidence; a rank whose data
cannot tell is left out until fresh data arrives.
"""

from __future__ import annotations

from collections.abc import Callable
from functools import cached_property
from typing import TypeVar, cast

from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts.cascade import Cascade, find_cascade
from ddpwatch.diagnosis.facts.census import (
    Census,
    Pace,
    collective_threshold,
    effective_stall_after,
    take_census,
)
from ddpwatch.diagnosis.facts.launch import RENDEZVOUS_HOLD_S, Difference, rendezvous_split
from ddpwatch.diagnosis.facts.mismatch import (
    MISMATCH_SETTLE_S,
    Mismatch,
    OddCalls,
    OddMark,
    find_mismatch,
    odd_at_mark,
    odd_calls,
)
from ddpwatch.diagnosis.facts.ranks import is_silent
from ddpwatch.diagnosis.facts.stragglers import P2PHold, Straggle, find_p2p_holds, find_straggle
from ddpwatch.diagnosis.knowledge import Signature, explain_error
from ddpwatch.state.devices import DeviceIndex
from ddpwatch.state.flags import RankFlags
from ddpwatch.state.marks import MarkIndex, MarkKind
from ddpwatch.state.records import RankRecord
from ddpwatch.state.relays import LostRelay, lost_relays
from ddpwatch.state.state import ServerState
from ddpwatch.state.waits import WaitIndex

T = TypeVar("T")


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
        devices: DeviceIndex | None = None,
        marks: MarkIndex | None = None,
        flags: RankFlags | None = None,
    ) -> None:
        self.state = state
        self._waits = waits
        self._devices = devices
        self._marks = marks
        self._flags = flags
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
    def devices(self) -> DeviceIndex:
        """Each rank's GPU and the ranks the device rules may name (``state/devices.py``):
        the server's, kept as identities arrive, or one made here from the records."""
        return DeviceIndex.of(self.records) if self._devices is None else self._devices

    @cached_property
    def flags(self) -> RankFlags:
        """The ranks with no step yet and those whose loss or gradients went bad
        (``state/flags.py``): the server's, kept as messages arrive, or made here."""
        return RankFlags.of(self.records) if self._flags is None else self._flags

    @cached_property
    def marks(self) -> MarkIndex:
        """How many ranks hold each value at each marked step (``state/marks.py``): the
        server's, kept as marks arrive, or one made here from the records."""
        return MarkIndex.of(self.records) if self._marks is None else self._marks

    def odd_at_mark(self, kind: MarkKind) -> OddMark | None:
        """``odd_at_mark`` over the live ranks, once per call of ``diagnose``; no pass over
        every rank where the marks' tally shows that the live ranks agree."""
        return self.memo(
            f"odd_at_mark {kind}",
            lambda: None if self._agreed(kind) else odd_at_mark(self.live, kind),
        )

    @cached_property
    def odd_calls(self) -> OddCalls | None:
        """``odd_calls`` over the live ranks; none where the digests' tally agrees."""
        return None if self._agreed("call_digests") else odd_calls(self.live)

    def _agreed(self, kind: MarkKind) -> bool:
        """The tally proves every live rank agrees on ``kind`` (``MarkIndex.agreed``), taking
        off the records that are not live, when they are the fewer."""
        census = self.census
        others = census.quiet + census.finished
        return len(others) <= len(census.live) and self.marks.agreed(
            kind, len(census.live), others
        )

    @cached_property
    def lost_relays(self) -> list[LostRelay]:
        """Per-node relays gone quiet while ranks still ran (``state/relays.py``)."""
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

    def renew_pace(self) -> None:
        """Work the step-time thresholds out from the ranks, not take the given ones (a
        ticking server's, on its slow cadence); before any rule has read them."""
        self._pace = None
        self.__dict__.pop("pace", None)

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
    def rendezvous_split(self) -> list[Difference]:
        """Rendezvous values the ranks disagree on while one is held there (``facts.launch``)."""
        return rendezvous_split(self.state, self.now, RENDEZVOUS_HOLD_S)

    @cached_property
    def signatures(self) -> dict[int, Signature | None]:
        """The knowledge base's reading of every crashed rank's error (a crashed rank is a
        finished one: the census's few, not every rank)."""
        finished = self.census.finished
        return {r.rank: explain_error(r.error) for r in finished if r.error is not None}

    @cached_property
    def cascade(self) -> Cascade:
        return find_cascade(self)

    @cached_property
    def straggle(self) -> Straggle | None:
        return find_straggle(self.census, self.now, self.collective_limit, self.th.interval)

    @cached_property
    def p2p_holds(self) -> list[P2PHold]:
        """Ranks blocked in sends or receives outside the straggle, and whom they wait for."""
        if not self.census.p2p:
            return []
        return find_p2p_holds(self.census, self.straggle, self.now, self.collective_limit)

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
