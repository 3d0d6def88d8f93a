"""The rank table's columns declare what their cells read, and the row cache key covers it.

The table caches each drawn row under a key made of the visible columns' declared
``fields`` and ``alerts`` (``columns.row_signature``). A cell that reads something it
does not declare would show stale text whenever only that thing changes; these tests
mutate every field of many rank (and host) rows, one at a time, and every per-rank alert
lookup, and require that a cell changes only for what its column declares, and that each
declaration is needed.
"""

from __future__ import annotations

import copy
import dataclasses
from collections import Counter
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from tui_fixtures import big, document, typed
from tui_fixtures import rank_entry as rank_dict

from ddpwatch.status.order import STATE_ORDER
from ddpwatch.status.schema import CollectiveWait, RankEntry
from ddpwatch.tui.data.model import (
    CULPRIT_SCORE,
    AlertIndex,
    HostGroup,
    Row,
    group_by_host,
    index_alerts,
    score_style,
)
from ddpwatch.tui.widgets.columns import (
    ALERT_LOOKUPS,
    FINISHED_FIELDS,
    GROUP_COLUMNS,
    RANK_COLUMNS,
    Column,
    finished,
    row_signature,
)

GIB = 1 << 30


def rank_entry(rank: int, world_size: int, **values: Any) -> RankEntry:
    """A rank's entry (``tui_fixtures.rank_entry``, typed)."""
    return msgspec.convert(rank_dict(rank, world_size, **values), RankEntry)


def _fields(row: Any) -> Iterator[tuple[str, Any]]:
    """A row's fields and their values (a rank's entry, a host's row)."""
    return ((name, getattr(row, name)) for name in row.__struct_fields__)


def _rank_rows() -> list[tuple[Row, AlertIndex]]:
    """Rows in every state the cells tell apart, each with the index of its document."""
    rows = []
    for raw in (document(0), document(7), document(80), big(40, 3)):
        doc = typed(raw)
        index = index_alerts(doc.alerts)
        rows += [(row, index) for row in doc.ranks]
    plain = AlertIndex()
    extra = [
        rank_entry(20, 32, state="exited", exit_code=0, step=500, host="node-c"),
        rank_entry(21, 32, state="exited", exit_code=None),
        rank_entry(22, 32, state="exited", exit_code=137, last_seen_s=40.0),
        rank_entry(23, 32, state="stopped", phase="forward", loss=float("nan")),
        rank_entry(
            24,
            32,
            state="stalled",
            collective={"op": "reduce_scatter_tensor_coalesced", "seq": None, "since_s": 31.0},
            gpu_mem_used_bytes=int(78 * GIB),
            gpu_mem_total_bytes=80 * GIB,
            mem_allocated_bytes=None,
            mem_reserved_bytes=3 * GIB,
        ),
        msgspec.structs.replace(  # a collective the agent could not name (not valid JSON)
            rank_entry(25, 32, state="waiting"),
            collective=CollectiveWait(op=None, seq=4, since_s=None),  # type: ignore[arg-type]
            gpu_mem_used_bytes=int(70 * GIB),
            gpu_mem_total_bytes=80 * GIB,
        ),
    ]
    return rows + [(row, plain) for row in extra]


def _group_rows() -> list[tuple[HostGroup, AlertIndex]]:
    rows = []
    for raw in (document(0), document(9), big(64, 3)):
        doc = typed(raw)
        index = index_alerts(doc.alerts)
        rows += [(row, index) for row in group_by_host(doc.ranks, index)]
        rows += [(row, index) for row in group_by_host(doc.ranks[:3], index)]
    rows += [(row, AlertIndex()) for row in group_by_host([rank_entry(0, 1)], AlertIndex())]
    return rows


RANK_ROWS = _rank_rows()
GROUP_ROWS = _group_rows()


def _variants(value: Any, pool: list[Any]) -> Iterator[Any]:
    """Other values a key could hold: None, what other rows hold, and nearby values."""
    yield None
    yield from pool
    if isinstance(value, bool):
        yield not value
    elif isinstance(value, (int, float)):
        yield from (value + 1, value * 3 + 7, value / 2, 0, -value - 1, 10**12)
    elif isinstance(value, str):
        yield from (value + "x", "", value.upper(), *STATE_ORDER)
    elif isinstance(value, dict):
        yield {}
        for key, item in value.items():
            for other in _variants(item, []):
                yield {**value, key: other}
        yield {**value, "extra": 1}
    elif isinstance(value, msgspec.Struct):
        for key, item in _fields(value):
            for other in _variants(item, []):
                yield msgspec.structs.replace(value, **{key: other})
    elif isinstance(value, list):
        yield from ([], [*value, *value[:1]], value[:-1])


POOL = 12
"""How many of the values other rows hold for a key each mutation tries (states: all)."""


def _mutations(rows: list[tuple[Any, AlertIndex]]) -> Iterator[tuple[Any, AlertIndex, str, Any]]:
    """(row, index, field, the row with ``field`` changed) for every field of every row (to any
    value at all: a cell that fails on one still shows that it read the field)."""
    pools: dict[str, list[Any]] = {}
    for row, _ in rows:
        for key, value in _fields(row):
            pool = pools.setdefault(key, [])
            if len(pool) < POOL and value not in pool:
                pool.append(value)
    for row, index in rows:
        for key, value in _fields(row):
            for other in _variants(value, pools[key]):
                if other != value or type(other) is not type(value):
                    yield (
                        row,
                        index,
                        key,
                        msgspec.structs.replace(row, **{key: copy.deepcopy(other)}),
                    )


def _index_mutations(index: AlertIndex, rank: Any) -> Iterator[tuple[str, AlertIndex]]:
    """(the ``AlertIndex`` field changed, the index) for every per-rank change of ``index``."""
    for name, value in vars(index).items():
        if isinstance(value, Counter):
            continue  # alert counts by severity: the header's, about no rank
        if isinstance(value, dict):
            changed = [{**value, rank: score} for score in CULPRIT_SCORE.values()]
            changed.append({k: v for k, v in value.items() if k != rank})
        else:
            changed = [value | {rank}, value - {rank}]
        for other in changed:
            if other != value:
                yield name, dataclasses.replace(index, **{name: other})


def _cell(column: Column, row: Row, index: AlertIndex, width: int) -> Any:
    try:
        return column.cell(row, index, width)
    except (TypeError, KeyError, ValueError, AttributeError, ZeroDivisionError):
        return "raised"  # not a valid row; it still shows that the cell read the key


def _widths(column: Column) -> tuple[int, ...]:
    return (column.width, column.width + column.grow + 8)


_CHANGED: dict[tuple[Any, int], set[str]] = {}


def check_column(column: Column, rows: list[tuple[Row, AlertIndex]]) -> dict[str, set[str]]:
    """What ``column`` gets wrong: keys and lookups that change its cell undeclared
    ("undeclared"), and declared ones that never change it ("unused")."""
    key = (column.cell, id(rows))
    if key not in _CHANGED:
        _CHANGED[key] = _changed(column, rows)
    changed = _CHANGED[key]
    declared = set(column.fields) | {f"alerts.{name}" for name in column.alerts}
    return {"undeclared": changed - declared, "unused": declared - changed}


def _changed(column: Column, rows: list[tuple[Row, AlertIndex]]) -> set[str]:
    """The keys (and "alerts.<field>") whose change changes the cell of some row."""
    changed: set[str] = set()
    for row, index, key, mutated in _mutations(rows):
        for width in _widths(column):
            if _cell(column, mutated, index, width) != _cell(column, row, index, width):
                changed.add(key)
                break
    for row, index in rows:
        for name, other in _index_mutations(index, getattr(row, "rank", None)):
            for width in _widths(column):
                if _cell(column, row, other, width) != _cell(column, row, index, width):
                    changed.add(f"alerts.{name}")
                    break
    return changed


TABLES = [
    pytest.param(column, rows, id=f"{kind}-{column.key}")
    for kind, columns, rows in (
        ("ranks", RANK_COLUMNS, RANK_ROWS),
        ("hosts", GROUP_COLUMNS, GROUP_ROWS),
    )
    for column in columns
]


@pytest.mark.parametrize(("column", "rows"), TABLES)
def test_each_cell_changes_when_and_only_when_a_declared_field_does(
    column: Column, rows: list[tuple[Row, AlertIndex]]
) -> None:
    assert check_column(column, rows) == {"undeclared": set(), "unused": set()}


@pytest.mark.parametrize(("column", "rows"), TABLES)
def test_the_check_catches_a_field_missing_from_a_declaration(
    column: Column, rows: list[tuple[Row, AlertIndex]]
) -> None:
    """The guard above is not vacuous: drop any one declared field or lookup and it fails."""
    for field in column.fields:
        fewer = dataclasses.replace(column, fields=tuple(f for f in column.fields if f != field))
        assert field in check_column(fewer, rows)["undeclared"]
    for name in column.alerts:
        fewer = dataclasses.replace(column, alerts=tuple(a for a in column.alerts if a != name))
        assert f"alerts.{name}" in check_column(fewer, rows)["undeclared"]


class _Recording:
    """A row that remembers which of its fields were read."""

    def __init__(self, row: Any) -> None:
        self._row = row
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._row, name)


class _RecordingIndex:
    """An ``AlertIndex`` that remembers which of its fields were read."""

    def __init__(self, index: AlertIndex) -> None:
        self._index = index
        self.read: set[str] = set()

    def __getattr__(self, name: str) -> Any:
        self.read.add(name)
        return getattr(self._index, name)


@pytest.mark.parametrize(("column", "rows"), TABLES)
def test_each_cell_reads_only_what_its_column_declares(
    column: Column, rows: list[tuple[Row, AlertIndex]]
) -> None:
    """Even keys no fixture row has, or whose change the fixtures cannot show."""
    for row, index in rows:
        recorded, recorded_index = _Recording(row), _RecordingIndex(index)
        for width in _widths(column):
            column.cell(recorded, recorded_index, width)  # type: ignore[arg-type]
        assert recorded.read <= set(column.fields), row
        assert recorded_index.read <= set(column.alerts), row


def test_alert_lookups_name_the_index_fields_they_read() -> None:
    index = AlertIndex(culprit={3: 0}, waiting={4}, nan={5})
    for name, lookup in ALERT_LOOKUPS.items():
        recording = _RecordingIndex(index)
        lookup(recording, 3)  # type: ignore[arg-type]
        assert recording.read == {name}


@pytest.mark.parametrize(
    ("columns", "rows", "extra"),
    [(RANK_COLUMNS, RANK_ROWS, FINISHED_FIELDS), (GROUP_COLUMNS, GROUP_ROWS, ())],
    ids=["ranks", "hosts"],
)
def test_the_row_cache_key_changes_whenever_a_cell_does(
    columns: tuple[Column, ...], rows: list[tuple[Row, AlertIndex]], extra: tuple[str, ...]
) -> None:
    """What the table caches strips under: any drawn change gives a new key."""
    signature = row_signature(columns, extra)

    def drawn(row: Row, index: AlertIndex) -> tuple[Any, ...]:
        cells = tuple(_cell(c, row, index, w) for c in columns for w in _widths(c))
        return (*cells, bool(extra) and finished(row))

    for row, index, _, mutated in _mutations(rows[::3]):
        if drawn(mutated, index) != drawn(row, index):
            assert signature(mutated, index) != signature(row, index)
    for row, index in rows[::3]:
        for _, other in _index_mutations(index, row.rank if extra else None):
            if drawn(row, other) != drawn(row, index):
                assert signature(row, other) != signature(row, index)


def test_the_row_cache_key_is_made_only_of_the_columns_shown() -> None:
    row, index = RANK_ROWS[0]
    narrow = row_signature([c for c in RANK_COLUMNS if c.priority == 0])
    other = msgspec.structs.replace(row, pid=-1, gpu_mem_used_bytes=1)
    assert narrow(row, index) == narrow(other, index)
    assert narrow(row, index) != narrow(msgspec.structs.replace(row, phase="elsewhere"), index)
    hash(row_signature(RANK_COLUMNS, FINISHED_FIELDS)(row, index))


def test_finished_reads_only_its_fields() -> None:
    for row, _ in RANK_ROWS:
        recorded = _Recording(row)
        finished(recorded)
        assert recorded.read <= set(FINISHED_FIELDS)


@pytest.mark.parametrize(
    ("score", "style"),
    [
        (0, "error"),
        (1, "error"),
        (2, "warning"),
        (5, "warning"),
        (6, None),
        (7, None),
        (None, None),
    ],
)
def test_score_style_colours_culprits_and_hosts_as_before(score: Any, style: Any) -> None:
    assert score_style(score) == style


SPLIT = next(c for c in RANK_COLUMNS if c.key == "split")


def test_the_step_split_cell_shows_the_split_and_is_empty_without_one() -> None:
    """Input ▒, compute █ and the wait ░ in proportion, then the wait's share of the step
    (DDP's gradient all-reduce and collectives together); readable without colour."""
    row = rank_entry(
        0, 2, input_wait_s=0.05, compute_s=0.15, grad_wait_s=0.04, collective_time_s=0.01
    )  # a 250 ms step, 50 ms of it waiting
    text, _ = SPLIT.cell(row, AlertIndex(), SPLIT.width)
    assert isinstance(text, list)
    assert "".join(part for part, _ in text) == "▒████░  20%"
    wide, _ = SPLIT.cell(row, AlertIndex(), SPLIT.width + 4)
    assert "".join(part for part, _ in wide) == "▒▒██████░░  20%"
    waited_for = msgspec.structs.replace(
        row, input_wait_s=0.2, grad_wait_s=0.0, collective_time_s=0.0
    )
    text, _ = SPLIT.cell(waited_for, AlertIndex(), SPLIT.width)
    assert "".join(part for part, _ in text) == "▒▒▒███   0%"  # the rank the others wait for
    for no_split in (
        rank_entry(1, 2),  # nothing reported
        rank_entry(1, 2, input_wait_s=0.05, collective_time_s=0.01),  # a GPU rank: no compute
        rank_entry(1, 2, input_wait_s=0.0, compute_s=0.0, grad_wait_s=0.0),
    ):
        assert SPLIT.cell(no_split, AlertIndex(), SPLIT.width) == ("", None)


COLLECTIVE = next(c for c in RANK_COLUMNS if c.key == "collective")


def test_the_collective_cell_says_whom_a_send_or_receive_waits_for() -> None:
    for wait, shown in (
        (CollectiveWait(op="recv", since_s=3.2, peer=0), "recv from 0 3.20s"),
        (CollectiveWait(op="isend", since_s=3.2, peer=2), "isend to 2 3.20s"),
        (CollectiveWait(op="all_reduce", seq=45, since_s=3.2), "all_reduce #45 3.20s"),
    ):
        row = msgspec.structs.replace(rank_entry(1, 3, state="waiting"), collective=wait)
        text, _ = COLLECTIVE.cell(row, AlertIndex(), COLLECTIVE.width)
        assert text == shown
