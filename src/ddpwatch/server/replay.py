"""``ddpwatch replay``: a recording fed through the same engine as a live server.

``ReplayServer`` is a ``StatusProvider`` like ``Server`` (``status()``, ``run()``, ``stop()``;
also ``state``, ``alerts``, ``lock``): an engine (``server/engine.py``), a recording reader and
a ``VirtualClock``. Frames are applied with their recorded receive times and diagnosis runs at
the recorded tick times, on the recorded horizon, on a clock that advances ``speed`` times as
fast as the recording did (or as fast as possible). So a replay raises and clears the same
alerts, in the same order, as the live server did.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any, NamedTuple

import msgspec

from ddpwatch.core.protocol import DEFAULT_PORT, Batch, ProtocolError, decode, decode_wire
from ddpwatch.core.vocabulary import HistoryEvent
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.history import AlertChange
from ddpwatch.diagnosis.rules import Diagnosis
from ddpwatch.server.engine import TICK_S, Engine, OnEngine
from ddpwatch.server.ingest import frame_failed, kind_of, mark_relayed, note_relay
from ddpwatch.server.recording import Record, RecordingReader
from ddpwatch.state.relays import RelayRecord
from ddpwatch.state.state import ServerState
from ddpwatch.status.schema import JobEnd, ReplayInfo, StatusDocument

log = logging.getLogger("ddpwatch")

MAX_GAP_S = 60.0  # a longer silence in a recording (clock step, idle file) is skipped, not waited


def _thresholds(recorded: Any, overrides: Mapping[str, Any]) -> Thresholds:
    """The recorded thresholds (a session's JSON), with ``overrides`` that are not None."""
    names = {f.name for f in dataclasses.fields(Thresholds)}
    values: dict[str, Any] = {}
    if isinstance(recorded, dict):
        values.update((k, v) for k, v in recorded.items() if k in names)
    values.update((k, v) for k, v in overrides.items() if k in names and v is not None)
    return Thresholds(**values)


class VirtualClock:
    """A recording's time: the receive time of the last record taken in (``now``), moving
    on ``speed`` times as fast as real time toward the next one's while the replay waits
    for it; standing still at max speed (``speed`` None) and once ``stop``ped."""

    def __init__(self, start: float, speed: float | None) -> None:
        self.speed = speed
        self.now = start  # virtual time of the last record taken in
        self._horizon = start  # virtual time of the record being waited for
        self._anchor_t = start
        self._anchor_m = time.monotonic()
        self._stopped = False

    def __call__(self) -> float:
        """The virtual now: between the last record taken in and the next one."""
        if self.speed is None or self._stopped:
            return self.now
        elapsed = (time.monotonic() - self._anchor_m) * self.speed
        return min(max(self._anchor_t + elapsed, self.now), max(self._horizon, self.now))

    def reach(self, t: float) -> None:
        """A record of time ``t`` was taken in."""
        self.now = max(self.now, t)

    def restart(self, t: float) -> None:
        """A new session starts at ``t``: the clock stands there."""
        self.now = self._horizon = self._anchor_t = t
        self._anchor_m = time.monotonic()

    def wait_until(self, t: float, stop: threading.Event) -> None:
        """Sleep until the clock reaches ``t`` (not at all at max speed), or ``stop``."""
        self._horizon = max(t, self.now)
        if self.speed is None:
            return
        if t - self.now > MAX_GAP_S:
            log.info("replay: skipping %.0f s without records", t - self.now)
            self._anchor_t, self._anchor_m = t, time.monotonic()
        delay = (t - self._anchor_t) / self.speed - (time.monotonic() - self._anchor_m)
        if delay > 0:
            stop.wait(delay)

    def stop(self) -> None:
        """The replay is over: the clock stands at its last record from now on."""
        self._stopped = True


class ReplayServer(OnEngine):
    """Replays a recording; ``run`` returns at its end (or at ``stop``), the state stays.

    ``speed``: virtual seconds per real second, None for as fast as possible.
    ``thresholds`` replaces the recorded thresholds; ``overrides`` changes some of
    them (by ``Thresholds`` field name).
    """

    def __init__(
        self,
        path: str | os.PathLike[str],
        speed: float | None = 1.0,
        on_change: Callable[[AlertChange], None] | None = None,
        thresholds: Thresholds | None = None,
        overrides: Mapping[str, Any] | None = None,
    ) -> None:
        self.path = Path(path)
        self.speed = speed
        self._on_change = on_change
        self._fixed_thresholds = thresholds
        self._overrides = dict(overrides or {})
        self._stop = threading.Event()
        self.finished = threading.Event()
        self.messages = 0
        self.sessions = 0
        self.raised = 0
        self.cleared = 0
        self._reader = RecordingReader(self.path)
        self._records: Iterator[Record] = iter(self._reader)
        self._pending: Record | None = next(self._records, None)
        start = self._pending.t if self._pending is not None else time.time()
        self.clock = VirtualClock(start, speed)
        self.engine = Engine(
            ServerState(started=start),
            thresholds or _thresholds(None, self._overrides),
            self.clock,
        )
        self.lock = self.engine.lock
        self._whole: dict[str, Callable[[Record], None]] = {
            "session": self._new_session,
            "job": self._job_ended,
            "route": self._take_route,
        }
        """The records taken as one, not frames or ticks, by kind."""
        self._relay: RelayRecord | None = None  # the relay the next frames came through
        self._pace = 0  # its pace (0: they came alone), as ``RankRecord.relayed`` says it
        self._ticks = False
        self._tick_s = TICK_S
        self._next_tick = start
        if self._pending is not None and self._pending.kind == "session":
            self._begin_session(self._pending)
            self._pending = None

    @property
    def tail_bytes(self) -> int:
        """Bytes after the recording's last whole record (a server that died mid-write)."""
        return self._reader.tail_bytes

    @property
    def progress(self) -> float:
        """How far through the recording the replay is, 0 to 1, by bytes read (1 at its end)."""
        if self.finished.is_set():
            return 1.0
        try:
            size = self.path.stat().st_size
        except OSError:
            return 0.0
        return min(1.0, self._reader.valid_bytes / size) if size else 1.0

    # ---------------------------------------------------------------- the views' side

    def status(self, *, final: bool = False) -> StatusDocument:
        """The status document as of the virtual now, built afresh: the clock moves;
        ``final``: its verdict judged as the watch ended (``Engine.final_document``)."""
        with self.lock:
            now = self.clock()
            document = self.engine.document_at(now, final=final)
        document.replay = ReplayInfo(
            file=str(self.path),
            speed=self.speed,
            position_s=round(now - self.state.started, 3),
            finished=self.finished.is_set(),
        )
        return document

    def status_json(self) -> bytes:
        return msgspec.json.encode(self.status())

    def stop(self) -> None:
        self._stop.set()

    # ---------------------------------------------------------------- the feed

    def run(self) -> None:
        """Feed every record at its (scaled) time; return at the end of the file or ``stop``."""
        try:
            if self._pending is not None:
                self._take(self._pending)
                self._pending = None
            for record in self._records:
                if self._stop.is_set():
                    break
                self._take(record)
            if not self._stop.is_set():
                self._end_session()
        finally:
            self._reader.close()
            self.clock.stop()
            self.finished.set()

    def _take(self, record: Record) -> None:
        taken = self._whole.get(str(record.kind))
        if taken is not None:
            taken(record)
            return
        if record.kind not in ("frame", "tick"):
            return  # a kind from a newer format
        self.clock.wait_until(record.t, self._stop)
        if self._stop.is_set():
            return
        if record.kind == "tick":
            if self._ticks:
                horizon = record.horizon
                if horizon is not None:
                    with self.lock:
                        self.state.heard_until, self.state.listening_since = horizon
                self.tick(record.t)
            return
        if not self._ticks:
            while self._next_tick <= record.t:
                self.tick(self._next_tick)
                self._next_tick += self._tick_s
        self._apply(record)

    def _new_session(self, record: Record) -> None:
        """Another server run wrote what follows: the last one's session ends here."""
        self._end_session()
        self._begin_session(record)

    def _take_route(self, record: Record) -> None:
        """How the frames that follow came: in a relay's batch (noted as the live server
        noted it: the relay, its pace, what it refused and coalesced) or alone. A batch that
        does not decode leaves them as if alone, as a recording without routes does."""
        relay, pace = None, 0
        if record.data:
            try:
                batch = decode_wire(record.data)
            except ProtocolError:
                batch = None
            if type(batch) is Batch:
                self.clock.wait_until(record.t, self._stop)
                with self.lock:
                    relay, pace = note_relay(self.state, batch, record.t), batch.every
                    self.clock.reach(record.t)
        self._relay, self._pace = relay, pace

    def _apply(self, record: Record) -> None:
        try:
            message = decode(record.data)
        except ProtocolError:
            with self.lock:
                self.state.rejected += 1
            return
        with self.lock:
            ranks = self.state.ranks
            known = ranks.get(message.rank)
            if known is not None:
                known.relayed = self._pace  # as ``ingest`` notes it, before applying
            try:
                self.state.apply(message, record.t)
            except Exception as exc:  # isolated as the live collector isolates it
                frame_failed(self.state, message.rank, kind_of(message), exc)
            mark_relayed(self.state, message.rank, self._pace)  # a new record too
            if self._relay is not None and message.rank in ranks:
                self._relay.ranks.add(message.rank)
            self.clock.reach(record.t)
        self.messages += 1

    def _job_ended(self, record: Record) -> None:
        """How the job ended, as the live server was told (``Server.end_job``); a record
        that does not decode is skipped, as a frame that does not is."""
        try:
            job_end = msgspec.json.decode(record.data, type=JobEnd)
        except msgspec.DecodeError:
            return
        self.clock.wait_until(record.t, self._stop)
        with self.lock:
            self.state.job_end = job_end
            self.clock.reach(record.t)

    def tick(self, now: float) -> list[AlertChange]:
        """Run diagnosis at virtual time ``now`` and report what changed."""
        with self.lock:
            self.clock.reach(now)
            changes = self.engine.tick(now)
        for change in changes:
            if change.event == HistoryEvent.CLEARED:
                self.cleared += 1
            elif change.event != HistoryEvent.UPDATED:
                self.raised += 1
            if self._on_change is not None:
                self._on_change(change)
        return changes

    def _begin_session(self, record: Record) -> None:
        """A server run starts: fresh state and alerts, its thresholds, port and tick times."""
        meta = record.session
        started = meta.get("started", record.t)
        started = float(started) if isinstance(started, (int, float)) else record.t
        tick_s = meta.get("tick_s")
        port = meta.get("port")
        engine = self.engine
        with self.lock:
            self.sessions += 1
            engine.port = port if isinstance(port, int) else DEFAULT_PORT  # hints name it
            if self._fixed_thresholds is None:
                engine.thresholds = _thresholds(meta.get("thresholds"), self._overrides)
            self._ticks = meta.get("ticks") is True
            self._tick_s = (
                float(tick_s) if isinstance(tick_s, (int, float)) and tick_s > 0 else (TICK_S)
            )
            if self.sessions > 1:
                engine.restart(ServerState(started=started))
            else:
                engine.state.started = started
                engine.diagnosis = Diagnosis()  # the live server's cadence, from its start
            self._next_tick = started
            self._relay, self._pace = None, 0
            self.clock.restart(started)

    def _end_session(self) -> None:
        if not self._ticks and self.messages:
            self.tick(self.clock.now)  # a recording without ticks: diagnose its final state too


class Replayed(NamedTuple):
    """A recording replayed to its end: the last document and how many server runs it held."""

    document: StatusDocument
    sessions: int


def replay_to_end(path: str | os.PathLike[str]) -> Replayed:
    """Replay ``path`` as fast as possible, judging it as the live server did (what ``ddpwatch
    report`` starts from). Raises ``RecordingError`` for a file that is not a recording."""
    replay = ReplayServer(path, speed=None)
    replay.run()
    return Replayed(replay.status(final=True), replay.sessions)
