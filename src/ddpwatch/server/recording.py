"""Recordings of what a server took in, for ``ddpwatch replay`` (format: ``docs/recording.md``).

A recording is the 8 bytes ``DDPWREC1`` followed by records, all little-endian::

    u32 length   bytes in body
    u32 crc32    zlib.crc32 of body
    body:
      u8  kind   0 session, 1 frame, 2 tick, 3 job, 4 route (others: skipped by readers)
      f64 time   the server's clock, unix seconds
      payload    session: UTF-8 JSON object; frame: the accepted frame's bytes;
                 tick: f64 heard_until (NaN: none), f64 listening_since (or empty);
                 job: UTF-8 JSON object, the status document's ``job_end``;
                 route: the relay's batch the frames that follow came in, each of its
                 frames emptied (MessagePack); empty: the frames that follow came alone

A ``session`` record starts each server run that wrote to the file (its thresholds
and start time); ``frame`` records are the accepted messages with their receive
time, in the order the server applied them, each ``route`` record saying how those after it
came (through which relay, at which pace, or alone); ``tick`` records are the times the
server ran diagnosis; a ``job`` record says how the job ended, as the ``ddpwatch run`` that
launched it saw it (who stopped it, why it never started: what no rank can report), so a
replay and ``ddpwatch report`` tell it as the live summary did. A reader stops at the first
record that is not whole (the server died mid-write) and reports how many bytes it left
unread; a writer that reopens such a file cuts that tail off before appending.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import struct
import threading
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, BinaryIO, Literal

from ddpwatch.core.protocol import MAX_FRAME_BYTES

log = logging.getLogger("ddpwatch.server")

MAGIC = b"DDPWREC1"
FORMAT_VERSION = 1
KIND_SESSION, KIND_FRAME, KIND_TICK, KIND_JOB, KIND_ROUTE = 0, 1, 2, 3, 4
RecordKind = Literal["session", "frame", "tick", "job", "route"]
_KIND_NAMES: dict[int, RecordKind] = {
    KIND_SESSION: "session",
    KIND_FRAME: "frame",
    KIND_TICK: "tick",
    KIND_JOB: "job",
    KIND_ROUTE: "route",
}
_HEAD = struct.Struct("<II")  # length, crc32
_BODY = struct.Struct("<Bd")  # kind, time
_TICK = struct.Struct("<dd")  # heard_until (NaN: None), listening_since
MAX_BODY = _BODY.size + MAX_FRAME_BYTES + (1 << 16)  # a longer length field is corruption
FLUSH_S = 0.2  # at most this often: in effect every server tick (0.25 s); the contract is 1 s


class RecordingError(ValueError):
    """A file that is not a ddpwatch recording, or cannot be opened as one."""


@dataclass(frozen=True)
class Record:
    """One record: ``data`` is the frame for ``frame``, the JSON text for ``session`` and
    ``job``."""

    kind: RecordKind | int
    t: float
    data: bytes = b""

    @property
    def horizon(self) -> tuple[float | None, float] | None:
        """A ``tick`` record's ``heard_until`` and ``listening_since``; None if not recorded."""
        if self.kind != "tick" or len(self.data) != _TICK.size:
            return None
        heard, since = _TICK.unpack(self.data)
        return (None if math.isnan(heard) else heard, since)

    @property
    def session(self) -> dict[str, Any]:
        """A ``session`` record's metadata (empty for other kinds or unreadable JSON)."""
        if self.kind != "session":
            return {}
        try:
            value = json.loads(self.data)
        except ValueError:
            return {}
        return value if isinstance(value, dict) else {}


def encode_record(kind: int, t: float, payload: bytes = b"") -> bytes:
    body = _BODY.pack(kind, t) + payload
    return _HEAD.pack(len(body), zlib.crc32(body)) + body


class RecordingReader:
    """Iterates the whole records of a recording; ``tail_bytes`` is what it left at the end.

    Reads the file as it is when iterated, so a file a server still appends to is
    read up to its last whole record. Raises ``RecordingError`` when ``path`` is
    not a recording.
    """

    def __init__(self, path: str | os.PathLike[str]) -> None:
        self.path = Path(path)
        self.tail_bytes = 0  # bytes after the last whole record (a torn write)
        self.valid_bytes = len(MAGIC)  # bytes up to the end of the last whole record
        self.records_read = 0
        try:
            self._file: BinaryIO | None = self.path.open("rb")
        except OSError as exc:
            raise RecordingError(f"cannot open {self.path}: {exc.strerror or exc}") from None
        magic = self._file.read(len(MAGIC))
        if magic != MAGIC:
            self._file.close()
            if magic[:7] == MAGIC[:7] and len(magic) == len(MAGIC):
                raise RecordingError(
                    f"{self.path} is a recording of format {magic[7:]!r}; this ddpwatch reads "
                    f"{MAGIC[7:]!r}"
                )
            raise RecordingError(f"{self.path} is not a ddpwatch recording")

    def __iter__(self) -> Iterator[Record]:
        file = self._file
        if file is None:
            return
        try:
            yield from self._records(file)
        finally:
            self.close()

    def _records(self, file: BinaryIO) -> Iterator[Record]:
        while True:
            head = file.read(_HEAD.size)
            if len(head) < _HEAD.size:
                self.tail_bytes = len(head)
                break
            length, crc = _HEAD.unpack(head)
            if not _BODY.size <= length <= MAX_BODY:
                self.tail_bytes = _rest(file, len(head))
                break
            body = file.read(length)
            if len(body) < length or zlib.crc32(body) != crc:
                self.tail_bytes = _rest(file, len(head) + len(body))
                break
            self.valid_bytes += _HEAD.size + length
            kind, t = _BODY.unpack_from(body)
            self.records_read += 1
            yield Record(_KIND_NAMES.get(kind, kind), t, body[_BODY.size :])

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
            self._file = None

    def __enter__(self) -> RecordingReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def _rest(file: BinaryIO, already: int) -> int:
    """Bytes from the start of a bad record to the end of the file."""
    here = file.tell()
    end = file.seek(0, os.SEEK_END)
    return already + (end - here)


def read_records(path: str | os.PathLike[str]) -> list[Record]:
    """Every whole record of a recording (convenience for small files and tests)."""
    return list(RecordingReader(Path(path)))


def valid_length(path: str | os.PathLike[str]) -> int:
    """Bytes of ``path`` up to its last whole record."""
    reader = RecordingReader(Path(path))
    for _ in reader:
        pass
    return reader.valid_bytes


class Recorder:
    """Appends a session record, then each accepted frame and each diagnosis tick.

    Thread-safe. Writes go to a buffer that ``flush()``, called by the server loop
    every tick (0.25 s), hands to the OS (at most every ``FLUSH_S``). A failing disk
    stops the recording with one logged error; the server goes on.
    """

    def __init__(self, path: str | os.PathLike[str], session: dict[str, Any]) -> None:
        self.path = Path(path)
        self.frames = 0
        self.failed = False
        self._lock = threading.Lock()
        self._dirty = False
        self._routed = False  # the last route written was a relay's batch
        self._last_flush = time.monotonic()
        self._file: BinaryIO | None = _open_for_append(self.path)
        meta = {"format": FORMAT_VERSION, **session}
        t = float(session.get("started", time.time()))
        self._write(encode_record(KIND_SESSION, t, json.dumps(meta).encode()))
        self.flush(force=True)

    def frame(self, t: float, data: bytes) -> None:
        """One accepted frame and the server's receive time."""
        self._write(encode_record(KIND_FRAME, t, data))
        self.frames += 1

    def route(self, t: float, batch: bytes = b"") -> None:
        """The frames recorded next came in ``batch`` (a relay's, its frames emptied, as
        ``ingest`` encodes it), or alone (empty): a replay judges a relayed rank as the live
        server did, with its relay's pace, and knows the relays. "Alone" is written only
        after a batch: a recording starts with frames that came alone."""
        if not batch and not self._routed:
            return
        self._write(encode_record(KIND_ROUTE, t, batch))
        self._routed = bool(batch)

    def tick(
        self, t: float, heard_until: float | None = None, listening_since: float = -math.inf
    ) -> None:
        """The server ran diagnosis at ``t``, with its view complete up to ``heard_until``
        and unbroken since ``listening_since`` (``ServerState``)."""
        heard = math.nan if heard_until is None else heard_until
        self._write(encode_record(KIND_TICK, t, _TICK.pack(heard, listening_since)))

    def job(self, t: float, job_end: bytes) -> None:
        """How the job ended (``job_end``, JSON), as the ``ddpwatch run`` that launched it saw
        it; handed to the OS at once: the run is about to end."""
        self._write(encode_record(KIND_JOB, t, job_end))
        self.flush(force=True)

    def _write(self, data: bytes) -> None:
        with self._lock:
            if self._file is None:
                return
            try:
                self._file.write(data)
                self._dirty = True
            except OSError as exc:
                self._fail(exc)

    def flush(self, force: bool = False) -> None:
        """Hand buffered records to the OS if any wait and ``FLUSH_S`` passed (or ``force``)."""
        with self._lock:
            if self._file is None or not self._dirty:
                return
            now = time.monotonic()
            if not force and now - self._last_flush < FLUSH_S:
                return
            try:
                self._file.flush()
            except OSError as exc:
                self._fail(exc)
                return
            self._dirty = False
            self._last_flush = now

    def _fail(self, exc: OSError) -> None:
        self.failed = True
        log.error("recording to %s stopped: %s", self.path, exc.strerror or exc)
        file, self._file = self._file, None
        if file is not None:
            with contextlib.suppress(OSError):
                file.close()

    def close(self) -> None:
        self.flush(force=True)
        with self._lock:
            file, self._file = self._file, None
        if file is not None:
            try:
                file.close()
            except OSError as exc:
                log.error("recording to %s: %s", self.path, exc.strerror or exc)


def _open_for_append(path: Path) -> BinaryIO:
    """Open ``path`` to append records: a new file gets the magic, an existing recording
    loses a partial last record first, anything else is refused."""
    try:
        size = path.stat().st_size
    except FileNotFoundError:
        size = 0
    except OSError as exc:
        raise RecordingError(f"cannot record to {path}: {exc.strerror or exc}") from None
    file: BinaryIO
    try:
        if size == 0:
            file = path.open("wb")
            file.write(MAGIC)
            return file
        keep = valid_length(path)  # raises RecordingError for a file that is not a recording
        file = path.open("r+b")
        if keep < size:
            log.warning(
                "%s ended in a partial record (%d bytes): cut off before appending",
                path,
                size - keep,
            )
            file.truncate(keep)
        file.seek(keep)
        return file
    except OSError as exc:
        raise RecordingError(f"cannot record to {path}: {exc.strerror or exc}") from None
