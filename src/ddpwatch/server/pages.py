"""The replies to ``status?<query>`` on the query socket (docs/status.md, "Summary and
pages"): a page of ranks or a summary, from this tick's view of the state. The request itself
is ``status.query.Query``.

At 65,536 ranks the whole status document is tens of megabytes, built every tick. A query
asks for a summary or one page of ranks instead. Each rank's state is worked out once per tick
into a ``TickView`` (one ``rank_state`` call per rank, as ``rank_entry`` makes it); filters run
on that index and full rank entries are built only for the ranks a reply holds. Replies are
cached per tick by request (``QueryCache``), like the full document.
"""

from __future__ import annotations

from collections import Counter, OrderedDict
from collections.abc import Callable, Iterable
from typing import Any

import msgspec

from ddpwatch.core.vocabulary import RANK_STATES, RankState
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.facts.census import effective_stall_after
from ddpwatch.diagnosis.facts.ranks import rank_state
from ddpwatch.server.document import document_around, missing_entry, rank_entry
from ddpwatch.state.state import ServerState
from ddpwatch.status.order import HostTally, host_rows, is_flagged, worst_ranks
from ddpwatch.status.query import Query, one_line
from ddpwatch.status.schema import (
    HistoryEntry,
    HostRow,
    PageInfo,
    PageReply,
    RankEntry,
    Refused,
    Summary,
    SummaryPageInfo,
    SummaryReply,
)

MAX_HOSTS = 1000  # hosts listed in a summary; the rest are counted in hosts_omitted
CACHED_REPLIES = 32  # per tick: a few viewers' pages and summaries


def error_reply(message: str) -> bytes:
    """The reply to a request the server cannot answer: ``{"error": "<one line>"}``."""
    return msgspec.json.encode(Refused(one_line(message, 200)))


# ------------------------------------------------------------------------------ the tick's view


class TickView:
    """Everything a query's reply needs, fixed once per tick: each rank's state, the
    document's envelope (alerts, stats, history, relays) and the alerts' culprits.

    Built in O(ranks) cheap steps (no rank entry); replies then read it. Every reply of the
    tick is as of its ``now``, and a rank's ``state`` in a reply is the one it was filtered
    by, even if its record moved on since.
    """

    def __init__(
        self,
        state: ServerState,
        alerts: list[Alert],
        now: float,
        th: Thresholds,
        history: list[HistoryEntry] | None = None,
    ) -> None:
        self.state, self.now, self.th = state, now, th
        self.stall_after = effective_stall_after(state, th)
        self.as_of, self.since = state.as_of(now), state.listening_since
        self.world_size = state.world_size
        self.states = self._rank_states()
        self.ranks = sorted(self.states)  # every rank the full document lists
        self.envelope = document_around([], state, alerts, now, history)
        self.culprits = frozenset(r for alert in alerts for r in alert.ranks)
        self.named = self.culprits | {r for alert in alerts for r in alert.waiting}

    def _rank_states(self) -> dict[int, str]:
        """Each rank's state, the one ``rank_entry`` gives it, and ``not_connected`` for the
        ranks below the world size that never reported (as ``status_document`` finds them)."""
        records, as_of, th = self.state.ranks, self.as_of, self.th
        stepping = self.state.stepping_since is not None
        states = {
            rank: rank_state(record, as_of, th, self.stall_after, self.since, stepping)
            for rank, record in records.items()
        }
        for rank in self.state.missing_ranks():
            states[rank] = RankState.NOT_CONNECTED
        return states

    def host(self, rank: int) -> str | None:
        record = self.state.ranks.get(rank)
        return None if record is None else record.host

    def matching(self, query: Query) -> list[int]:
        """The ranks that pass the query's filters, sorted."""
        ranks: Iterable[int] = self.ranks
        if query.ranks is not None:
            if len(query.ranks) < len(self.ranks):
                ranks = sorted(r for r in query.ranks if r in self.states)
            else:
                ranks = (r for r in self.ranks if r in query.ranks)
        states, hosts = query.states, query.hosts
        if states is not None:
            ranks = (r for r in ranks if self.states[r] in states)
        if hosts is not None:
            ranks = (r for r in ranks if self.host(r) in hosts)
        return list(ranks)

    def entry(self, rank: int) -> RankEntry:
        """The rank's entry in the full document's format, with the state it was indexed by."""
        record = self.state.ranks.get(rank)
        if record is None:
            return missing_entry(rank, self.world_size or 0)
        entry = rank_entry(
            record,
            self.now,
            self.th,
            self.stall_after,
            as_of=self.as_of,
            since=self.since,
            stepping=self.state.stepping_since is not None,
        )
        entry.state = self.states[rank]
        return entry

    def around(self, ranks: list[RankEntry]) -> dict[str, Any]:
        """The envelope of the full document around ``ranks``: a reply's fields but its own."""
        return {**msgspec.structs.asdict(self.envelope), "ranks": ranks}


# ------------------------------------------------------------------------------ replies


def page(view: TickView, query: Query) -> PageReply:
    """The matching ranks from ``offset``, at most ``limit`` of them."""
    matched = view.matching(query)
    chosen = matched[query.offset : query.offset + query.limit]
    return PageReply(
        **view.around([view.entry(r) for r in chosen]),
        page=PageInfo(
            view="page",
            total=len(view.ranks),
            matched=len(matched),
            offset=query.offset,
            limit=query.limit,
        ),
    )


def summary(view: TickView, query: Query) -> SummaryReply:
    """Counts by state and by host of the matching ranks, and the ``worst`` of them."""
    matched = view.matching(query)
    states = Counter(view.states[r] for r in matched)
    hosts, omitted = _host_rows(view, matched)
    worst = worst_ranks(matched, view.states, view.culprits, query.worst)
    return SummaryReply(
        **view.around([view.entry(r) for r in worst]),
        summary=Summary(
            ranks=len(matched),
            states={state: states[state] for state in RANK_STATES},
            hosts=hosts,
            hosts_omitted=omitted,
        ),
        page=SummaryPageInfo(
            view="summary", total=len(view.ranks), matched=len(matched), worst=query.worst
        ),
    )


def _host_rows(
    view: TickView, ranks: list[int], most: int = MAX_HOSTS
) -> tuple[list[HostRow], int]:
    """One row per host of ``ranks`` (``order.host_rows``), the first ``most`` hosts; and how
    many hosts were left out."""
    tallies: dict[str | None, HostTally] = {}
    records, states, named = view.state.ranks, view.states, view.named
    for rank in ranks:
        record = records.get(rank)
        host = None if record is None else record.host
        tally = tallies.get(host)
        if tally is None:
            tally = tallies[host] = HostTally(host)
        state = states[rank]
        flagged = is_flagged(state, rank in named)
        if record is None:
            tally.add(state, flagged)
        else:
            tally.add(
                state,
                flagged,
                record.step,
                record.step_time_s,
                record.mem_allocated_bytes,
                record.gpu_mem_used_bytes,
            )
    return host_rows(tallies, most)


def build_reply(view: TickView, query: Query) -> PageReply | SummaryReply:
    return summary(view, query) if query.view == "summary" else page(view, query)


class QueryCache:
    """This tick's encoded replies by request (the least recently asked dropped past
    ``size``) and its ``TickView``, made at the first query: ``clear`` at every tick."""

    def __init__(self, size: int = CACHED_REPLIES) -> None:
        self.size = size
        self._view: TickView | None = None
        self._replies: OrderedDict[bytes, bytes] = OrderedDict()

    def clear(self) -> None:
        self._view = None
        self._replies.clear()

    def get(self, request: bytes) -> bytes | None:
        reply = self._replies.get(request)
        if reply is not None:
            self._replies.move_to_end(request)
        return reply

    def answer(self, request: bytes, query: Query, make_view: Callable[[], TickView]) -> bytes:
        """The encoded reply to ``query`` (parsed from ``request``), cached for the tick."""
        reply = self.get(request)
        if reply is None:
            if self._view is None:
                self._view = make_view()
            reply = msgspec.json.encode(build_reply(self._view, query))
            self._replies[request] = reply
            if len(self._replies) > self.size:
                self._replies.popitem(last=False)
        return reply
