"""The rank table: a Line-API widget that formats only the rows on screen.

Follows toolong's ``LogLines``: a ``ScrollView`` with ``render_line``, plain
lists of dicts as data, ``virtual_size`` set when the row count changes, an LRU
cache of ``Strip``s keyed by each row's content, and one ``refresh()`` per tick.
``DataTable`` re-measures and re-renders every cell on update (1.15 s per full
update at 8,192 rows); this stays in milliseconds.

Columns collapse by priority when the terminal is narrow: rank, state, phase,
step and collective always stay; the rest appear as width allows.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterable, Sequence
from dataclasses import dataclass
from typing import Any, ClassVar

from rich.cells import cell_len, set_cell_size
from rich.segment import Segment
from rich.style import Style
from textual import events
from textual.binding import Binding, BindingType
from textual.cache import LRUCache
from textual.geometry import Size
from textual.message import Message
from textual.scroll_view import ScrollView
from textual.strip import Strip

from ddpwatch.tui.fmt import DASH, NA, bar, human_bytes, loss_text, seconds
from ddpwatch.tui.model import STATE_SCORE, AlertIndex, Row, state_summary

Span = tuple[str, str | None]
Cell = tuple[str | list[Span], str | None]
"""Text and the name of its style (a ``rank-table--<name>`` component class, or None);
the text may be a list of (text, style name) spans instead, for cells of several colours."""


@dataclass(frozen=True)
class Column:
    key: str
    """Also the sort key (see ``model.SORT_VALUES`` / ``GROUP_SORT_VALUES``)."""
    title: str
    width: int
    priority: int
    """Lower stays longer when the table is narrow; 0 never collapses."""
    cell: Callable[[Row, AlertIndex, int], Cell]
    """Formats the row's cell for a given width."""
    right: bool = False
    grow: int = 0
    """How many extra cells this column may take when there is room."""


# ----------------------------------------------------------------------------- rank cells


def _rank(row: Row, index: AlertIndex, width: int) -> Cell:
    score = index.culprit.get(row["rank"])
    style = "error" if score == 0 else "warning" if score == 2 else None
    return str(row["rank"]), style


def _sim(row: Row, index: AlertIndex, width: int) -> Cell:
    return ("sim", "sim") if row.get("simulated") else ("", None)


def _plain(field: str) -> Callable[[Row, AlertIndex, int], Cell]:
    def cell(row: Row, index: AlertIndex, width: int) -> Cell:
        value = row.get(field)
        return (NA, "dim") if value is None else (str(value), None)

    return cell


_STATE_TEXT = {"not_connected": "absent"}


def _state(row: Row, index: AlertIndex, width: int) -> Cell:
    state = row.get("state") or "not_connected"
    text = _STATE_TEXT.get(state, state)
    if state == "exited" and row.get("exit_code") not in (None, 0):
        return f"exit {row['exit_code']}", "crashed"
    return text, state.replace("_", "-")


def _step(row: Row, index: AlertIndex, width: int) -> Cell:
    step = row.get("step")
    return (NA, "dim") if step is None else (str(step), None)


def _loss(row: Row, index: AlertIndex, width: int) -> Cell:
    loss = row.get("loss")
    if loss is None:
        return ("nan", "error") if row["rank"] in index.nan else (NA, "dim")
    return loss_text(loss), None


def _secs(field: str, warn: float | None = None) -> Callable[[Row, AlertIndex, int], Cell]:
    def cell(row: Row, index: AlertIndex, width: int) -> Cell:
        value = row.get(field)
        if value is None:
            return NA, "dim"
        return seconds(value), "warning" if warn is not None and value >= warn else None

    return cell


def _collective(row: Row, index: AlertIndex, width: int) -> Cell:
    coll = row.get("collective")
    if not coll:
        return "", None
    name = coll.get("op") or "?"
    if coll.get("seq") is not None:
        name += f" #{coll['seq']}"
    since = coll.get("since_s") or 0.0
    age = seconds(since)
    room = width - len(age) - 1
    if len(name) > room:
        name = name[: max(0, room - 1)] + "…"
    style = "error" if since >= 30 else "warning" if since >= 5 else None
    return f"{name} {age}".strip(), style


def _mem(row: Row, index: AlertIndex, width: int) -> Cell:
    alloc, reserved = row.get("mem_allocated_bytes"), row.get("mem_reserved_bytes")
    if alloc is None and reserved is None:
        return NA, "dim"
    return f"{human_bytes(alloc)}/{human_bytes(reserved)}", None


def _gpu(row: Row, index: AlertIndex, width: int) -> Cell:
    used, total = row.get("gpu_mem_used_bytes"), row.get("gpu_mem_total_bytes")
    if used is None or not total:
        return NA, "dim"
    fraction = used / total
    pct = f"{min(fraction, 9.99) * 100:3.0f}%"
    style = "error" if fraction >= 0.95 else "warning" if fraction >= 0.85 else "bar"
    cells = max(1, width - 5)
    filled = bar(fraction, cells).rstrip("·")
    track = "·" * (cells - cell_len(filled))
    return [(filled, style), (track, "dim"), (f" {pct}", None)], style


def _seen(row: Row, index: AlertIndex, width: int) -> Cell:
    value = row.get("last_seen_s")
    if value is None:
        return NA, "dim"
    return seconds(value), "error" if row.get("state") == "silent" else None


RANK_COLUMNS: tuple[Column, ...] = (
    Column("rank", "rank", 4, 0, _rank, right=True),
    Column("sim", "", 3, 1, _sim),
    Column("local_rank", "lr", 3, 6, _plain("local_rank"), right=True),
    Column("host", "host", 6, 1, _plain("host")),
    Column("pid", "pid", 7, 7, _plain("pid"), right=True),
    Column("device", "device", 7, 4, _plain("device"), grow=2),
    Column("state", "state", 7, 0, _state),
    Column("phase", "phase", 9, 0, _plain("phase"), grow=3),
    Column("step", "step", 7, 0, _step, right=True),
    Column("loss", "loss", 7, 3, _loss, right=True),
    Column("step_time", "step t", 6, 1, _secs("step_time_s"), right=True),
    Column("data_wait", "data", 6, 6, _secs("data_wait_s"), right=True),
    Column("collective", "collective", 21, 0, _collective, grow=9),
    Column("mem", "alloc/rsvd", 11, 4, _mem, right=True),
    Column("gpu", "gpu mem", 10, 5, _gpu, grow=6),
    Column("seen", "seen", 5, 1, _seen, right=True),
)


def rank_signature(row: Row, index: AlertIndex) -> Hashable:
    """Everything a rank row's cells depend on (the strip cache key)."""
    coll = row.get("collective")
    rank = row["rank"]
    return (
        rank,
        row.get("local_rank"),
        row.get("host"),
        row.get("pid"),
        row.get("device"),
        row.get("state"),
        row.get("phase"),
        row.get("step"),
        row.get("loss"),
        row.get("step_time_s"),
        row.get("data_wait_s"),
        (coll.get("op"), coll.get("seq"), coll.get("since_s")) if coll else None,
        row.get("mem_allocated_bytes"),
        row.get("mem_reserved_bytes"),
        row.get("gpu_mem_used_bytes"),
        row.get("gpu_mem_total_bytes"),
        row.get("last_seen_s"),
        row.get("simulated"),
        row.get("exit_code"),
        index.culprit.get(rank),
        rank in index.nan,
    )


# ----------------------------------------------------------------------------- host cells


def _group_host(row: Row, index: AlertIndex, width: int) -> Cell:
    return row["host"], "error" if row["worst"] <= 1 else "warning" if row["worst"] <= 5 else None


def _group_states(row: Row, index: AlertIndex, width: int) -> Cell:
    worst = min(row["states"], key=_state_order, default="running")
    return state_summary(row["states"]), worst.replace("_", "-")


def _state_order(state: str) -> int:
    return STATE_SCORE.get(state, 9)


def _group_steps(row: Row, index: AlertIndex, width: int) -> Cell:
    low, high = row["step_min"], row["step_max"]
    if low is None:
        return NA, "dim"
    return (str(low), None) if low == high else (f"{low}{DASH}{high}", "warning")


GROUP_COLUMNS: tuple[Column, ...] = (
    Column("host", "host", 10, 0, _group_host),
    Column("ranks", "ranks", 5, 0, lambda r, i, w: (str(r["count"]), None), right=True),
    Column(
        "flagged",
        "flagged",
        7,
        1,
        lambda r, i, w: (str(r["flagged"]) if r["flagged"] else "", "warning"),
        right=True,
    ),
    Column("states", "states", 18, 0, _group_states, grow=20),
    Column("steps", f"step min{DASH}max", 13, 0, _group_steps),
    Column(
        "step_time",
        "max step t",
        10,
        1,
        lambda r, i, w: (seconds(r["step_time_max"]), None),
        right=True,
    ),
    Column("mem", "alloc sum", 9, 2, lambda r, i, w: (human_bytes(r["mem_sum"]), None), right=True),
)


def group_signature(row: Row, index: AlertIndex) -> Hashable:
    return (
        row["host"],
        row["count"],
        tuple(sorted(row["states"].items())),
        row["step_min"],
        row["step_max"],
        row["step_time_max"],
        row["mem_sum"],
        row["flagged"],
        row["worst"],
    )


def _longest(texts: Iterable[str], low: int = 4, high: int = 24) -> int:
    return max(low, min(high, max(map(cell_len, texts), default=low)))


def fit_columns(
    columns: Sequence[Column],
    width: int,
    skip: frozenset[str] = frozenset(),
    widths: dict[str, int] | None = None,
) -> list[tuple[Column, int]]:
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
    layout = [[c, widths.get(c.key, c.width)] for c in candidates if c.key in chosen]
    spare = width - used
    for item in layout:
        if spare <= 0:
            break
        extra = min(item[0].grow, spare)
        item[1] += extra
        spare -= extra
    return [(c, w) for c, w in layout]


class RankTable(ScrollView, can_focus=True, inherit_bindings=False):
    """One line per rank (or per host when grouped), a header line, a cursor row."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("up,k", "cursor(-1)", "Up", show=False, id="table.up"),
        Binding("down,j", "cursor(1)", "Down", show=False, id="table.down"),
        Binding("pageup", "page(-1)", "Page up", show=False, id="table.page_up"),
        Binding("pagedown", "page(1)", "Page down", show=False, id="table.page_down"),
        Binding("home", "jump(0)", "First", show=False, id="table.home"),
        Binding("end", "jump(-1)", "Last", show=False, id="table.end"),
        Binding("enter", "select_cursor", "Detail", id="table.detail"),
    ]

    COMPONENT_CLASSES: ClassVar[set[str]] = {
        "rank-table--header",
        "rank-table--sorted",
        "rank-table--cursor",
        "rank-table--running",
        "rank-table--waiting",
        "rank-table--stalled",
        "rank-table--silent",
        "rank-table--crashed",
        "rank-table--exited",
        "rank-table--stopped",
        "rank-table--not-connected",
        "rank-table--error",
        "rank-table--warning",
        "rank-table--dim",
        "rank-table--sim",
        "rank-table--bar",
    }

    DEFAULT_CSS = """
    RankTable {
        scrollbar-gutter: stable;
        scrollbar-size-vertical: 1;
        overflow-x: hidden;
        overflow-y: scroll;
        & > .rank-table--header { text-style: bold; color: $text-muted; }
        & > .rank-table--sorted { text-style: bold underline; color: $accent; }
        & > .rank-table--cursor { background: $block-cursor-blurred-background; }
        &:focus > .rank-table--cursor { background: $block-cursor-background 60%; }
        & > .rank-table--running { color: $text-success; }
        & > .rank-table--waiting { color: $text-warning; }
        & > .rank-table--stalled { color: $text-warning; text-style: bold; }
        & > .rank-table--silent { color: $text-error; text-style: bold; }
        & > .rank-table--crashed { color: $text-error; text-style: bold; }
        & > .rank-table--exited { color: $text-disabled; }
        & > .rank-table--stopped { color: $text-disabled; text-style: italic; }
        & > .rank-table--not-connected { color: $text-error; }
        & > .rank-table--error { color: $text-error; text-style: bold; }
        & > .rank-table--warning { color: $text-warning; }
        & > .rank-table--dim { color: $text-disabled; }
        & > .rank-table--sim { color: $text-accent; text-style: italic; }
        & > .rank-table--bar { color: $text-primary; }
    }
    """

    class CursorMoved(Message):
        """The cursor is on another rank (or host)."""

        def __init__(self, table: RankTable, key: Any) -> None:
            super().__init__()
            self.table = table
            self.key = key

    class Selected(Message):
        """Enter (or a click) on the cursor row."""

        def __init__(self, table: RankTable, key: Any) -> None:
            super().__init__()
            self.table = table
            self.key = key

    class HeaderClicked(Message):
        """A click on a column title: sort by it."""

        def __init__(self, table: RankTable, column: str) -> None:
            super().__init__()
            self.table = table
            self.column = column

    def __init__(
        self, *, name: str | None = None, id: str | None = None, classes: str | None = None
    ) -> None:
        super().__init__(name=name, id=id, classes=classes)
        self.rows: list[Row] = []
        self.index = AlertIndex()
        self.grouped = False
        self.sort_key: str | None = None
        self.sort_reverse = False
        self.cursor = 0
        self.cursor_key: Any = None
        self._has_sim = False
        self._widths: dict[str, int] = {}
        self._measured_rows = -1
        self._layout: list[tuple[Column, int]] = []
        self._layout_for: tuple[Any, ...] | None = None
        self._token = 0
        self._strips: LRUCache[tuple[Any, ...], Strip] = LRUCache(1024)
        self._styles: dict[str | None, Style] = {}

    # ------------------------------------------------------------------ data in

    def set_rows(
        self,
        rows: list[Row],
        index: AlertIndex,
        *,
        grouped: bool = False,
        sort_key: str | None = None,
        sort_reverse: bool = False,
    ) -> None:
        """Show ``rows`` (already ordered); the cursor stays on the same rank or host."""
        if grouped != self.grouped:
            self.cursor_key = None
            self.cursor = 0
            self.scroll_to(y=0, animate=False)
        self.rows = rows
        self.index = index
        self.grouped = grouped
        self.sort_key, self.sort_reverse = sort_key, sort_reverse
        self._has_sim = not grouped and any(r.get("simulated") for r in rows)
        if grouped:
            self._widths = {"host": _longest(r["host"] for r in rows)}
            self._measured_rows = -1
        elif len(rows) != self._measured_rows:
            # hosts and rank digits change with the row count, not from tick to tick
            self._measured_rows = len(rows)
            self._widths = {
                "rank": max(5, len(str(max((r["rank"] for r in rows), default=0))) + 1),
                "host": _longest({r.get("host") or "" for r in rows}),
            }
        height = len(rows) + 1
        if self.virtual_size.height != height:
            self.virtual_size = Size(self.virtual_size.width, height)
        self._follow_cursor_key()
        self.refresh()

    def _key_of(self, row: Row) -> Any:
        return row["host"] if self.grouped else row["rank"]

    def _follow_cursor_key(self) -> None:
        rows = self.rows
        if not rows:
            self.cursor = 0
            self._set_cursor_key(None)
            return
        key = self.cursor_key
        if key is not None:
            field = "host" if self.grouped else "rank"
            if self.cursor < len(rows) and rows[self.cursor].get(field) == key:
                return
            for i, row in enumerate(rows):
                if row.get(field) == key:
                    self.cursor = i
                    return
        self.cursor = min(self.cursor, len(rows) - 1)
        self._set_cursor_key(self._key_of(rows[self.cursor]))

    def _set_cursor_key(self, key: Any) -> None:
        if key != self.cursor_key:
            self.cursor_key = key
            self.post_message(self.CursorMoved(self, key))

    @property
    def cursor_row(self) -> Row | None:
        return self.rows[self.cursor] if 0 <= self.cursor < len(self.rows) else None

    def move_cursor_to_key(self, key: Any) -> bool:
        """Put the cursor on the row of ``key`` (a rank, or a host when grouped) and show it."""
        field = "host" if self.grouped else "rank"
        for i, row in enumerate(self.rows):
            if row.get(field) == key:
                self.set_cursor(i, center=True)
                return True
        return False

    def set_cursor(self, index: int, *, center: bool = False) -> None:
        if not self.rows:
            return
        index = max(0, min(index, len(self.rows) - 1))
        self.cursor = index
        self._set_cursor_key(self._key_of(self.rows[index]))
        self._scroll_to_cursor(center)
        self.refresh()

    @property
    def page_height(self) -> int:
        """Rows visible at once (the header line excluded)."""
        return max(1, self.scrollable_content_region.height - 1)

    def _scroll_to_cursor(self, center: bool = False) -> None:
        top = round(self.scroll_y)
        page = self.page_height
        if center and not (top <= self.cursor < top + page):
            self.scroll_to(y=max(0, self.cursor - page // 2), animate=False)
        elif self.cursor < top:
            self.scroll_to(y=self.cursor, animate=False)
        elif self.cursor >= top + page:
            self.scroll_to(y=self.cursor - page + 1, animate=False)

    # ------------------------------------------------------------------ actions

    def action_cursor(self, delta: int) -> None:
        self.set_cursor(self.cursor + delta)

    def action_page(self, direction: int) -> None:
        self.set_cursor(self.cursor + direction * self.page_height)

    def action_jump(self, where: int) -> None:
        self.set_cursor(len(self.rows) - 1 if where < 0 else 0)

    def action_select_cursor(self) -> None:
        if self.rows:
            self.post_message(self.Selected(self, self.cursor_key))

    def on_click(self, event: events.Click) -> None:
        y = event.y - self.gutter.top
        if y == 0:
            column = self._column_at(event.x)
            if column is not None:
                self.post_message(self.HeaderClicked(self, column))
            return
        index = round(self.scroll_y) + y - 1
        if 0 <= index < len(self.rows):
            if index == self.cursor:
                self.action_select_cursor()
            else:
                self.set_cursor(index)

    def _column_at(self, x: int) -> str | None:
        offset = 1
        for column, width in self._layout:
            if offset <= x < offset + width + 1:
                return column.key
            offset += width + 1
        return None

    # ------------------------------------------------------------------ rendering

    def notify_style_update(self) -> None:
        super().notify_style_update()
        self._styles.clear()
        self._strips.clear()
        self._layout_for = None

    def _style(self, name: str | None) -> Style:
        style = self._styles.get(name)
        if style is None:
            if name is None:
                style = Style()
            else:
                style = self.get_component_rich_style(f"rank-table--{name}", partial=True)
            self._styles[name] = style
        return style

    def _ensure_layout(self, width: int) -> None:
        key = (
            width,
            self.grouped,
            self._has_sim,
            tuple(self._widths.items()),
            self.sort_key,
            self.sort_reverse,
        )
        if key == self._layout_for:
            return
        self._layout_for = key
        columns = GROUP_COLUMNS if self.grouped else RANK_COLUMNS
        skip = frozenset() if self._has_sim or self.grouped else frozenset({"sim"})
        self._layout = fit_columns(columns, max(1, width - 1), skip, self._widths)
        self._token += 1

    @property
    def visible_columns(self) -> list[str]:
        """Keys of the columns shown at the current width."""
        self._ensure_layout(self.scrollable_content_region.width)
        return [c.key for c, _ in self._layout]

    def render_line(self, y: int) -> Strip:
        width = self.scrollable_content_region.width
        self._ensure_layout(width)
        if y == 0:
            return self._header_strip(width)
        index = round(self.scroll_y) + y - 1
        if index >= len(self.rows):
            return Strip.blank(width, self.rich_style)
        row = self.rows[index]
        is_cursor = index == self.cursor
        signature = (
            group_signature(row, self.index) if self.grouped else rank_signature(row, self.index)
        )
        key = (signature, is_cursor, self._token, width)
        strip = self._strips.get(key)
        if strip is None:
            strip = self._row_strip(row, width, is_cursor)
            self._strips[key] = strip
        return strip

    def _header_strip(self, width: int) -> Strip:
        key = ("header", self._token, width)
        strip = self._strips.get(key)
        if strip is not None:
            return strip
        header, sorted_style = self._style("header"), self._style("sorted")
        segments = [Segment(" ")]
        for i, (column, cw) in enumerate(self._layout):
            title = column.title
            style = header
            if column.key == self.sort_key:
                title = f"{title[: cw - 1]}{'▼' if self.sort_reverse else '▲'}"
                style = sorted_style
            text = set_cell_size(title, cw)
            if column.right and cell_len(title) < cw:
                text = title.rjust(cw)
            segments.append(Segment(text, style))
            if i < len(self._layout) - 1:
                segments.append(Segment(" "))
        strip = Strip(segments).adjust_cell_length(width).apply_style(self.rich_style)
        self._strips[key] = strip
        return strip

    def _row_strip(self, row: Row, width: int, is_cursor: bool) -> Strip:
        index = self.index
        segments = [
            Segment(">" if is_cursor else " ", self._style("warning") if is_cursor else None)
        ]
        dim = (
            not self.grouped and row.get("state") == "exited" and row.get("exit_code") in (None, 0)
        )
        exited = self._style("exited")
        last = len(self._layout) - 1
        for i, (column, cw) in enumerate(self._layout):
            text, style_name = column.cell(row, index, cw)
            if isinstance(text, str):
                parts = [(text, style_name)]
                length = cell_len(text)
            else:
                parts = text
                length = sum(cell_len(t) for t, _ in parts)
            if length > cw:
                joined = "".join(t for t, _ in parts)
                parts = [(set_cell_size(joined, cw - 1) + "…", parts[0][1] if parts else None)]
            elif length < cw:
                pad = (" " * (cw - length), None)
                parts = [pad, *parts] if column.right else [*parts, pad]
            for part, name in parts:
                segments.append(Segment(part, exited if dim else self._style(name)))
            if i < last:
                segments.append(Segment(" "))
        strip = Strip(segments).adjust_cell_length(width)
        base = self.rich_style
        if is_cursor:
            base = base + self.get_component_rich_style("rank-table--cursor", partial=True)
        return strip.apply_style(base)
