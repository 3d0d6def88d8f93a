"""A text widget that packs short pieces ("key value") into lines without splitting one.

Rich wraps at any space, which separates labels from their values ("uuid" at the
end of one line, the UUID on the next). ``Packed`` fills each line with whole
pieces instead, for the terminal's current width; a piece wider than the line
gets a line of its own and wraps there.
"""

from __future__ import annotations

from collections.abc import Sequence

from rich.text import Text
from textual.geometry import Size
from textual.widget import Widget

Paragraph = Sequence[Text]


def pack(pieces: Paragraph, width: int, sep: str = "  ") -> list[Text]:
    """Greedy line filling that keeps every piece whole."""
    lines: list[Text] = []
    line = Text()
    for piece in pieces:
        if not piece.plain:
            continue
        if line.cell_len and line.cell_len + len(sep) + piece.cell_len > width:
            lines.append(line)
            line = Text()
        if line.cell_len:
            line.append(sep)
        line.append_text(piece)
    if line.cell_len:
        lines.append(line)
    return lines


def packed_text(paragraphs: Sequence[Paragraph], width: int, sep: str = "  ") -> Text:
    lines: list[Text] = []
    for paragraph in paragraphs:
        lines.extend(pack(paragraph, width, sep))
    return Text("\n").join(lines)


def _key(paragraphs: Sequence[Paragraph]) -> tuple[tuple[tuple[str, str], ...], ...]:
    return tuple(
        tuple((piece.plain, f"{piece.style}{piece.spans!r}") for piece in p) for p in paragraphs
    )


class Packed(Widget):
    """Paragraphs of pieces, each paragraph packed to the widget's width."""

    DEFAULT_CSS = """
    Packed { height: auto; }
    """

    def __init__(self, *, id: str | None = None, classes: str | None = None) -> None:
        super().__init__(id=id, classes=classes)
        self.paragraphs: list[Paragraph] = []

    def show(self, paragraphs: Sequence[Paragraph]) -> None:
        """Replace the text; nothing happens when it is the same as before."""
        new = list(paragraphs)
        if _key(new) == _key(self.paragraphs):
            return
        self.paragraphs = new
        self.refresh(layout=True)

    def get_content_height(self, container: Size, viewport: Size, width: int) -> int:
        if width <= 0:
            return 0
        text = packed_text(self.paragraphs, width)
        return len(text.wrap(self.app.console, width))

    def render(self) -> Text:
        return packed_text(self.paragraphs, self.content_size.width or 80)
