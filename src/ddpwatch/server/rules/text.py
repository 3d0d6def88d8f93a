"""Words for alerts: rank lists, durations, sizes, op names and where in the code a rank is."""

from __future__ import annotations

import re
from collections.abc import Iterable

from ddpwatch.ranges import sorted_ranges
from ddpwatch.server.state import RankRecord

GIB = float(1 << 30)


MAX_LISTED = 8  # rank runs written out before "and N more"


_SKIP_PARTS = frozenset({"ddpwatch", "torch", "site-packages", "dist-packages"})


_STDLIB_DIR = re.compile(r"python\d+\.\d+$|python\d{3,}$", re.IGNORECASE)
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')


def format_ranks(ranks: Iterable[int], limit: int = MAX_LISTED) -> str:
    """Write ranks as "rank 3", "ranks 0, 2" or "ranks 0-5, 9"; huge lists end "and 8000 more".

    Runs of three or more collapse to "a-b" so 8192 ranks stay one short phrase.
    """
    ordered = sorted(set(ranks))
    if not ordered:
        return "no rank"
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    return "ranks " + sorted_ranges(ordered, limit, ", ", 3, " and {} more")


def verb(count: int, one: str, many: str) -> str:
    return one if count == 1 else many


def seconds(value: float) -> str:
    return f"{value:.1f} s"


def duration(value: float) -> str:
    """A wait people read at a glance: "45 s", "24 min", "2.5 h"."""
    if value < 90:
        return f"{value:.0f} s"
    if value < 5400:
        return f"{value / 60:.0f} min"
    return f"{value / 3600:.1f} h"


def gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def collective_name(op: str, seq: int | None) -> str:
    return op if seq is None else f"{op} #{seq}"


def _is_stdlib(parts: list[str]) -> bool:
    """A frame of Python's own library ("/usr/lib/python3.11/multiprocessing/queues.py")."""
    return any(_STDLIB_DIR.match(part) for part in parts[:-1])


def location(stack: str | None) -> str | None:
    """Return "train.py:88", the innermost frame of a formatted stack in the user's own code.

    Frames inside ddpwatch, torch, threading or installed packages say nothing about
    where the user's program is, so they are skipped.
    """
    if not stack:
        return None
    for path, line in reversed(_FRAME.findall(stack)):
        parts = re.split(r"[\\/]", path)
        name = parts[-1]
        if name.startswith("<") or _SKIP_PARTS.intersection(parts) or _is_stdlib(parts):
            continue
        return f"{name}:{line}"
    return None


def record_location(record: RankRecord) -> str | None:
    """Where the rank is: its captured stack, else the traceback it died with."""
    found = location(record.stack)
    if found is None and record.error is not None:
        found = location(record.error.traceback)
    return found


def where(record: RankRecord) -> str:
    """Describe where a rank is: "in 'forward' at step 311, train.py:88", as far as known."""
    parts = []
    if record.phase:
        parts.append(f"in '{record.phase}'")
    parts.append("before its first step" if record.step is None else f"at step {record.step}")
    text = " ".join(parts)
    loc = record_location(record)
    return f"{text}, {loc}" if loc else text


STACKS_IN = "ddpwatch status --json"
"""Where a hint sends people for a rank's stack and traceback: a shell command. The dashboard
shows them in its detail pane and writes that in its place (``tui.alerts_panel``)."""

_LOADER_PARTS = ("torch/utils/data/", "torch\\utils\\data\\")
_WORKER_WAITS = frozenset({"_get_data", "_try_get_data"})
"""Where ``_MultiProcessingDataLoaderIter`` (torch/utils/data/dataloader.py) waits for a batch."""
_FRAME_FUNCTION = re.compile(r'File "([^"]+)", line \d+, in (\w+)')
_MULTIPROCESSING = re.compile(r"[\\/]multiprocessing[\\/]")


def in_data_loading(stack: str | None) -> bool:
    """The rank's main thread waits for a DataLoader worker's batch: only a loader with
    ``num_workers > 0`` has workers; with none, the batch is made on the main thread and
    its stack shows the dataset's own code (the loader is not what to blame)."""
    if not stack:
        return False
    in_loader = False
    for path, function in _FRAME_FUNCTION.findall(stack):  # outermost first
        if any(part in path for part in _LOADER_PARTS):
            if function in _WORKER_WAITS:
                return True
            in_loader = True
        elif in_loader and _MULTIPROCESSING.search(path):
            return True  # the loader reads a worker's queue
    return False
