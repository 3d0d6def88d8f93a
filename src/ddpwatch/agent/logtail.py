"""The last lines a rank printed, kept by a tee on sys.stdout / sys.stderr.

The tee writes through first and never swallows output; keeping the line is
best effort. Output written below Python (C++ prints, NCCL logs) is not seen.
"""

from __future__ import annotations

import contextlib
import sys
import threading
from collections import deque
from typing import Any, TextIO

MAX_LINE = 300
MAX_PENDING = 4096
KEEP = 50


class LineBuffer:
    """Splits written text into lines; a carriage return (progress bars) replaces the line."""

    def __init__(self, keep: int = KEEP) -> None:
        self._lock = threading.Lock()
        self._partial = ""
        self._new: deque[str] = deque(maxlen=keep)

    def feed(self, text: str) -> None:
        with self._lock:
            text = self._partial + text
            *lines, self._partial = text.split("\n")
            self._partial = self._partial[-MAX_PENDING:]
            for line in lines:
                line = line.rsplit("\r", 1)[-1].rstrip()
                if line:
                    self._new.append(line[:MAX_LINE])

    def take(self) -> list[str]:
        """Lines completed since the last call."""
        with self._lock:
            lines = list(self._new)
            self._new.clear()
        return lines


class Tee:
    """A text stream that writes through to ``stream`` and feeds each write to ``buffer``."""

    def __init__(self, stream: TextIO, buffer: LineBuffer) -> None:
        self._ddpwatch_stream = stream
        self._ddpwatch_buffer = buffer

    def write(self, text: str) -> int:
        written = self._ddpwatch_stream.write(text)
        with contextlib.suppress(Exception):
            self._ddpwatch_buffer.feed(text)
        return written

    def __getattr__(self, name: str) -> Any:  # flush, isatty, fileno, buffer, encoding, ...
        return getattr(self._ddpwatch_stream, name)


class LogTail:
    """Installs tees on stdout and stderr; ``remove`` puts the originals back if still ours."""

    def __init__(self) -> None:
        self.buffer = LineBuffer()
        self._tees: dict[str, Tee] = {}

    def install(self) -> None:
        for name in ("stdout", "stderr"):
            stream = getattr(sys, name)
            if stream is None or isinstance(stream, Tee):
                continue
            tee = Tee(stream, self.buffer)
            self._tees[name] = tee
            setattr(sys, name, tee)

    def remove(self) -> None:
        for name, tee in self._tees.items():
            if getattr(sys, name) is tee:
                setattr(sys, name, tee._ddpwatch_stream)
        self._tees.clear()
