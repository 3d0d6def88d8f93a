"""The backend's own words for a C++ abort, from the job's stderr (``ddpwatch run``).

A rank that gloo or NCCL ends from C++ runs no Python again: what it says is written below
Python, by the C++ runtime, to the stderr every rank shares with the launcher::

    terminate called after throwing an instance of 'gloo::EnforceNotMet'
      what():  [enforce fail at …/pair.cc:456] op.preamble.length <= op.nbytes. 8 vs 4.
    Received data size doesn't match expected size. Is there a distributed collective …

``AbortLines`` reads the lines ``jobs/output.py``'s tee passes through and hands each such
pair on as a ``BackendAbort``; the server gives it to the rank whose black box says it died
of SIGABRT at that moment (``core/boxreader.py``): the line itself says which rank only where
the backend writes one in (NCCL's "[Rank 1]", torchrun's ``[rank1]:`` prefix).
"""

from __future__ import annotations

import re
import time
from collections.abc import Callable

from ddpwatch.core.boxreader import BackendAbort

_TERMINATE = re.compile(r"terminate called after throwing an instance of '([^']+)'")
_WHAT = re.compile(r"^\s*what\(\):\s*(.*\S)")
_PREFIX = re.compile(r"^\[(?:default|rank)(\d+)\]:\s?")  # torchrun's --tee prefixes
_RANK_IN_TEXT = re.compile(r"\[(?:PG ID \d+ PG GUID [^\]]* )?Rank (\d+)\]")  # NCCL's
WHAT_WITHIN = 3  # lines after "terminate called" that its "what():" may come in
MAX_MESSAGE = 600


class AbortLines:
    """Feed it the job's stderr line by line (``feed``); it calls ``on_abort`` for each C++
    abort it reads, with its exception type, message and, where written, rank."""

    def __init__(
        self,
        on_abort: Callable[[BackendAbort], None],
        clock: Callable[[], float] = time.time,
    ) -> None:
        self._on_abort = on_abort
        self._clock = clock
        self._pending: tuple[str, int | None, float] | None = None  # type, rank, when
        self._lines_since = 0

    def feed(self, line: str) -> None:
        prefixed = _PREFIX.match(line)
        rank = int(prefixed.group(1)) if prefixed else None
        text = line[prefixed.end() :] if prefixed else line
        found = _TERMINATE.search(text)
        if found is not None:
            self._pending = (found.group(1), rank, self._clock())
            self._lines_since = 0
            return
        pending = self._pending
        if pending is None:
            return
        what = _WHAT.match(text)
        if what is None:
            self._lines_since += 1
            if self._lines_since >= WHAT_WITHIN:
                self._pending = None
            return
        self._pending = None
        kind, said_rank, at = pending
        message = what.group(1)[:MAX_MESSAGE]
        in_text = _RANK_IN_TEXT.search(message)
        if said_rank is None and in_text is not None:
            said_rank = int(in_text.group(1))
        if rank is not None:
            said_rank = rank
        self._on_abort(BackendAbort(at, kind, message, said_rank))
