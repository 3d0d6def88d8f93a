"""A large job on the dashboard: what it asks the server for, and its host rows.

Past ``sources.PAGED_ABOVE`` ranks the dashboard holds a summary (``status?view=summary``),
not every rank: counts for the whole job and its worst ranks. So the filter box becomes a
server-side ``scope`` where it names ranks, a host or a state (the worst ranks *of those*
come back), and the host view (``g``) reads the server's per-host rows, which count every
rank, instead of grouping the few ranks it holds.
"""

from __future__ import annotations

from collections.abc import Callable, Iterable

from ddpwatch.core.ranges import MAX_PARSED_RANKS
from ddpwatch.core.vocabulary import RANK_STATES
from ddpwatch.status.query import Query
from ddpwatch.status.schema import UNSET, StatusDocument, SummaryReply
from ddpwatch.tui.data.model import (
    STATE_WORST,
    WORST_NONE,
    WORST_RUNNING,
    AlertIndex,
    HostGroup,
    TableQuery,
    host_group,
    order_groups,
    parse_ranges,
    worst_score,
)


def is_summary(document: StatusDocument | None) -> bool:
    """A summary reply (a large job), not the whole document."""
    return isinstance(document, SummaryReply)


def scope_of(text: str, hosts: Iterable[str]) -> Query | None:
    """The server-side filter for the filter box's ``text``: its rank ranges, a host's exact
    name (enter on a host row types it) or a rank state's name; None for anything else (and
    for more ranks than a query may name), which the dashboard matches among the ranks it
    holds."""
    text = text.strip()
    if not text:
        return None
    spans = parse_ranges(text)
    if spans is not None:
        if sum(last - first + 1 for first, last in spans) > MAX_PARSED_RANKS:
            return None
        return Query(ranks=frozenset(r for first, last in spans for r in range(first, last + 1)))
    if text in set(hosts):
        return Query(hosts=frozenset({text}))
    if text in RANK_STATES:
        return Query(states=frozenset({text}))
    return None


def host_names(document: StatusDocument | None) -> list[str]:
    """The hosts a summary lists (the whole job's, not a scope's)."""
    if not isinstance(document, SummaryReply):
        return []
    return [h.host for h in document.summary.hosts if h.host is not None]


def summary_groups(document: SummaryReply, index: AlertIndex) -> list[HostGroup]:
    """One row per host, from the summary's host rows (of the scope, when it has one), as
    ``model.group_by_host`` makes them. A host's worst score comes from the states it has and
    from its ranks the summary lists (the worst ranks, alert culprits among them)."""
    counts = document.scope if document.scope is not UNSET else document.summary
    listed: dict[str, int] = {}
    for row in document.ranks:
        host = row.host or "?"
        listed[host] = min(listed.get(host, WORST_NONE), worst_score(row, index))
    groups = []
    for entry in counts.hosts:
        host = entry.host or "?"
        worst = min((STATE_WORST.get(s, WORST_RUNNING) for s in entry.states), default=WORST_NONE)
        groups.append(host_group(entry, min(worst, listed.get(host, WORST_NONE))))
    return groups


def select_summary_groups(
    document: SummaryReply, query: TableQuery, index: AlertIndex
) -> list[HostGroup]:
    """Host rows for the host view of a large job: filter words match the host's name and
    states (the scope did rank ranges on the server), ``flagged`` keeps hosts with flagged
    ranks; ordered as the other host rows (``model.order_groups``)."""
    groups = summary_groups(document, index)
    matches = _host_filter(query.filter)
    if matches is not None:
        groups = [g for g in groups if matches(g)]
    if query.flagged:
        groups = [g for g in groups if g.flagged]
    return order_groups(groups, query)


def _host_filter(text: str) -> Callable[[HostGroup], bool] | None:
    text = text.strip()
    if not text or parse_ranges(text) is not None:
        return None
    words = text.lower().split()

    def matches(group: HostGroup) -> bool:
        hay = "\n".join([group.host or "?", *group.states]).lower()
        return all(word in hay for word in words)

    return matches
