"""The rank table: a Line-API widget that formats only the rows on screen.

Follows toolong's ``LogLines``: a ``ScrollView`` with ``render_line``, plain
lists of typed rows as data, ``virtual_size`` set when the row count changes, an LRU
cache of ``Strip``s keyed by each row's content, and one ``refresh()`` per tick.
``DataTable`` re-measures and re-renders every cell on update (1.15 s per full
update at 8,192 rows); this stays in milliseconds.

The columns, their cells and what each reads are in ``columns``; a row's cache key
is derived from the visible columns' declared fields (``columns.row_signature``).
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Sequence
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

from ddpwatch.core.vocabulary import RankState
from ddpwatch.status.schema import RankEntry
from ddpwatch.tui.data.model import AlertIndex, HostGroup, Row, step_split
from ddpwatch.tui.widgets.columns import (
    CELL_STYLES,
    FINISHED_FIELDS,
    GROUP_COLUMNS,
    RANK_COLUMNS,
    Column,
    finished,
    fit_columns,
    row_signature,
    state_style,
    state_width,
    style_class,
    text_width,
)

TableRow = Row | HostGroup
"""A rank's row, or a host's when the table is grouped."""


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
        style_class(name) for name in ("header", "sorted", "cursor", *sorted(CELL_STYLES))
    }
    """The header's, the cursor's and every cell style's (``columns.CELL_STYLES``): each is
    styled in ``DEFAULT_CSS`` (``tests/tui/test_styles.py`` checks both ways)."""

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
        & > .rank-table--busy { color: $text-accent; }
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

    class UserMoved(Message):
        """The user moved the cursor (a key or a click), as opposed to the dashboard."""

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
        self.rows: Sequence[TableRow] = []
        self.index = AlertIndex()
        self.grouped = False
        self.sort_key: str | None = None
        self.sort_reverse = False
        self.cursor = 0
        self.cursor_key: Any = None
        self._has_sim = False
        self._has_split = False
        self._widths: dict[str, int] = {}
        self._measured_rows = -1
        self._layout: list[tuple[Column[Any], int]] = []
        self._layout_for: tuple[Any, ...] | None = None
        self._signature: Callable[[Any, AlertIndex], Hashable] = row_signature(())
        self._token = 0
        self._strips: LRUCache[tuple[Any, ...], Strip] = LRUCache(1024)
        self._styles: dict[str | None, Style] = {}

    # ------------------------------------------------------------------ data in

    def set_rows(
        self,
        rows: Sequence[TableRow],
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
        ranks = [] if grouped else [r for r in rows if isinstance(r, RankEntry)]
        self._has_sim = any(r.simulated for r in ranks)
        self._has_split = any(  # a cheap test first: no split on most jobs
            r.compute_s is not None and step_split(r) is not None for r in ranks
        )
        if grouped:
            self._widths = {"host": text_width(r.host or "?" for r in rows)}
            self._measured_rows = -1
        elif len(rows) != self._measured_rows:
            # hosts and rank digits change with the row count, not from tick to tick
            self._measured_rows = len(rows)
            self._widths = {
                "rank": max(5, len(str(max((r.rank for r in ranks), default=0))) + 1),
                "host": text_width({r.host or "" for r in rows}),
            }
        if not grouped:  # room for "▶ culprit" and "waits for 1" when the alerts name some
            self._widths["state"] = state_width(index)
        height = len(rows) + 1
        if self.virtual_size.height != height:
            self.virtual_size = Size(self.virtual_size.width, height)
        self._follow_cursor_key()
        self.refresh()

    @staticmethod
    def row_key(row: TableRow) -> int | str | None:
        """What the cursor follows a row by: its rank, or its host on a host row."""
        return row.host if isinstance(row, HostGroup) else row.rank

    def _find(self, key: Any) -> int | None:
        """The position of the row of ``key`` (the cursor's row first: the usual answer)."""
        if key is None:
            return None
        rows, key_of = self.rows, self.row_key
        if self.cursor < len(rows) and key_of(rows[self.cursor]) == key:
            return self.cursor
        for i, row in enumerate(rows):
            if key_of(row) == key:
                return i
        return None

    def _follow_cursor_key(self) -> None:
        """After new rows: the cursor stays on its rank (or host), else at its position."""
        rows = self.rows
        if not rows:
            self.cursor = 0
            self._set_cursor_key(None)
            return
        found = self._find(self.cursor_key)
        if found is not None:
            self.cursor = found
            return
        self.cursor = min(self.cursor, len(rows) - 1)
        self._set_cursor_key(self.row_key(rows[self.cursor]))

    def _set_cursor_key(self, key: Any) -> None:
        if key != self.cursor_key:
            self.cursor_key = key
            self.post_message(self.CursorMoved(self, key))

    def move_cursor_to_key(self, key: Any) -> bool:
        """Put the cursor on the row of ``key`` (a rank, or a host when grouped) and show it."""
        found = self._find(key)
        if found is None:
            return False
        self.set_cursor(found, center=True)
        return True

    def set_cursor(self, index: int, *, center: bool = False, by_user: bool = False) -> None:
        """Put the cursor on row ``index``; ``by_user``: a key or click of the user's did it
        (``UserMoved``), which the dashboard takes as "leave my cursor where I put it"."""
        if not self.rows:
            return
        index = max(0, min(index, len(self.rows) - 1))
        self.cursor = index
        self._set_cursor_key(self.row_key(self.rows[index]))
        self._scroll_to_cursor(center)
        self.refresh()
        if by_user:
            self.post_message(self.UserMoved(self, self.cursor_key))

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
        self.set_cursor(self.cursor + delta, by_user=True)

    def action_page(self, direction: int) -> None:
        self.set_cursor(self.cursor + direction * self.page_height, by_user=True)

    def action_jump(self, where: int) -> None:
        self.set_cursor(len(self.rows) - 1 if where < 0 else 0, by_user=True)

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
                self.set_cursor(index, by_user=True)

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
                style = self.get_component_rich_style(style_class(name), partial=True)
            self._styles[name] = style
        return style

    def _ensure_layout(self, width: int) -> None:
        key = (
            width,
            self.grouped,
            self._has_sim,
            self._has_split,
            tuple(self._widths.items()),
            self.sort_key,
            self.sort_reverse,
        )
        if key == self._layout_for:
            return
        self._layout_for = key
        skip = frozenset(
            key
            for key, shown in (("sim", self._has_sim), ("split", self._has_split))
            if not (shown or self.grouped)
        )
        room = max(1, width - 1)
        if self.grouped:
            self._layout = list(fit_columns(GROUP_COLUMNS, room, skip, self._widths))
        else:
            self._layout = list(fit_columns(RANK_COLUMNS, room, skip, self._widths))
        self._signature = row_signature(
            (column for column, _ in self._layout), () if self.grouped else FINISHED_FIELDS
        )
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
        key = (self._signature(row, self.index), is_cursor, self._token, width)
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

    def _row_strip(self, row: TableRow, width: int, is_cursor: bool) -> Strip:
        index = self.index
        segments = [
            Segment(">" if is_cursor else " ", self._style("warning") if is_cursor else None)
        ]
        dim = isinstance(row, RankEntry) and finished(row)
        exited = self._style(state_style(RankState.EXITED))
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
            base = base + self.get_component_rich_style(style_class("cursor"), partial=True)
        return strip.apply_style(base)
