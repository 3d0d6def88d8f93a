"""A large job on the dashboard: what it asks the server for, and its host rows.

Past ``sources.PAGED_ABOVE`` ranks the dashboard holds a summary (``status?view=summary``),
not every rank: counts for the whole job and its worst ranks. So the filter box becomes a
server-side ``scope`` where it names ranks, a host or a state (the worst ranks *of those*
come back), and the host view (``g``) reads the server's per-host rows, which count every
rank, instead of grouping the few ranks it holds.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterable
from typing import Any

from ddpwatch.core.ranges import MAX_PARSED_RANKS
from ddpwatch.core.vocabulary import RANK_STATES
from ddpwatch.status.query import Query
from ddpwatch.tui.model import (
    STATE_WORST,
    WORST_NONE,
    WORST_RUNNING,
    AlertIndex,
    Row,
    TableQuery,
    order_groups,
    parse_ranges,
    worst_score,
)


def is_summary(document: dict[str, Any] | None) -> bool:
    """A summary reply (a large job), not the whole document."""
    return isinstance((document or {}).get("summary"), dict)


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


def host_names(document: dict[str, Any] | None) -> list[str]:
    """The hosts a summary lists (the whole job's, not a scope's)."""
    counts = (document or {}).get("summary")
    rows = counts.get("hosts") if isinstance(counts, dict) else None
    return [h["host"] for h in rows or () if isinstance(h, dict) and isinstance(h.get("host"), str)]


def summary_groups(document: dict[str, Any], index: AlertIndex) -> list[Row]:
    """One row per host, from the summary's host rows (of the scope, when it has one), in the
    shape ``model.group_by_host`` makes. A host's worst score comes from the states it has and
    from its ranks the summary lists (the worst ranks, alert culprits among them)."""
    counts = document.get("scope") or document.get("summary") or {}
    listed: dict[str, int] = {}
    for row in document.get("ranks") or ():
        host = row.get("host") or "?"
        listed[host] = min(listed.get(host, WORST_NONE), worst_score(row, index))
    groups = []
    for entry in counts.get("hosts") or ():
        if not isinstance(entry, dict):
            continue
        host = entry.get("host") or "?"
        states = Counter(_counts(entry.get("states")))
        worst = min((STATE_WORST.get(s, WORST_RUNNING) for s in states), default=WORST_NONE)
        groups.append(
            {
                "host": host,
                "count": _number(entry.get("ranks")) or 0,
                "states": states,
                "step_min": _number(entry.get("step_min")),
                "step_max": _number(entry.get("step_max")),
                "step_time_max": _number(entry.get("step_time_max_s")),
                "mem_sum": _number(entry.get("mem_allocated_sum_bytes")),
                "flagged": _number(entry.get("flagged")) or 0,
                "worst": min(worst, listed.get(host, WORST_NONE)),
            }
        )
    return groups


def select_summary_groups(
    document: dict[str, Any], query: TableQuery, index: AlertIndex
) -> list[Row]:
    """Host rows for the host view of a large job: filter words match the host's name and
    states (the scope did rank ranges on the server), ``flagged`` keeps hosts with flagged
    ranks; ordered as the other host rows (``model.order_groups``)."""
    groups = summary_groups(document, index)
    matches = _host_filter(query.filter)
    if matches is not None:
        groups = [g for g in groups if matches(g)]
    if query.flagged:
        groups = [g for g in groups if g["flagged"]]
    return order_groups(groups, query)


def _host_filter(text: str) -> Callable[[Row], bool] | None:
    text = text.strip()
    if not text or parse_ranges(text) is not None:
        return None
    words = text.lower().split()

    def matches(group: Row) -> bool:
        hay = "\n".join([group["host"], *group["states"]]).lower()
        return all(word in hay for word in words)

    return matches


def _counts(states: Any) -> dict[str, int]:
    """``{state: ranks}`` as sent, with anything that is not a count left out."""
    if not isinstance(states, dict):
        return {}
    return {str(s): n for s, n in states.items() if isinstance(n, int) and n > 0}


def _number(value: Any) -> Any:
    """A number as sent; None for anything else (a remote server's reply is not trusted)."""
    return value if isinstance(value, (int, float)) and not isinstance(value, bool) else None
