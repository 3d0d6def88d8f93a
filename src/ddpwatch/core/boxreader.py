"""How a rank on this host died when it could not say so: read from its black box.

Both the server (``server/service.py``) and a node's relay (``relay.py``) read the boxes of
the ranks on their own host: a server on a laptop watching a cluster reads none, the relay
on each node reads its node's, and sends what they say on as the rank's own frames.

A rank that a fatal signal ends (gloo aborting it from C++, a segfault) sends nothing more;
its black box (``agent/blackbox.py``, format in ``core/blackbox.py``) still holds the last
collective it entered and faulthandler's dump of its threads. The server reads the box of a
rank on its own host once the rank is late, and, where the box holds a dump, takes it in as
the exit event the rank would have sent: killed by that signal, inside that collective, at
that stack. A box without a dump says nothing (the rank is slow, or its process still runs):
it is read again a second later, and never read once the rank has said how it ended.

Only ranks whose host name is this machine's, and only box names the agent makes, are read:
a hello cannot point the server at another file.

Under ``ddpwatch run`` the job's stderr also says why a C++ abort happened, in the backend's
words (``jobs/aborts.py``): ``note_abort`` keeps each such message, and a rank whose box says
SIGABRT gets the one written as it died, as the error of a crash event before its exit: the
message names the rank (NCCL's "[Rank 1]") or it is the only one unclaimed then (gloo's
never does); two aborts at once with different messages are told to neither.
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
from collections import deque
from collections.abc import Collection
from dataclasses import dataclass
from typing import Protocol

from ddpwatch.core.blackbox import NAME, BoxReading, box_dir, box_pid, process_gone, read_box
from ddpwatch.core.protocol import PROTOCOL_VERSION, Collective, ErrorInfo, Event
from ddpwatch.core.vocabulary import CollectiveSource, EventKind


class Watched(Protocol):
    """What a reader knows of a rank: a server's ``RankRecord``, a relay's ``RelayedRank``
    (read only: the time it was last heard on the reader's clock, ``time.time``; when it said
    it exited and the error it said it crashed with, None while it has not)."""

    @property
    def rank(self) -> int: ...
    @property
    def box(self) -> str | None: ...
    @property
    def host(self) -> str | None: ...
    @property
    def pid(self) -> int | None: ...
    @property
    def step(self) -> int | None: ...
    @property
    def last_seen(self) -> float: ...
    @property
    def exit_time(self) -> float | None: ...
    @property
    def error(self) -> object | None: ...


RETRY_S = 1.0  # how often a late rank's box is read again
RESCAN_S = 5.0  # how often the ranks on this host are looked for among all the ranks
ABORT_WITHIN_S = 5.0  # a C++ abort's message read this close to a rank's death may be its
ABORTS_KEPT = 64


@dataclass(frozen=True)
class BackendAbort:
    """A C++ abort the job's output told of: when it was read, the exception's type and
    message, and the rank the output says it was (None where it does not)."""

    at: float
    type: str
    message: str
    rank: int | None = None


class BoxReader:
    """Reads the boxes of this host's late ranks (``due``), each until it says something."""

    def __init__(self, directory: str | None = None, host: str | None = None) -> None:
        self.directory = directory or box_dir()
        self.host = host if host is not None else _hostname()
        self._local: list[Watched] = []
        self._scanned_at = -RESCAN_S
        self._scanned_ranks = 0
        self._next: dict[tuple[int, str], float] = {}
        self._done: set[tuple[int, str]] = set()
        self._aborts: deque[BackendAbort] = deque(maxlen=ABORTS_KEPT)
        self._aborts_lock = threading.Lock()

    def note_abort(self, abort: BackendAbort) -> None:
        """A C++ abort's message from the job's output (any thread: the tee's)."""
        with self._aborts_lock:
            self._aborts.append(abort)

    def due(
        self, ranks: Collection[Watched], now: float, late_s: float, *, ended: bool = False
    ) -> list[tuple[Event, float]]:
        """The exit events the boxes of this host's ranks late by ``late_s`` or more tell,
        each with when the rank died: when the dump was written, between its last message
        and ``now`` (``ranks``: every record; this host's are picked out again every
        ``RESCAN_S``, and as soon as their number changes). ``ended``: the job is over, so
        every box not yet read is read now, however recently its rank spoke."""
        if ended or now - self._scanned_at >= RESCAN_S or len(ranks) != self._scanned_ranks:
            self._scanned_at, self._scanned_ranks = now, len(ranks)
            # by host alone: a rank's box is named in a later hello than its first one
            # (the boot hook's early hello comes before the agent opens its box)
            self._local = [r for r in ranks if r.host in (self.host, None)]
        if ended:
            self._sweep_finished()
        found: list[tuple[BoxReading, Watched, float]] = []
        for record in self._local:
            box = self._due_box(record, now, late_s, ended)
            if box is None:
                continue
            self._next[(record.rank, box)] = now + RETRY_S
            reading = self._read(record, box)
            if reading is not None:
                self._done.add((record.rank, box))
                found.append((reading, record, min(now, max(record.last_seen, reading.written_at))))
        if not found:
            return []
        said = self._said(found)
        events: list[tuple[Event, float]] = []
        for reading, record, died in found:
            abort = said.get(record.rank)
            if abort is not None:
                events.append((crash_event(abort, reading, record), died))
            events.append((exit_event(reading, record), died))
        return events

    def _sweep_finished(self) -> None:
        """The job is over: the boxes of this host's ranks that said how they ended, and whose
        process is gone, are removed. A rank removes its own once it has said so, but one
        killed while it flushed its exit (seen once, loaded: torchrun ending a gloo-aborted
        job's last rank) leaves it; nothing in it is news, and no reader would take it."""
        for record in self._local:
            box = record.box
            if box is None or record.host != self.host or not NAME.match(box):
                continue
            if record.exit_time is None and record.error is None:
                continue  # read as a late rank's, below
            if not process_gone(box_pid(box)):
                continue  # still flushing (its agent removes it), or not ours
            with contextlib.suppress(OSError):
                os.unlink(os.path.join(self.directory, box))
                self._done.add((record.rank, box))

    def _due_box(self, record: Watched, now: float, late_s: float, ended: bool) -> str | None:
        """The box of ``record`` to read now, if any: a rank of this host that has not said
        how it ended, late (or the job over), not read already, not read within ``RETRY_S``."""
        box = record.box
        if box is None or record.host != self.host:
            return None
        if record.exit_time is not None or record.error is not None:
            return None
        if not ended and now - record.last_seen < late_s:
            return None
        key = (record.rank, box)
        if key in self._done or (not ended and self._next.get(key, -1.0) > now):
            return None
        return box

    def _said(
        self, found: list[tuple[BoxReading, Watched, float]]
    ) -> dict[int, BackendAbort]:
        """Which aborted rank gets which abort message: the one naming it, else the only one
        unclaimed within ``ABORT_WITHIN_S`` of its death (or several, word for word the same,
        as many as the ranks aborted then); each message told once."""
        with self._aborts_lock:
            aborts = list(self._aborts)
        said: dict[int, BackendAbort] = {}
        used: set[int] = set()
        aborted = [(r, d) for reading, r, d in found if reading.signal == "SIGABRT"]
        for record, _ in aborted:
            for index, abort in enumerate(aborts):
                if abort.rank == record.rank and index not in used:
                    said[record.rank] = abort
                    used.add(index)
                    break
        for record, died in aborted:
            if record.rank in said:
                continue
            near = [
                (index, abort)
                for index, abort in enumerate(aborts)
                if index not in used
                and abort.rank is None
                and died - ABORT_WITHIN_S <= abort.at <= died + ABORT_WITHIN_S
            ]
            texts = {(a.type, a.message) for _, a in near}
            unclaimed = [r for r, _ in aborted if r.rank not in said]
            if len(texts) == 1 and len(near) >= len(unclaimed):
                index, abort = near[0]
                said[record.rank] = abort
                used.add(index)
        with self._aborts_lock:
            self._aborts = deque(
                (a for i, a in enumerate(aborts) if i not in used), maxlen=ABORTS_KEPT
            )
        return said

    def _read(self, record: Watched, box: str) -> BoxReading | None:
        key = (record.rank, box)
        if not NAME.match(box):
            self._done.add(key)
            return None
        path = os.path.join(self.directory, box)
        reading = read_box(path)
        if reading is None:
            if not os.path.exists(path):
                self._done.add(key)  # removed at a clean exit: its own exit event says it
            return None
        if reading.rank != record.rank or (record.pid is not None and reading.pid != record.pid):
            self._done.add(key)
            return None
        if reading.signal is None:
            return None
        with contextlib.suppress(OSError):
            os.unlink(path)  # read: nothing is left for anyone
        return reading


def exit_event(reading: BoxReading, record: Watched) -> Event:
    """The exit event a box with a fatal signal's dump stands for: the signal, the
    collective the rank was inside (if it was), and its main thread's stack."""
    return Event(
        v=PROTOCOL_VERSION,
        rank=record.rank,
        t=record.last_seen,
        event=EventKind.EXIT,
        signal=reading.signal,
        step=reading.step if reading.step is not None else record.step,
        phase=reading.phase if reading.in_call else None,
        collective=_call_in(reading),
        stack=reading.stack,
    )


def _call_in(reading: BoxReading) -> Collective | None:
    """The collective the box says the rank died inside, if it was inside one."""
    if reading.call is None or not reading.in_call:
        return None
    op, dtype, numel, reduce_op, root = reading.call
    return Collective(
        op=op,
        seq=reading.seq or None,
        source=CollectiveSource.PY,
        shape=None if numel is None else [numel],
        dtype=dtype,
        reduce_op=reduce_op,
        root=root,
    )


def crash_event(abort: BackendAbort, reading: BoxReading, record: Watched) -> Event:
    """The crash a C++ abort's message stands for, as the rank's own exception would have
    been sent: its type and message, where the rank was, the collective it was inside."""
    return Event(
        v=PROTOCOL_VERSION,
        rank=record.rank,
        t=abort.at,
        event=EventKind.CRASH,
        error=ErrorInfo(type=abort.type, message=abort.message),
        step=reading.step if reading.step is not None else record.step,
        collective=_call_in(reading),
        stack=reading.stack,
    )


def _hostname() -> str | None:
    try:
        return socket.gethostname() or None
    except OSError:
        return None
