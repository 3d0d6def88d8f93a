"""The dashboard's styles and the code that gives them agree: every CSS class the code gives is
styled, and every class styled is given (the rank table's component classes, the screen's
classes in ``dashboard.tcss``)."""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from typing import Any

import msgspec
from conftest import SRC
from tui_fixtures import document, typed

from ddpwatch.core.vocabulary import RANK_STATES


def _classes_styled(css: str, prefix: str) -> set[str]:
    """Every class starting with ``prefix`` that the CSS text styles (comments removed)."""
    css = re.sub(r"/\*.*?\*/", "", css, flags=re.S)
    return set(re.findall(rf"\.({re.escape(prefix)}[A-Za-z0-9_-]*)", css))


def _status_rows() -> Iterator[Any]:
    """Rank rows in every state, with and without exit codes, from the fixture documents."""
    for tick in (0, 6, 40):
        yield from typed(document(tick)).ranks
    base = typed(document(0)).ranks[0]
    for state in [*RANK_STATES, None]:
        for code in (None, 0, 3):
            yield msgspec.structs.replace(base, state=state, exit_code=code)


def test_every_css_class_the_rank_table_gives_is_styled() -> None:
    from ddpwatch.tui.data.model import group_by_host, index_alerts
    from ddpwatch.tui.widgets.columns import (
        CELL_STYLES,
        GROUP_COLUMNS,
        RANK_COLUMNS,
        state_style,
        style_class,
    )
    from ddpwatch.tui.widgets.rank_table import RankTable

    styled = _classes_styled(RankTable.DEFAULT_CSS, "rank-table--")
    assert styled == RankTable.COMPONENT_CLASSES  # each class declared is styled, and back
    assert {style_class(state_style(s)) for s in RANK_STATES} <= RankTable.COMPONENT_CLASSES
    assert {style_class(name) for name in CELL_STYLES} <= RankTable.COMPONENT_CLASSES
    # every style a cell gives, over rows in every state, is one of CELL_STYLES
    index = index_alerts(typed(document(6)).alerts)
    rows = list(_status_rows())
    given: set[str] = set()
    for columns, table in [(RANK_COLUMNS, rows), (GROUP_COLUMNS, group_by_host(rows, index))]:
        for row in table:
            for column in columns:
                text, style = column.cell(row, index, column.width)
                if isinstance(text, list):  # spans of several styles
                    given.update(name for _, name in text if name is not None)
                if style is not None:
                    given.add(style)
    assert given <= CELL_STYLES
    assert {state_style(s) for s in RANK_STATES} <= given  # the scan saw every state's style


def test_every_screen_class_the_code_sets_is_styled() -> None:
    """The dashboard's screen classes (``-detail``, ``-narrow``...) set in code and styled in
    ``dashboard.tcss`` are the same set."""
    given: set[str] = set()
    for path in sorted((SRC / "tui").rglob("*.py")):
        for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
            if (
                isinstance(node, ast.Call)
                and isinstance(node.func, ast.Attribute)
                and node.func.attr in {"set_class", "add_class", "remove_class", "toggle_class"}
            ):
                given.update(
                    arg.value
                    for arg in node.args
                    if isinstance(arg, ast.Constant) and isinstance(arg.value, str)
                )
    assert given, "the scan found no class the screen sets"
    styled = _classes_styled((SRC / "tui" / "dashboard.tcss").read_text(), "-")
    assert given == styled
