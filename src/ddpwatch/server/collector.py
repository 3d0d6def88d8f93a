"""Sockets of the server: PULL for the ranks' messages, REP for read-only status queries.

Every frame is validated by the protocol decoder; a bad one is counted in
``state.rejected`` and dropped, never raised. So is a valid frame that would make
the server track more ranks than ``rank_cap()`` allows (memory stays bounded
whatever arrives). Failed handshakes are counted in ``refused``: with CURVE on, a
client with no key, the wrong server key or a key not allowed; always, a peer that
is not ZeroMQ. Accepted frames go to the optional ``recorder`` with their receive
time.

A relay's ``Batch`` (``ddpwatch/relay.py``) is opened here: each frame in it is validated,
admitted, recorded and counted as if it had come alone, in the order the relay took them.

The collector also tells diagnosis how far its view is complete: ``state.heard_until`` is
the last time it found its queue empty, and ``state.listening_since`` moves forward when it
has been behind (senders may have dropped heartbeats meanwhile) or was not running at all
(a suspended laptop, SIGSTOP, a starved host). A rank is never called silent for a quiet
spell the server did not really listen through.
"""

from __future__ import annotations

import contextlib
import logging
import math
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from ddpwatch.protocol import (
    MAX_FRAME_BYTES,
    MAX_QUERY_BYTES,
    AnyMessage,
    Batch,
    ProtocolError,
    Sample,
    decode,
    decode_wire,
)
from ddpwatch.server.relays import note_batch
from ddpwatch.server.state import ServerState

if TYPE_CHECKING:
    from ddpwatch.security import ServerCurve
    from ddpwatch.server.recording import Recorder

log = logging.getLogger("ddpwatch.server")

RECV_BATCH = 10_000
RANK_MARGIN = 64  # ranks tracked beyond the known world size (elastic jobs, restarts)
UNKNOWN_WORLD_RANKS = 1024  # ranks tracked while no rank has reported a world size
RANK_CEILING = 65_536  # without --max-ranks: the most ranks, and the largest world size, taken
REFUSED_LOG_S = 10.0
MAX_RELAY_AGE_US = 60_000_000  # a frame a relay held longer is dated a minute back, no more
PAUSE_S = 1.0
"""Wall time this much longer than the server's own CPU time and waits: it was not running."""


class BindError(RuntimeError):
    """The server could not listen where asked (port taken, bad address)."""


class Collector:
    """Receives rank messages into ``state`` and answers status queries with ``snapshot()``."""

    def __init__(
        self,
        state: ServerState,
        snapshot: Callable[[], bytes],
        host: str = "127.0.0.1",
        port: int = 5599,
        clock: Callable[[], float] = time.time,
        *,
        max_ranks: int | None = None,
        curve: ServerCurve | None = None,
        recorder: Recorder | None = None,
        query: Callable[[bytes], bytes] | None = None,
    ) -> None:
        self.state = state
        self.host = host
        self.port = port
        self.max_ranks = max_ranks
        self.recorder = recorder
        self.refused = 0  # failed handshakes: a refused client retries, each try counts
        self._world = 0  # the largest world size accepted so far
        self._refused_logged = -REFUSED_LOG_S
        self._snapshot = snapshot
        self._query_reply = query
        self._clock = clock
        self._behind = False  # the last receive left messages queued
        self._pauses = PauseWatch()
        self._context = zmq.Context()
        self._auth: Any = None
        self._monitors: list[zmq.Socket[Any]] = []
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        self._query = self._context.socket(zmq.REP)
        self._query.setsockopt(zmq.MAXMSGSIZE, MAX_QUERY_BYTES)
        for sock in (self._pull, self._query):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            if curve is not None:
                self._auth = curve.start_authenticator(self._context)
                for sock in (self._pull, self._query):
                    curve.apply(sock)
            self._monitors = [sock.get_monitor_socket(_HANDSHAKE_FAILED) for sock in self.sockets]
            self._pull.bind(f"tcp://{host}:{port}")
            self._query.bind(f"tcp://{host}:{port + 1}")
        except zmq.ZMQError as exc:
            self.close()
            raise BindError(_bind_message(host, port, exc)) from None
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._query, zmq.POLLIN)
        for monitor in self._monitors:
            self._poller.register(monitor, zmq.POLLIN)

    @property
    def sockets(self) -> tuple[zmq.Socket[Any], zmq.Socket[Any]]:
        return (self._pull, self._query)

    def rank_cap(self, world_size: int | None = None) -> int:
        """How many ranks the server tracks: ``max_ranks``, else the known world size plus
        ``RANK_MARGIN`` (``UNKNOWN_WORLD_RANKS`` while unknown), at most ``RANK_CEILING``."""
        if self.max_ranks is not None:
            return self.max_ranks
        world = max(self._world, world_size or 0)
        return min(RANK_CEILING, world + RANK_MARGIN if world else UNKNOWN_WORLD_RANKS)

    def _admit(self, message: AnyMessage) -> bool:
        """False for a valid message the server will not track: a new rank beyond the cap,
        or a world size larger than it could ever track."""
        world = getattr(message, "world_size", None)
        if world is not None and world > (self.max_ranks or RANK_CEILING):
            return False
        if message.rank not in self.state.ranks and len(self.state.ranks) >= self.rank_cap(world):
            return False
        if world is not None and world > self._world:
            self._world = world
        return True

    def poll(self, timeout_s: float, lock: threading.Lock | None = None) -> int:
        """Wait up to ``timeout_s`` for traffic, then take in all that is ready; returns the count.

        ``lock`` is held only while state changes, not while waiting or answering.
        """
        waiting = time.time()
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._pauses.paused(idle_s=min(time.time() - waiting, timeout_s)):
            self._behind = True  # what arrives next may be late or lost: listen afresh
        count = 0
        if self._pull in events:
            with lock or contextlib.nullcontext():
                count = self._receive()
        else:
            self._caught_up(self._clock())
        if self._query in events:
            self._answer()
        for monitor in self._monitors:
            if monitor in events:
                self._count_refused(monitor)
        return count

    def _count_refused(self, monitor: zmq.Socket[Any]) -> None:
        while True:
            try:
                raw = monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:  # Again: drained
                return
            try:
                event = parse_monitor_message(raw)
            except (ValueError, IndexError, KeyError):
                continue
            if not event["event"] & _HANDSHAKE_FAILED:
                continue
            self.refused += 1
            now = time.monotonic()
            if now - self._refused_logged >= REFUSED_LOG_S:
                self._refused_logged = now
                # without CURVE these are port probes and peers gone mid-handshake: quiet
                log.log(
                    logging.WARNING if self._auth is not None else logging.DEBUG,
                    "refused a connection on %s: handshake failed (%s); %d refused so far",
                    event.get("endpoint", b"").decode(errors="replace") or self.port,
                    _handshake_reason(event["event"]),
                    self.refused,
                )

    def _receive(self) -> int:
        """Take in up to ``RECV_BATCH`` messages (a batch counts each one in it). Under
        backlog a known rank's heartbeats are coalesced: only its newest ``Sample`` of the
        batch is applied, plus any that ``_must_apply`` (only intermediate history points are
        lost); its events keep their order."""
        now = self._clock()
        state = self.state
        recv, option = self._pull.recv, self._pull.getsockopt  # bound once: per-frame cost
        pending: dict[int, tuple[Sample, float]] = {}
        count = 0
        drained = False
        while count < RECV_BATCH:
            try:
                frame = recv(zmq.NOBLOCK)
            except zmq.Again:
                drained = True
                break
            count += 1
            if option(zmq.RCVMORE):
                self._drop_multipart()
                continue
            try:
                message = decode_wire(frame)
            except ProtocolError:
                state.rejected += 1
                continue
            if type(message) is Batch:
                self._open_batch(message, now, pending)
                count += len(message.frames)  # the limit counts heartbeats, not frames
            else:
                self._take(frame, message, now, pending, relayed=False)  # type: ignore[arg-type]
        for sample, at in pending.values():
            state.apply(sample, at)
        if drained:
            self._caught_up(now)  # the queue ran dry: all sent before ``now`` is read
        else:
            self._behind = True
        return count

    def _caught_up(self, now: float) -> None:
        """The queue was found empty at ``now``: the state is complete up to then; after a
        backlog or a pause, silence counts afresh from here."""
        state = self.state
        state.heard_until = now
        if self._behind:
            self._behind = False
            state.listening_since = now

    def _open_batch(
        self, batch: Batch, now: float, pending: dict[int, tuple[Sample, float]]
    ) -> None:
        """Take a relay's frames, each dated by its arrival at the relay."""
        state = self.state
        state.rejected += batch.rejected  # frames the relay refused count as ours would
        relay = note_batch(state.relays, batch, now)
        ages = batch.ages_us if len(batch.ages_us) == len(batch.frames) else None
        for i, frame in enumerate(batch.frames):
            try:
                message = decode(frame)
            except ProtocolError:
                state.rejected += 1
                continue
            at = now if ages is None else now - min(ages[i], MAX_RELAY_AGE_US) / 1e6
            if self._take(frame, message, at, pending, relayed=True) and relay is not None:
                relay.ranks.add(message.rank)

    def _take(
        self,
        frame: bytes,
        message: AnyMessage,
        at: float,
        pending: dict[int, tuple[Sample, float]],
        *,
        relayed: bool,
    ) -> bool:
        """Admit, record and apply one rank message that arrived ``at`` (a heartbeat may wait
        in ``pending`` for a newer one), through a relay or not; False when not admitted."""
        state = self.state
        if not self._admit(message):
            state.rejected += 1
            return False
        if self.recorder is not None:
            self.recorder.frame(at, frame)
        record = state.ranks.get(message.rank)
        if type(message) is Sample and record is not None:
            record.relayed = relayed
            superseded = pending.get(message.rank)
            if superseded is not None:
                if _must_apply(superseded[0], message):
                    state.apply(*superseded)
                else:
                    state.received += 1  # counted, not applied
            pending[message.rank] = (message, at)
            return True
        earlier = pending.pop(message.rank, None)
        if earlier is not None:
            state.apply(*earlier)
        state.apply(message, at)
        state.ranks[message.rank].relayed = relayed
        return True

    def _drop_multipart(self) -> None:
        """The protocol is one frame per message: a multipart message is one reject."""
        self.state.rejected += 1
        while self._pull.getsockopt(zmq.RCVMORE):
            try:
                self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _answer(self) -> None:
        """``status``: ``snapshot()``; any other request: ``query(request)`` when given (the
        summaries and pages of ``status?...``), else an error. Always a reply: a REP socket
        that does not answer is stuck."""
        try:
            request = b"".join(self._query.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return
        if request.strip() == b"status":
            reply = self._snapshot()
        elif self._query_reply is not None:
            reply = self._query_reply(request)
        else:
            reply = b'{"error": "unknown request; send the bytes status"}'
        self._query.send(reply)

    def close(self) -> None:
        for sock, monitor in zip(self.sockets, self._monitors, strict=False):
            with contextlib.suppress(zmq.ZMQError):
                sock.disable_monitor()
            monitor.close()
        self._pull.close()
        self._query.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()


class PauseWatch:
    """Notices the server not running: wall time that was neither spent on CPU nor in a
    wait the server asked for (a suspended laptop, SIGSTOP, a host too busy to schedule it).
    Meanwhile nothing was read, so silence seen across it is not evidence."""

    def __init__(self) -> None:
        self._wall = time.time()
        self._cpu = time.process_time()

    def paused(self, idle_s: float) -> bool:
        """Since the last call: more than ``PAUSE_S`` unaccounted for, after ``idle_s`` of
        waiting that was asked for."""
        wall, cpu = time.time(), time.process_time()
        lost = (wall - self._wall) - (cpu - self._cpu) - idle_s
        self._wall, self._cpu = wall, cpu
        return lost > PAUSE_S


def _must_apply(superseded: Sample, newer: Sample) -> bool:
    """A superseded heartbeat still counts if it reports a NaN loss (even one gone by the next
    beat) or tells an identity the newer one leaves out (a new pid or device)."""
    if superseded.loss is not None and not math.isfinite(superseded.loss):
        return True
    return _tells_identity(superseded) and not _tells_identity(newer)


def _tells_identity(sample: Sample) -> bool:
    """Whether a heartbeat repeats the identity, by the fields every identity has in practice
    (four attribute reads: this runs for most frames of a backlog)."""
    return (
        sample.pid is not None
        or sample.host is not None
        or sample.world_size is not None
        or sample.device is not None
    )


_HANDSHAKE_FAILED = (
    zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL
    | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
    | zmq.EVENT_HANDSHAKE_FAILED_AUTH
)


def _handshake_reason(event: int) -> str:
    if event & zmq.EVENT_HANDSHAKE_FAILED_AUTH:
        return "client key not allowed"
    if event & zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL:
        return "protocol error: no key, the wrong server key, or not a ZeroMQ peer"
    return "no key, or a different security mechanism"


def _bind_message(host: str, port: int, exc: zmq.ZMQError) -> str:
    if exc.errno == zmq.EADDRINUSE:
        return (
            f"port {port} or {port + 1} on {host} is already in use "
            f"(another ddpwatch serve?): stop it or pick another --port"
        )
    return f"cannot listen on {host}:{port} and {port + 1}: {exc.strerror}"
