"""The rank table's columns: cell formatters, what each reads, and the layout by width.

Each ``Column`` declares the row fields its cell reads (``fields``) and the per-rank alert
lookups it makes (``alerts``). The table caches each drawn row under ``row_signature``,
built from the visible columns' declarations, so a cell can only show stale text if it
reads something it does not declare; ``tests/tui/test_tui_columns.py`` checks that none does.

Columns collapse by priority when the terminal is narrow: rank, state, phase, step and
collective always stay; the rest appear as width allows. ``sim`` and ``split`` are shown only
when some rank has one (a simulated rank, a step split).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from operator import attrgetter
from typing import Any, Generic, TypeVar

import msgspec
from rich.cells import cell_len

from ddpwatch.core.vocabulary import RANK_STATES, RankState
from ddpwatch.status.fmt import NA, human_bytes, short_seconds
from ddpwatch.status.order import state_order
from ddpwatch.tui.data.model import (
    SPLIT_FIELDS,
    AlertIndex,
    HostGroup,
    Row,
    score_style,
    state_summary,
    state_text,
    step_split,
)
from ddpwatch.tui.widgets.fmt import DASH, bar, loss_text

Span = tuple[str, str | None]
Cell = tuple[str | list[Span], str | None]
"""Text and the name of its style (a ``rank-table--<name>`` component class, or None);
the text may be a list of (text, style name) spans instead, for cells of several colours."""


def style_class(name: str) -> str:
    """The component class the rank table styles a cell style ``name`` with."""
    return f"rank-table--{name}"


def state_style(state: str) -> str:
    """The style name of a rank state ("not_connected" -> "not-connected")."""
    return state.replace("_", "-")


CELL_STYLES = frozenset(
    {*(state_style(state) for state in RANK_STATES), "error", "warning", "dim", "sim", "bar"}
)
"""Every style name a cell may give: ``RankTable`` has a component class for each."""

ALERT_LOOKUPS: dict[str, Callable[[AlertIndex, Any], Hashable]] = {
    "culprit": lambda index, rank: index.culprit.get(rank),
    "waiting": lambda index, rank: rank in index.waiting,
    "waits_for": lambda index, rank: index.waits_for.get(rank),
    "nan": lambda index, rank: rank in index.nan,
}
"""What a cell may ask the ``AlertIndex`` about its row's rank, by name (``Column.alerts``)."""


R = TypeVar("R", Row, HostGroup)


@dataclass(frozen=True)
class Column(Generic[R]):
    key: str
    """Also the sort key (see ``model.SORT_VALUES`` / ``GROUP_SORT_VALUES``)."""
    title: str
    width: int
    priority: int
    """Lower stays longer when the table is narrow; 0 never collapses."""
    cell: Callable[[R, AlertIndex, int], Cell]
    """Formats the row's cell for a given width."""
    fields: tuple[str, ...]
    """Every row field ``cell`` reads: the row's cache key is made of these."""
    alerts: tuple[str, ...] = ()
    """The ``ALERT_LOOKUPS`` ``cell`` makes for the row's rank."""
    right: bool = False
    grow: int = 0
    """How many extra cells this column may take when there is room."""


# ----------------------------------------------------------------------------- rank cells


def _rank(row: Row, index: AlertIndex, width: int) -> Cell:
    return str(row.rank), score_style(index.culprit.get(row.rank))


def _sim(row: Row, index: AlertIndex, width: int) -> Cell:
    return ("sim", "sim") if row.simulated else ("", None)


def _plain(field: str) -> Callable[[Row, AlertIndex, int], Cell]:
    value_of = attrgetter(field)

    def cell(row: Row, index: AlertIndex, width: int) -> Cell:
        value = value_of(row)
        return (NA, "dim") if value is None else (str(value), None)

    return cell


CULPRIT_MARK = "▶"
"""Before the state of a rank an open alert names as its culprit: ``▶ culprit``, ``▶ crashed``."""
CULPRIT = "culprit"
"""What a culprit's state cell says where its own state would look healthy: ``running`` (a
straggler runs while its peers wait for it)."""
HIDDEN_BY_CULPRIT = frozenset({RankState.RUNNING})
VICTIM_STATES = frozenset({RankState.RUNNING, RankState.WAITING, RankState.STALLED, RankState.BUSY})
"""States that a victim's state cell replaces with ``waits for <culprits>``: the rank is alive
and held by them (a victim that crashed or exited keeps saying so)."""
WAITS_FOR = "waits for "


def _state(row: Row, index: AlertIndex, width: int) -> Cell:
    """The rank's state; a culprit's marked ``▶`` (``▶ culprit`` where its state looks healthy);
    a live rank that an alert lists as waiting for culprits: ``waits for 1``."""
    state = row.state or RankState.NOT_CONNECTED
    if state == RankState.EXITED and row.exit_code not in (None, 0):
        text, style = f"exit {row.exit_code}", state_style(RankState.CRASHED)
    else:
        text, style = state_text(state), state_style(state)
    rank = row.rank
    score = index.culprit.get(rank)
    if score is not None:
        mark = score_style(score)
        if state in HIDDEN_BY_CULPRIT:
            return [(f"{CULPRIT_MARK} ", mark), (CULPRIT, mark or style)], mark or style
        return [(f"{CULPRIT_MARK} ", mark), (text, style)], style
    culprits = index.waits_for.get(rank)
    if culprits is not None and state in VICTIM_STATES:
        return f"{WAITS_FOR}{culprits}", style
    return text, style


def state_width(index: AlertIndex, low: int = 7, high: int = 20) -> int:
    """The state column's width for the alerts of ``index``: room for ``▶ culprit`` and the
    longest ``waits for …`` when some rank needs it."""
    width = low
    if index.culprit:
        width = max(width, cell_len(f"{CULPRIT_MARK} {CULPRIT}"))
    if index.waits_for:
        longest = max(map(len, set(index.waits_for.values())))
        width = max(width, len(WAITS_FOR) + longest)
    return min(width, high)


def _loss(row: Row, index: AlertIndex, width: int) -> Cell:
    loss = row.loss
    if loss is None:
        return ("nan", "error") if row.rank in index.nan else (NA, "dim")
    return loss_text(loss), None


def _secs(field: str) -> Callable[[Row, AlertIndex, int], Cell]:
    value_of = attrgetter(field)

    def cell(row: Row, index: AlertIndex, width: int) -> Cell:
        value = value_of(row)
        return (NA, "dim") if value is None else (short_seconds(value), None)

    return cell


def _collective(row: Row, index: AlertIndex, width: int) -> Cell:
    coll = row.collective
    if coll is None:
        return "", None
    name = coll.op or "?"
    if coll.seq is not None:
        name += f" #{coll.seq}"
    peer = getattr(coll, "peer", None)
    if peer is not None:  # a send or a receive: the rank it waits for
        name += f" {'from' if name.endswith('recv') else 'to'} {peer}"
    since = coll.since_s or 0.0
    age = short_seconds(since)
    room = width - len(age) - 1
    if len(name) > room:
        name = name[: max(0, room - 1)] + "…"
    style = "error" if since >= 30 else "warning" if since >= 5 else None
    return f"{name} {age}".strip(), style


def _mem(row: Row, index: AlertIndex, width: int) -> Cell:
    alloc, reserved = row.mem_allocated_bytes, row.mem_reserved_bytes
    if alloc is None and reserved is None:
        return NA, "dim"
    return f"{human_bytes(alloc)}/{human_bytes(reserved)}", None


def _gpu(row: Row, index: AlertIndex, width: int) -> Cell:
    used, total = row.gpu_mem_used_bytes, row.gpu_mem_total_bytes
    if used is None or not total:
        return NA, "dim"
    fraction = used / total
    pct = f"{min(fraction, 9.99) * 100:3.0f}%"
    style = "error" if fraction >= 0.95 else "warning" if fraction >= 0.85 else "bar"
    cells = max(1, width - 5)
    filled = bar(fraction, cells).rstrip("·")
    track = "·" * (cells - cell_len(filled))
    return [(filled, style), (track, "dim"), (f" {pct}", None)], style


SPLIT_MARKS = (("▒", "warning"), ("█", "bar"), ("░", "dim"))
"""The step split's bar: input wait, compute, waiting for the others (glyph, style): told
apart without colour."""
SPLIT_PCT = 5
"""Cells after the bar: " 31%" (the wait's share of the step), " 100%" at most."""


def split_cells(parts: Sequence[float], cells: int) -> list[int]:
    """How many of ``cells`` each part takes, in proportion (largest remainders), summing to
    ``cells``."""
    total = sum(parts)
    exact = [part / total * cells for part in parts]
    counts = [int(x) for x in exact]
    by_remainder = sorted(range(len(parts)), key=lambda i: counts[i] - exact[i])
    for i in by_remainder[: cells - sum(counts)]:
        counts[i] += 1
    return counts


def _split(row: Row, index: AlertIndex, width: int) -> Cell:
    """``▒███░░  31%``: input wait, compute and waiting for the others in proportion, and
    the wait's share of the step; empty for a rank that reports no split."""
    split = step_split(row)
    if split is None:
        return "", None
    counts = split_cells(split, max(1, width - SPLIT_PCT))
    spans: list[Span] = [
        (mark * n, style) for (mark, style), n in zip(SPLIT_MARKS, counts, strict=True) if n
    ]
    spans.append((f" {round(100 * split[2] / sum(split)):3d}%", None))
    return spans, None


def _seen(row: Row, index: AlertIndex, width: int) -> Cell:
    value = row.last_seen_s
    if value is None:
        return NA, "dim"
    return short_seconds(value), "error" if row.state == RankState.SILENT else None


def _plain_column(key: str, title: str, width: int, priority: int, **options: Any) -> Column[Row]:
    """A column showing the row's ``key`` as it is."""
    return Column(key, title, width, priority, _plain(key), (key,), **options)


RANK_COLUMNS: tuple[Column[Row], ...] = (
    Column("rank", "rank", 4, 0, _rank, ("rank",), alerts=("culprit",), right=True),
    Column("sim", "", 3, 1, _sim, ("simulated",)),
    _plain_column("local_rank", "lr", 3, 6, right=True),
    _plain_column("host", "host", 6, 1),
    _plain_column("pid", "pid", 7, 7, right=True),
    _plain_column("device", "device", 7, 4, grow=2),
    Column(
        "state",
        "state",
        7,
        0,
        _state,
        ("state", "exit_code", "rank"),
        alerts=("culprit", "waits_for"),
    ),
    _plain_column("phase", "phase", 9, 0, grow=3),
    _plain_column("step", "step", 7, 0, right=True),
    Column("loss", "loss", 7, 3, _loss, ("loss", "rank"), alerts=("nan",), right=True),
    Column("step_time", "step t", 6, 1, _secs("step_time_s"), ("step_time_s",), right=True),
    Column("data_wait", "data", 6, 6, _secs("data_wait_s"), ("data_wait_s",), right=True),
    Column("split", "step split", 11, 4, _split, SPLIT_FIELDS, grow=4),
    Column("collective", "collective", 21, 0, _collective, ("collective",), grow=9),
    Column(
        "mem",
        "alloc/rsvd",
        11,
        4,
        _mem,
        ("mem_allocated_bytes", "mem_reserved_bytes"),
        right=True,
    ),
    Column("gpu", "gpu mem", 10, 5, _gpu, ("gpu_mem_used_bytes", "gpu_mem_total_bytes"), grow=6),
    Column("seen", "seen", 5, 1, _seen, ("last_seen_s", "state"), right=True),
)

FINISHED_FIELDS = ("state", "exit_code")
"""What ``finished`` reads: the table draws a finished rank's whole row dimmed."""


def finished(row: Row) -> bool:
    """A rank that exited cleanly (or with no code known)."""
    return row.state == RankState.EXITED and row.exit_code in (None, 0)


# ----------------------------------------------------------------------------- host cells


def _group_host(row: HostGroup, index: AlertIndex, width: int) -> Cell:
    return row.host or "?", score_style(row.worst)


def _group_states(row: HostGroup, index: AlertIndex, width: int) -> Cell:
    worst = min(row.states, key=state_order, default=RankState.RUNNING)
    return state_summary(row.states), state_style(worst)


def _group_steps(row: HostGroup, index: AlertIndex, width: int) -> Cell:
    low, high = row.step_min, row.step_max
    if low is None:
        return NA, "dim"
    return (str(low), None) if low == high else (f"{low}{DASH}{high}", "warning")


def _group_ranks(row: HostGroup, index: AlertIndex, width: int) -> Cell:
    return str(row.ranks), None


def _group_flagged(row: HostGroup, index: AlertIndex, width: int) -> Cell:
    return str(row.flagged) if row.flagged else "", "warning"


def _group_step_time(row: HostGroup, index: AlertIndex, width: int) -> Cell:
    return short_seconds(row.step_time_max_s), None


def _group_mem(row: HostGroup, index: AlertIndex, width: int) -> Cell:
    return human_bytes(row.mem_allocated_sum_bytes), None


GROUP_COLUMNS: tuple[Column[HostGroup], ...] = (
    Column("host", "host", 10, 0, _group_host, ("host", "worst")),
    Column("ranks", "ranks", 5, 0, _group_ranks, ("ranks",), right=True),
    Column("flagged", "flagged", 7, 1, _group_flagged, ("flagged",), right=True),
    Column("states", "states", 18, 0, _group_states, ("states",), grow=20),
    Column("steps", f"step min{DASH}max", 13, 0, _group_steps, ("step_min", "step_max")),
    Column("step_time", "max step t", 10, 1, _group_step_time, ("step_time_max_s",), right=True),
    Column("mem", "alloc sum", 9, 2, _group_mem, ("mem_allocated_sum_bytes",), right=True),
)


# ----------------------------------------------------------------------------- cache keys


_ATOMS = frozenset({type(None), bool, int, float, str})


def _frozen(value: Any) -> Hashable:
    """``value`` as a hashable key that tells apart what draws differently: 1, 1.0 and True
    (equal in Python), and dicts in another order (a cell may show them in order)."""
    cls = value.__class__
    if cls in _ATOMS:
        return cls, value
    if isinstance(value, dict):
        values = tuple(value.values())
        kinds = tuple(map(type, values))
        if _ATOMS.issuperset(kinds):  # the usual dict: {"op": ..., "seq": ..., "since_s": ...}
            return dict, tuple(value), values, kinds
        return dict, tuple((k, _frozen(v)) for k, v in value.items())
    if isinstance(value, (list, tuple)):
        return list, tuple(map(_frozen, value))
    if isinstance(value, (set, frozenset)):
        return set, frozenset(map(_frozen, value))
    if isinstance(value, msgspec.Struct):  # a rank's ``collective``: its fields, in order
        return cls, tuple(map(_frozen, msgspec.structs.astuple(value)))
    return cls, value


def row_signature(
    columns: Iterable[Column[Any]], extra: Iterable[str] = ()
) -> Callable[[Any, AlertIndex], Hashable]:
    """The cache key of a row drawn with ``columns``: every field and alert lookup their
    cells declare (and the ``extra`` fields the table itself reads), nothing by hand."""
    columns = list(columns)
    fields = tuple(sorted({f for c in columns for f in c.fields} | set(extra)))
    lookups = tuple(ALERT_LOOKUPS[name] for name in sorted({a for c in columns for a in c.alerts}))
    read = attrgetter(*fields) if len(fields) > 1 else None
    one = fields[0] if len(fields) == 1 else None

    def values_of(row: Any) -> tuple[Any, ...]:
        if read is not None:
            found: tuple[Any, ...] = read(row)
            return found
        return () if one is None else (getattr(row, one),)

    def signature(row: Any, index: AlertIndex) -> Hashable:
        values = values_of(row)
        kinds = tuple(map(type, values))
        if not _ATOMS.issuperset(kinds):  # a struct, dict or list: the types inside count too
            values = tuple([v if v.__class__ in _ATOMS else _frozen(v) for v in values])
        if not lookups:
            return values, kinds
        rank = row.rank
        return values, kinds, tuple([_frozen(lookup(index, rank)) for lookup in lookups])

    return signature


# ----------------------------------------------------------------------------- layout


def text_width(texts: Iterable[str], low: int = 4, high: int = 24) -> int:
    """The widest of ``texts`` in cells, kept within ``low`` and ``high``."""
    return max(low, min(high, max(map(cell_len, texts), default=low)))


def fit_columns(
    columns: Sequence[Column[R]],
    width: int,
    skip: frozenset[str] = frozenset(),
    widths: dict[str, int] | None = None,
) -> list[tuple[Column[R], int]]:
    """Columns that fit in ``width`` (by priority), in display order, with their widths.

    Each column takes its width (or ``widths[key]``) plus one separator; leftover
    room widens the columns that may grow, in display order.
    """
    widths = widths or {}
    candidates = [c for c in columns if c.key not in skip]
    chosen: set[str] = set()
    used = 0
    for column in sorted(candidates, key=lambda c: c.priority):
        need = widths.get(column.key, column.width) + (1 if chosen else 0)
        if used + need <= width or column.priority == 0:
            chosen.add(column.key)
            used += need
    layout = [(c, widths.get(c.key, c.width)) for c in candidates if c.key in chosen]
    spare = width - used
    for i, (column, column_width) in enumerate(layout):
        if spare <= 0:
            break
        extra = min(column.grow, spare)
        layout[i] = (column, column_width + extra)
        spare -= extra
    return layout
