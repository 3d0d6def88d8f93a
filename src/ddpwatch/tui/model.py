"""The view model: which rows the table shows, in which order, from one status document.

Pure functions over the status document's plain dicts (no Textual here), so the
dashboard stays a view and this logic is cheap to test and to benchmark.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from ddpwatch.core.ranges import rank_ranges, rank_spans
from ddpwatch.core.vocabulary import AlertKind, RankState, Severity
from ddpwatch.status import order
from ddpwatch.status.order import state_order

Row = dict[str, Any]

STATE_TEXT = {RankState.NOT_CONNECTED: "absent"}
"""How the views write a state where it differs from its name."""


def state_text(state: str) -> str:
    """The word the views show for ``state``: its name, or "absent" for ``not_connected``."""
    return STATE_TEXT.get(state, state)


SHORT_STATE = {
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

CULPRIT_SCORE = {
    Severity.ERROR: WORST_ERROR_CULPRIT,
    Severity.WARNING: WORST_WARNING_CULPRIT,
    Severity.INFO: WORST_INFO_CULPRIT,
}
"""The score an alert of each severity gives its culprits (unknown severities: info's)."""
STATE_WORST = {
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


def index_alerts(alerts: Iterable[dict[str, Any]]) -> AlertIndex:
    index = AlertIndex()
    victims: list[tuple[Any, str]] = []
    for alert in alerts:
        severity = alert.get("severity", Severity.INFO)
        index.counts[severity] += 1
        score = CULPRIT_SCORE.get(severity, WORST_INFO_CULPRIT)
        culprits = alert.get("ranks") or ()
        for rank in culprits:
            if score < index.culprit.get(rank, WORST_NONE):
                index.culprit[rank] = score
            if alert.get("kind") == AlertKind.NAN_LOSS:
                index.nan.add(rank)
        waiting = alert.get("waiting") or ()
        index.waiting.update(waiting)
        if waiting and culprits:
            victims.append((waiting, rank_ranges(culprits, WAITS_FOR_LISTED)))
    for waiting, culprits_text in reversed(victims):  # the first alert naming a rank wins
        index.waits_for.update(dict.fromkeys(waiting, culprits_text))
    return index


def worst_score(row: Row, index: AlertIndex) -> int:
    """0 is the worst: culprits of errors, crashed, warnings' culprits, silent, ..., exited."""
    state: str = row.get("state") or ""  # "": a row without one, which scores as running
    score = STATE_WORST.get(state, WORST_RUNNING)
    if state == RankState.EXITED and row.get("exit_code") not in (None, 0):
        score = WORST_CRASHED
    culprit = index.culprit.get(row["rank"])
    if culprit is not None and culprit < score:
        score = culprit
    if score > WORST_WAITING and row["rank"] in index.waiting:
        score = WORST_WAITING
    return score


def is_flagged(row: Row, index: AlertIndex) -> bool:
    """``order.is_flagged``: named by an alert (culprit or waiting), or in an unusual state."""
    rank = row["rank"]
    return order.is_flagged(row.get("state"), rank in index.culprit or rank in index.waiting)


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
            return lambda row: low <= row["rank"] <= high
        return lambda row: any(a <= row["rank"] <= b for a, b in spans)
    words = text.lower().split()

    def matches(row: Row) -> bool:
        hay = f"{row.get('host') or ''}\n{row.get('state') or ''}\n{row.get('phase') or ''}".lower()
        return all(word in hay for word in words)

    return matches


# ----------------------------------------------------------------------------- step split


SPLIT_FIELDS = ("input_wait_s", "compute_s", "grad_wait_s", "collective_time_s")
"""What ``step_split`` reads from a rank's row."""


def _seconds(value: Any) -> float | None:
    """A finite, non-negative number of seconds, or None."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return None
    return max(0.0, float(value)) if math.isfinite(value) else None


def step_split(row: Row) -> tuple[float, float, float] | None:
    """Where the rank's step goes, in seconds per step: (input wait, compute, waiting for the
    other ranks: in DDP's gradient all-reduce plus in collectives), or None when the rank
    reports no split (its agent times no DDP gradients: a model on a GPU, an older agent).

    ``compute_s`` is the step less the other three, so the parts add up to the step."""
    compute, grads = _seconds(row.get("compute_s")), _seconds(row.get("grad_wait_s"))
    if compute is None or grads is None:
        return None
    inputs = _seconds(row.get("input_wait_s")) or 0.0  # None: no DataLoader batch timed
    wait = grads + (_seconds(row.get("collective_time_s")) or 0.0)
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
        split = None if row.get("compute_s") is None else step_split(row)
        if split is not None:
            waited += split[2]
            total += sum(split)
    return waited / total if total > 0 else None


# ----------------------------------------------------------------------------- sort


def _collective_age(row: Row) -> float | None:
    coll = row.get("collective")
    return coll.get("since_s") if coll else None


def _gpu_fraction(row: Row) -> float | None:
    used, total = row.get("gpu_mem_used_bytes"), row.get("gpu_mem_total_bytes")
    return used / total if used is not None and total else None


SORT_VALUES: dict[str, Callable[[Row], Any]] = {
    "rank": lambda r: r["rank"],
    "local_rank": lambda r: r.get("local_rank"),
    "host": lambda r: r.get("host"),
    "pid": lambda r: r.get("pid"),
    "device": lambda r: r.get("device"),
    "state": lambda r: state_order(r.get("state")),
    "phase": lambda r: r.get("phase"),
    "step": lambda r: r.get("step"),
    "loss": lambda r: r.get("loss"),
    "step_time": lambda r: r.get("step_time_s"),
    "data_wait": lambda r: r.get("data_wait_s"),
    "split": wait_fraction,
    "collective": _collective_age,
    "mem": lambda r: r.get("mem_allocated_bytes"),
    "gpu": _gpu_fraction,
    "seen": lambda r: r.get("last_seen_s"),
}

GROUP_SORT_VALUES: dict[str, Callable[[Row], Any]] = {
    "host": lambda g: g["host"],
    "ranks": lambda g: g["count"],
    "states": lambda g: g["worst"],
    "steps": lambda g: g["step_min"],
    "step_time": lambda g: g["step_time_max"],
    "mem": lambda g: g["mem_sum"],
    "flagged": lambda g: g["flagged"],
}

WORST = "worst"


def sort_rows(
    rows: list[Row], key: Callable[[Row], Any], reverse: bool, tie: Callable[[Row], Any]
) -> list[Row]:
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
    return sort_rows(rows, SORT_VALUES[query.sort], query.reverse, lambda r: r["rank"])


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
        if row.get("state") == RankState.RUNNING and row["rank"] not in named:
            plain.append(row)
        else:
            special.append(row)
    special.sort(key=lambda r: (worst_score(r, index), state_order(r.get("state")), r["rank"]))
    cut = next(
        (i for i, row in enumerate(special) if worst_score(row, index) > WORST_RUNNING),
        len(special),
    )
    return special[:cut] + plain + special[cut:]


# ----------------------------------------------------------------------------- group by host


def group_by_host(ranks: Iterable[Row], index: AlertIndex) -> list[Row]:
    """One row per host: rank count, states, min-max step, max step time, memory sum."""
    groups: dict[str, Row] = {}
    for row in ranks:
        host = row.get("host") or "?"
        group = groups.get(host)
        if group is None:
            group = groups[host] = {
                "host": host,
                "count": 0,
                "states": Counter(),
                "step_min": None,
                "step_max": None,
                "step_time_max": None,
                "mem_sum": None,
                "flagged": 0,
                "worst": WORST_NONE,
                "ranks": [],
            }
        group["count"] += 1
        state = row.get("state") or RankState.NOT_CONNECTED
        group["states"][state] += 1
        group["ranks"].append(row["rank"])
        step = row.get("step")
        if step is not None:
            group["step_min"] = step if group["step_min"] is None else min(group["step_min"], step)
            group["step_max"] = step if group["step_max"] is None else max(group["step_max"], step)
        st = row.get("step_time_s")
        if st is not None and (group["step_time_max"] is None or st > group["step_time_max"]):
            group["step_time_max"] = st
        mem = row.get("mem_allocated_bytes")
        if mem is not None:
            group["mem_sum"] = (group["mem_sum"] or 0) + mem
        if is_flagged(row, index):
            group["flagged"] += 1
        group["worst"] = min(group["worst"], worst_score(row, index))
    return list(groups.values())


def select_groups(ranks: Sequence[Row], query: TableQuery, index: AlertIndex) -> list[Row]:
    """Host rows for the grouped view (the filter and ``flagged`` apply to ranks first)."""
    predicate = make_filter(query.filter)
    rows: Iterable[Row] = ranks
    if predicate is not None:
        rows = [r for r in rows if predicate(r)]
    if query.flagged:
        rows = [r for r in rows if is_flagged(r, index)]
    return order_groups(group_by_host(rows, index), query)


def order_groups(groups: list[Row], query: TableQuery) -> list[Row]:
    """Host rows in the query's order: by a host column, else worst first, then by name."""
    if query.sort in GROUP_SORT_VALUES:
        return sort_rows(groups, GROUP_SORT_VALUES[query.sort], query.reverse, lambda g: g["host"])
    groups.sort(key=lambda g: (g["worst"], g["host"]), reverse=query.reverse)
    return groups


def state_summary(states: Counter[str]) -> str:
    """Counter({"running": 14, "crashed": 1}) -> "1 crash 14 run" (worst first)."""
    return " ".join(
        f"{n} {SHORT_STATE.get(s, s)}"
        for s, n in sorted(states.items(), key=lambda kv: state_order(kv[0]))
    )
