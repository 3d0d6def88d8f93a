"""The job output screen (``o`` under ``ddpwatch run --tui``): the launcher's and ranks' output.

The dashboard owns the terminal, so the job writes to a file; this screen
follows that file like ``tail -f``. Each rank's own last lines are also in its
detail pane, from its agent; this screen also has what no agent sees: the
launcher's messages and anything printed before a rank attached.
"""

from __future__ import annotations

import os
from typing import ClassVar

from textual.app import ComposeResult
from textual.binding import Binding, BindingType
from textual.screen import ModalScreen
from textual.widgets import Log

FIRST_READ = 256 * 1024
"""Bytes read from the end of the file when the screen opens (older output stays in the file)."""


class FileFollower:
    """Reads what was appended to a file since the last call, in whole lines."""

    def __init__(self, path: str, first_read: int = FIRST_READ) -> None:
        self.path = path
        self.offset: int | None = None
        self.first_read = first_read
        self._partial = b""

    def read_new_lines(self) -> list[str]:
        try:
            with open(self.path, "rb") as f:
                size = os.fstat(f.fileno()).st_size
                if self.offset is None or size < self.offset:  # first read, or truncated
                    self.offset = max(0, size - self.first_read)
                    self._partial = b""
                    skip_partial_line = self.offset > 0
                else:
                    skip_partial_line = False
                f.seek(self.offset)
                data = f.read(size - self.offset)
        except OSError:
            return []
        self.offset += len(data)
        data = self._partial + data
        lines = data.split(b"\n")
        self._partial = lines.pop()
        if skip_partial_line and lines:
            lines.pop(0)
        return [line.rstrip(b"\r").decode(errors="replace") for line in lines]


class OutputScreen(ModalScreen[None]):
    """Follows the job's output file; esc, q or o closes it."""

    BINDINGS: ClassVar[list[BindingType]] = [
        Binding("escape,q,o", "close", "Close", id="output.close"),
    ]

    def __init__(self, path: str, interval: float = 0.5) -> None:
        super().__init__()
        self.follower = FileFollower(path)
        self.interval = interval

    def compose(self) -> ComposeResult:
        log = Log(max_lines=10_000, id="output-log")
        log.border_title = "job output"
        log.border_subtitle = f"{self.follower.path}  (esc closes)"
        yield log

    def on_mount(self) -> None:
        self.follow()
        self.set_interval(self.interval, self.follow)
        self.query_one(Log).focus()

    def follow(self) -> None:
        lines = self.follower.read_new_lines()
        if lines:
            self.query_one(Log).write_lines(lines)

    def action_close(self) -> None:
        self.dismiss(None)
