"""Making ``ddpwatch run``'s alert lines stand out in the job's own output.

A failing job prints a traceback per rank, and the one line that names the culprit
must not drown in them: every alert line gets a mark, and on a terminal a colour.
Colour follows the NO_COLOR convention (https://no-color.org): any non-empty value
turns it off, and it is never written to a pipe or a file.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from typing import TextIO

from ddpwatch.core.vocabulary import Severity

MARK = "▶"
ASCII_MARK = ">>"  # where the stream cannot encode the mark (LANG=C with an ASCII stderr)
SGR: dict[str, str] = {Severity.ERROR: "1;31", Severity.WARNING: "1;33"}
"""Bold red, bold yellow; any other severity bold."""
RESET = "\x1b[0m"


def colour_wanted(stream: TextIO, environ: Mapping[str, str] | None = None) -> bool:
    """Colour only for a person: ``stream`` is a terminal and NO_COLOR is unset or empty."""
    env = os.environ if environ is None else environ
    if env.get("NO_COLOR"):
        return False
    try:
        return stream.isatty()
    except (AttributeError, ValueError):  # a closed or replaced stream
        return False


def mark_for(stream: TextIO) -> str:
    """The mark, or its ASCII stand-in where ``stream`` cannot encode it."""
    try:
        MARK.encode(getattr(stream, "encoding", None) or "utf-8")
    except (UnicodeEncodeError, LookupError):
        return ASCII_MARK
    return MARK


def emphasize(text: str, severity: str | None, mark: str = MARK, colour: bool = False) -> str:
    """``text`` with ``mark`` before every line, each line coloured by ``severity`` when
    ``colour``: lines from other processes may land between them, so each resets."""
    lines = [f"{mark} {line}" for line in text.split("\n")]
    if colour:
        start = f"\x1b[{SGR.get(severity or '', '1')}m"
        lines = [f"{start}{line}{RESET}" for line in lines]
    return "\n".join(lines)


def emphasize_for(stream: TextIO, text: str, severity: str | None) -> str:
    """``emphasize`` as ``stream`` wants it."""
    return emphasize(text, severity, mark_for(stream), colour_wanted(stream))
