"""The view model: which rows the table shows, in which order, from one status document.

Pure functions over the status document's typed entries (``status.schema``; no Textual
here), so the dashboard stays a view and this logic is cheap to test and to benchmark. A row
is a rank's entry (``RankEntry``), or a host's (``HostGroup``: a summary's ``HostRow`` with
the worst-first score of its worst rank).
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeVar

import msgspec

from ddpwatch.core.ranges import rank_ranges, rank_spans
from ddpwatch.core.vocabulary import AlertKind, RankState, Severity
from ddpwatch.status import order
from ddpwatch.status.order import HostTally, state_order
from ddpwatch.status.schema import AlertEntry, HostRow, RankEntry

Row = RankEntry

STATE_TEXT: dict[str, str] = {RankState.NOT_CONNECTED: "absent"}
"""How the views write a state where it differs from its name."""


def state_text(state: str) -> str:
    """The word the views show for ``state``: its name, or "absent" for ``not_connected``."""
    return STATE_TEXT.get(state, state)


SHORT_STATE: dict[str, str] = {
    RankState.RUNNING: "run",
    RankState.WAITING: "wait",
    RankState.STALLED: "stall",
    RankState.BUSY: "busy",
    RankState.SILENT: "silent",
    RankState.CRASHED: "crash",
    RankState.EXITED: "exit",
    RankState.STOPPED: "stop",
    RankState.NOT_CONNECTED: "absent",
}

# The worst-first score of a rank, or of a host (its worst rank): 0 is the worst. Alerts and
# states share the scale, so an error alert's culprit comes before a crashed rank, a warning's
# culprit before a silent one, and so on; ``score_style`` colours it.
WORST_ERROR_CULPRIT = 0
"""Named as a culprit by an error alert."""
WORST_CRASHED = 1
"""Crashed, or exited with a non-zero code."""
WORST_WARNING_CULPRIT = 2
WORST_SILENT = 3
WORST_STALLED = 4
WORST_NOT_CONNECTED = 5
WORST_WAITING = 6
"""Waiting in a collective, or named by an alert as waiting for its culprits."""
WORST_INFO_CULPRIT = 7
WORST_RUNNING = 8
WORST_DONE = 9
"""Stopped, or exited cleanly."""
WORST_NONE = 99
"""No score yet: above every other."""

CULPRIT_SCORE: dict[str, int] = {
    Severity.ERROR: WORST_ERROR_CULPRIT,
    Severity.WARNING: WORST_WARNING_CULPRIT,
    Severity.INFO: WORST_INFO_CULPRIT,
}
"""The score an alert of each severity gives its culprits (unknown severities: info's)."""
STATE_WORST: dict[str, int] = {
    RankState.CRASHED: WORST_CRASHED,
    RankState.SILENT: WORST_SILENT,
    RankState.STALLED: WORST_STALLED,
    RankState.NOT_CONNECTED: WORST_NOT_CONNECTED,
    RankState.BUSY: WORST_WAITING,
    RankState.WAITING: WORST_WAITING,
    RankState.RUNNING: WORST_RUNNING,
    RankState.STOPPED: WORST_DONE,
    RankState.EXITED: WORST_DONE,
}
"""The worst-first score of a rank in each state (before the alerts naming it count)."""


def score_style(score: int | None) -> str | None:
    """How the table colours a worst-first score: "error" (error culprits, crashed),
    "warning" (warning culprits, silent, stalled, absent), None (the rest, or no score)."""
    if score is None:
        return None
    if score <= WORST_CRASHED:
        return "error"
    return "warning" if score <= WORST_NOT_CONNECTED else None


@dataclass
class AlertIndex:
    """What the alerts say about each rank, looked up per row."""

    culprit: dict[int, int] = field(default_factory=dict)
    """rank -> best (lowest) worst-first score an alert naming it as culprit gives."""
    waiting: set[int] = field(default_factory=set)
    waits_for: dict[int, str] = field(default_factory=dict)
    """rank -> the culprits it waits for, written short ("1", "0-2"): those of the first alert
    (the worst: diagnosis orders them) that lists it as waiting and names a culprit."""
    nan: set[int] = field(default_factory=set)
    counts: Counter[str] = field(default_factory=Counter)


WAITS_FOR_LISTED = 3
"""How many pieces of culprit ranks a victim's state cell writes ("waits for 1,4,9 +2")."""


def index_alerts(alerts: Iterable[AlertEntry]) -> AlertIndex:
    index = AlertIndex()
    victims: list[tuple[list[int], str]] = []
    for alert in alerts:
        severity = alert.severity
        index.counts[severity] += 1
        score = CULPRIT_SCORE.get(severity, WORST_INFO_CULPRIT)
        culprits = alert.ranks
        for rank in culprits:
            if score < index.culprit.get(rank, WORST_NONE):
                index.culprit[rank] = score
            if alert.kind == AlertKind.NAN_LOSS:
                index.nan.add(rank)
        waiting = alert.waiting
        index.waiting.update(waiting)
        if waiting and culprits:
            victims.append((waiting, rank_ranges(culprits, WAITS_FOR_LISTED)))
    for waiting, culprits_text in reversed(victims):  # the first alert naming a rank wins
        index.waits_for.update(dict.fromkeys(waiting, culprits_text))
    return index


def worst_score(row: Row, index: AlertIndex) -> int:
    """0 is the worst: culprits of errors, crashed, warnings' culprits, silent, ..., exited."""
    state = row.state
    score = STATE_WORST.get(state, WORST_RUNNING)
    if state == RankState.EXITED and row.exit_code not in (None, 0):
        score = WORST_CRASHED
    culprit = index.culprit.get(row.rank)
    if culprit is not None and culprit < score:
        score = culprit
    if score > WORST_WAITING and row.rank in index.waiting:
        score = WORST_WAITING
    return score


def is_flagged(row: Row, index: AlertIndex) -> bool:
    """``order.is_flagged``: named by an alert (culprit or waiting), or in an unusual state."""
    rank = row.rank
    return order.is_flagged(row.state, rank in index.culprit or rank in index.waiting)


# ----------------------------------------------------------------------------- filter

_RANGES = re.compile(r"^\s*(?:r(?:ank)?s?\s*[:=]\s*)?(.*?)\s*,?\s*$", re.DOTALL)
"""The filter box's rank list: ``r:``, ``rank=``, ``ranks:`` before it and a comma after are
allowed; the list itself is ``core.ranges``'."""


def parse_ranges(text: str) -> list[tuple[int, int]] | None:
    """ "r:0-15" or "3,5-7" -> [(0, 15)] / [(3, 3), (5, 7)]; None when ``text`` is not a range."""
    match = _RANGES.match(text)
    if match is None:
        return None
    try:
        return rank_spans(match[1], backwards=True)
    except ValueError:
        return None


def make_filter(text: str) -> Callable[[Row], bool] | None:
    """A predicate for the filter box: rank ranges, or words matching host, state or phase.

    Several words must all match (each in any of the three fields). Empty text: no filter.
    """
    text = text.strip()
    if not text:
        return None
    spans = parse_ranges(text)
    if spans is not None:
        if len(spans) == 1:
            low, high = spans[0]
            return lambda row: low <= row.rank <= high
        return lambda row: any(a <= row.rank <= b for a, b in spans)
    words = text.lower().split()

    def matches(row: Row) -> bool:
        hay = f"{row.host or ''}\n{row.state}\n{row.phase or ''}".lower()
        return all(word in hay for word in words)

    return matches


# ----------------------------------------------------------------------------- step split


SPLIT_FIELDS = ("input_wait_s", "compute_s", "grad_wait_s", "collective_time_s")
"""What ``step_split`` reads from a rank's row."""


def _seconds(value: float | None) -> float | None:
    """A finite, non-negative number of seconds, or None."""
    if value is None:
        return None
    return max(0.0, float(value)) if math.isfinite(value) else None


def step_split(row: Row) -> tuple[float, float, float] | None:
    """Where the rank's step goes, in seconds per step: (input wait, compute, waiting for the
    other ranks: in DDP's gradient all-reduce plus in collectives), or None when the rank
    reports no split (its agent times no DDP gradients: a model on a GPU, an older agent).

    ``compute_s`` is the step less the other three, so the parts add up to the step."""
    compute, grads = _seconds(row.compute_s), _seconds(row.grad_wait_s)
    if compute is None or grads is None:
        return None
    inputs = _seconds(row.input_wait_s) or 0.0  # None: no DataLoader batch timed
    wait = grads + (_seconds(row.collective_time_s) or 0.0)
    if inputs + compute + wait <= 0:
        return None
    return inputs, compute, wait


def wait_fraction(row: Row) -> float | None:
    """The share of the rank's step spent waiting for the others, or None without a split."""
    split = step_split(row)
    return None if split is None else split[2] / sum(split)


def job_wait_fraction(ranks: Iterable[Row]) -> float | None:
    """The share of the job's step time lost waiting: the ranks' waits over their steps (each
    step the sum of its split), over the ranks that report a split; None when none does."""
    waited = total = 0.0
    for row in ranks:
        split = None if row.compute_s is None else step_split(row)
        if split is not None:
            waited += split[2]
            total += sum(split)
    return waited / total if total > 0 else None


# ----------------------------------------------------------------------------- sort


def _collective_age(row: Row) -> float | None:
    return None if row.collective is None else row.collective.since_s


def _gpu_fraction(row: Row) -> float | None:
    used, total = row.gpu_mem_used_bytes, row.gpu_mem_total_bytes
    return used / total if used is not None and total else None


SORT_VALUES: dict[str, Callable[[Row], Any]] = {
    "rank": lambda r: r.rank,
    "local_rank": lambda r: r.local_rank,
    "host": lambda r: r.host,
    "pid": lambda r: r.pid,
    "device": lambda r: r.device,
    "state": lambda r: state_order(r.state),
    "phase": lambda r: r.phase,
    "step": lambda r: r.step,
    "loss": lambda r: r.loss,
    "step_time": lambda r: r.step_time_s,
    "data_wait": lambda r: r.data_wait_s,
    "split": wait_fraction,
    "collective": _collective_age,
    "mem": lambda r: r.mem_allocated_bytes,
    "gpu": _gpu_fraction,
    "seen": lambda r: r.last_seen_s,
}


class HostGroup(HostRow, kw_only=True):
    """A host's row in the table (``g``): its summary row (``order.HostTally``; the host
    ``"?"`` for ranks without one) and ``worst``, the worst-first score of its worst rank."""

    worst: int = WORST_NONE


GROUP_SORT_VALUES: dict[str, Callable[[HostGroup], Any]] = {
    "host": lambda g: g.host,
    "ranks": lambda g: g.ranks,
    "states": lambda g: g.worst,
    "steps": lambda g: g.step_min,
    "step_time": lambda g: g.step_time_max_s,
    "mem": lambda g: g.mem_allocated_sum_bytes,
    "flagged": lambda g: g.flagged,
}

WORST = "worst"
R = TypeVar("R", RankEntry, HostGroup)


def sort_rows(
    rows: list[R], key: Callable[[R], Any], reverse: bool, tie: Callable[[R], Any]
) -> list[R]:
    """Sort by ``key`` (unknown values last in either direction), ties by ``tie``."""
    known = [r for r in rows if key(r) is not None]
    unknown = [r for r in rows if key(r) is None]
    known.sort(key=tie)
    known.sort(key=key, reverse=reverse)  # stable: ties keep the ``tie`` order
    unknown.sort(key=tie)
    return known + unknown


@dataclass(frozen=True)
class TableQuery:
    """What the user asked the table to show."""

    sort: str = WORST
    reverse: bool = False
    filter: str = ""
    flagged: bool = False
    grouped: bool = False


def select_rows(ranks: Sequence[Row], query: TableQuery, index: AlertIndex) -> list[Row]:
    """The rank rows to show, filtered and ordered (default: worst first, then rank)."""
    predicate = make_filter(query.filter)
    rows: list[Row] = list(ranks)
    if predicate is not None:
        rows = [r for r in rows if predicate(r)]
    if query.flagged:
        rows = [r for r in rows if is_flagged(r, index)]
    if query.sort == WORST or query.sort not in SORT_VALUES:
        rows = worst_first(rows, index)
        if query.reverse:
            rows.reverse()
        return rows
    return sort_rows(rows, SORT_VALUES[query.sort], query.reverse, lambda r: r.rank)


def worst_first(rows: Sequence[Row], index: AlertIndex) -> list[Row]:
    """Worst score first, then state, then rank.

    Most rows of a big job are running and named by no alert: they keep the
    document's order (the contract sorts ``ranks`` by rank), and only the others
    are scored and sorted, so 8,192 healthy ranks cost one pass, not 8,192 key calls.
    """
    named = index.culprit.keys() | index.waiting
    plain: list[Row] = []
    special: list[Row] = []
    for row in rows:
        if row.state == RankState.RUNNING and row.rank not in named:
            plain.append(row)
        else:
            special.append(row)
    special.sort(key=lambda r: (worst_score(r, index), state_order(r.state), r.rank))
    cut = next(
        (i for i, row in enumerate(special) if worst_score(row, index) > WORST_RUNNING),
        len(special),
    )
    return special[:cut] + plain + special[cut:]


# ----------------------------------------------------------------------------- group by host


def group_by_host(ranks: Iterable[Row], index: AlertIndex) -> list[HostGroup]:
    """One row per host (``order.HostTally``: rank count, states, min-max step, max step
    time, memory), in the order the hosts come, each with its worst rank's score."""
    tallies: dict[str, HostTally] = {}
    worst: dict[str, int] = {}
    for row in ranks:
        host = row.host or "?"
        tally = tallies.get(host)
        if tally is None:
            tally = tallies[host] = HostTally(host)
        tally.add(
            row.state or RankState.NOT_CONNECTED,
            is_flagged(row, index),
            row.step,
            row.step_time_s,
            row.mem_allocated_bytes,
            row.gpu_mem_used_bytes,
        )
        worst[host] = min(worst.get(host, WORST_NONE), worst_score(row, index))
    return [host_group(tally.row(), worst[host]) for host, tally in tallies.items()]


def host_group(row: HostRow, worst: int) -> HostGroup:
    """A summary's host row as the table's, with ``worst``; the host ``"?"`` when it has none."""
    fields = msgspec.structs.asdict(row)
    fields["host"] = row.host or "?"
    return HostGroup(**fields, worst=worst)


def select_groups(
    ranks: Sequence[Row], query: TableQuery, index: AlertIndex
) -> list[HostGroup]:
    """Host rows for the grouped view (the filter and ``flagged`` apply to ranks first)."""
    predicate = make_filter(query.filter)
    rows: Iterable[Row] = ranks
    if predicate is not None:
        rows = [r for r in rows if predicate(r)]
    if query.flagged:
        rows = [r for r in rows if is_flagged(r, index)]
    return order_groups(group_by_host(rows, index), query)


def order_groups(groups: list[HostGroup], query: TableQuery) -> list[HostGroup]:
    """Host rows in the query's order: by a host column, else worst first, then by name."""
    if query.sort in GROUP_SORT_VALUES:
        return sort_rows(groups, GROUP_SORT_VALUES[query.sort], query.reverse, lambda g: g.host)
    groups.sort(key=lambda g: (g.worst, g.host or ""), reverse=query.reverse)
    return groups


def state_summary(states: dict[str, int]) -> str:
    """Counter({"running": 14, "crashed": 1}) -> "1 crash 14 run" (worst first)."""
    return " ".join(
        f"{n} {SHORT_STATE.get(s, s)}"
        for s, n in sorted(states.items(), key=lambda kv: state_order(kv[0]))
    )
