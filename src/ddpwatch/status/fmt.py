"""Sizes, durations, times and timeline labels as every view writes them, each format once:
the dashboard's compact cells, the alert messages, the timeline, the end-of-run summary and
the reports; and the command the hints send people to for stacks.

Each function is one format with its own place (the names say where); a number the document
does not know (None) is ``NA`` where a function takes None.
"""

from __future__ import annotations

import datetime
import math
import re
from typing import Final

from ddpwatch.core.vocabulary import HistoryEvent
from ddpwatch.status.schema import UNSET, HistoryEntry

NA: Final = "—"
"""An unknown value."""
KIB, MIB, GIB = 1 << 10, 1 << 20, 1 << 30
BYTE_UNITS: Final = (("GiB", GIB), ("MiB", MIB), ("KiB", KIB))
"""Binary units, largest first, as the reports write them."""
_COMPACT_UNITS = ("B", "K", "M", "G", "T", "P")


# ------------------------------------------------------------------------------ sizes


def byte_unit(value: float) -> tuple[int, str] | None:
    """The largest of ``BYTE_UNITS`` that ``value`` reaches, or None below a KiB."""
    for unit, size in BYTE_UNITS:
        if abs(value) >= size:
            return size, unit
    return None


def report_bytes(value: float | None) -> str:
    """A size in a report's table: "1.50 GiB", "512 B"."""
    if value is None:
        return NA
    found = byte_unit(value)
    if found is None:
        return f"{value:.0f} B"
    size, unit = found
    return f"{value / size:.2f} {unit}"


def human_bytes(value: float | None) -> str:
    """A size in a dashboard cell: 1536 -> "1.5K", 12.4e9 -> "11.5G" (binary units, at most
    4 characters plus the unit)."""
    if value is None:
        return NA
    size = float(value)
    for unit in _COMPACT_UNITS:
        if abs(size) < 1024 or unit == _COMPACT_UNITS[-1]:
            if unit == "B":
                return f"{int(size)}B"
            return f"{size:.1f}{unit}" if abs(size) < 100 else f"{size:.0f}{unit}"
        size /= 1024
    return NA  # pragma: no cover


def gib(value: float) -> str:
    """A GPU's memory in an alert message: "11.5 GiB"."""
    return f"{value / GIB:.1f} GiB"


def memory(value: float | None) -> str:
    """Host memory in an alert message: "11.5 GiB", "300 MiB"; "unknown" when not told."""
    if value is None:
        return "unknown"
    return gib(value) if abs(value) >= GIB else f"{value / MIB:.0f} MiB"


def mib_per_s(rate: float) -> str:
    """How fast memory grows, in an alert message: "12.5 MiB/s"."""
    return f"{rate / MIB:.1f} MiB/s"


def per_step(value: float) -> str:
    """Memory a training step keeps, in an alert message: "1.0 MiB a step", "250 KiB a
    step" (a leak of a few tensors a step is small, its steps many)."""
    if abs(value) >= MIB:
        return f"{value / MIB:.1f} MiB a step"
    return f"{value / KIB:.0f} KiB a step"


# ------------------------------------------------------------------------------ durations


def seconds(value: float) -> str:
    """A time in an alert message: "12.3 s"."""
    return f"{value:.1f} s"


def elapsed(value: float) -> str:
    """When something happened, counted from the job's start: "+12.3 s"."""
    return f"+{value:.1f} s"


def wait(value: float) -> str:
    """A wait people read at a glance, in an alert message: "45 s", "24 min", "2.5 h"."""
    if value < 90:
        return f"{value:.0f} s"
    if value < 5400:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"


def duration(value: float | None) -> str:
    """How long a run took or an alert was up: "2.3 s", "4 min 12 s", "3 h 5 min"."""
    if value is None:
        return NA
    value = max(0.0, value)
    if value < 60:
        return f"{value:.1f} s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 60:
        return f"{minutes} min {secs} s"
    hours, minutes = divmod(minutes, 60)
    return f"{hours} h {minutes} min"


def step_seconds(value: float | None) -> str:
    """A step time in a report's table: "0.412 s", "12.3 s", "123 s"."""
    if value is None:
        return NA
    if value >= 100:
        return f"{value:.0f} s"
    return f"{value:.3f} s" if value < 10 else f"{value:.1f} s"


def short_seconds(value: float | None) -> str:
    """A duration in a dashboard cell, at most 5 cells: 0.0123 -> "12ms", 2.5 -> "2.50s",
    4000 -> "1h06m"."""
    if value is None or not math.isfinite(value):
        return NA
    if value < 0.001:
        return f"{value * 1e6:.0f}µs"
    if value < 1:
        return f"{value * 1000:.0f}ms"
    if value < 10:
        return f"{value:.2f}s"
    if value < 60:
        return f"{value:.1f}s"
    minutes, secs = divmod(int(value), 60)
    if minutes < 10:
        return f"{minutes}m{secs:02d}s"
    if minutes < 60:
        return f"{minutes}m"
    hours, minutes = divmod(minutes, 60)
    if hours < 10:
        return f"{hours}h{minutes:02d}m"
    if hours < 24:
        return f"{hours}h"
    days, hours = divmod(hours, 24)
    return f"{days}d{hours:02d}h" if days < 10 else f"{days}d"


def uptime(value: float | None) -> str:
    """How long a server has run, in the dashboard's header: "42s", "5m12s", "1h02m05s",
    "3d04h"."""
    if value is None or value < 0:
        return NA
    total = int(value)
    minutes, secs = divmod(total, 60)
    hours, minutes = divmod(minutes, 60)
    if hours >= 24:
        return f"{hours // 24}d{hours % 24:02d}h"
    if hours:
        return f"{hours}h{minutes:02d}m{secs:02d}s"
    if minutes:
        return f"{minutes}m{secs:02d}s"
    return f"{secs}s"


# ------------------------------------------------------------------------------ the timeline

NEW_ATTEMPT = "new_attempt"
"""``closed_by`` of an alert the launcher's restart ended (``AlertChange.closed_by``)."""


def iso_time(at: float, timespec: str = "milliseconds") -> str:
    """ISO-8601 with the local offset: ``2026-11-23T19:02:05.134+01:00``."""
    return datetime.datetime.fromtimestamp(at).astimezone().isoformat(timespec=timespec)


def event_label(entry: HistoryEntry) -> str:
    """A timeline entry's event, with its episode: "raised #2", "escalated #2 from
    straggler", "cleared #2", "ended with attempt 1 #3", "raised #4 in attempt 2" (the report
    and the dashboard's timeline write it the same)."""
    event = entry.event
    closed = entry.closed_by == NEW_ATTEMPT
    if closed:
        event = f"ended with attempt {entry.attempt}"
    if entry.episode > 0:
        event += f" #{entry.episode}"
    if entry.event == HistoryEvent.ESCALATED and entry.previous is not UNSET:
        event += f" from {entry.previous.kind}"
    if entry.attempt > 1 and not closed:
        event += f" in attempt {entry.attempt}"
    return event


# ------------------------------------------------------------------------------ hints

STACKS_IN = "ddpwatch status --json"
"""Where a hint sends people for a rank's stack and traceback: a shell command. The dashboard
shows them in its detail pane and writes that in its place (``tui.alerts_panel``)."""
STACKS_IN_ANY_PORT = re.compile(r"ddpwatch status(?: --port \d+)? --json")
"""``STACKS_IN`` as the server writes it, with its port where it is not the default one
(``server.engine.with_port``)."""


def hint_pointing_at(hint: str, where: str) -> str:
    """``hint`` sending the reader to ``where`` for a rank's stack and traceback instead of
    the server (``STACKS_IN``): once ``ddpwatch run`` has ended no server is left to ask,
    and a report holds them itself."""
    return STACKS_IN_ANY_PORT.sub(lambda _: where, hint)
