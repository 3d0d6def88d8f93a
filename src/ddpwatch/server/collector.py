"""Sockets of the server: PULL for the ranks' messages, REP for read-only status queries.

What a receive takes off the PULL socket goes through ingest (``server/ingest.py``): one path
for every rank frame, alone or in a relay's ``Batch`` (``ddpwatch/relay.py``), validated,
admitted, recorded and applied in the order they came; a bad one is counted in
``state.rejected`` and dropped, never raised. So is a valid frame that would make the server
track more ranks than ``rank_cap()`` allows (memory stays bounded whatever arrives). Failed
handshakes are counted in ``refused``: with CURVE on, a client with no key, the wrong server
key or a key not allowed; always, a peer that is not ZeroMQ.

The collector says how much a receive takes and whether it sheds: behind its queue, it reads
more per receive and ingest applies only each rank's newest heartbeat (``BEHIND_BEATS``); far
behind, ingest counts superseded heartbeats without decoding them, leaving each rank's record
as that coalescing would (``SHED_AFTER_S``). A status query is not kept waiting by such a long
receive (``ANSWER_EVERY``). The records of ranks new since the last time are moved out of
Python's cyclic garbage collector's passes (``FREEZE_AFTER_RANKS``).

The collector also tells diagnosis how far its view is complete: ``state.heard_until`` is
the last time it found its queue empty, and ``state.listening_since`` moves forward when it
has been behind long enough that senders may have dropped heartbeats (``LISTEN_AFRESH_S``)
or was not running at all (a suspended laptop, SIGSTOP, a starved host). A rank is never
called silent for a quiet spell the server did not really listen through.
"""

from __future__ import annotations

import contextlib
import gc
import logging
import math
import time
from collections.abc import Callable
from typing import TYPE_CHECKING, Any, cast

import msgspec
import zmq
from zmq.utils.monitor import parse_monitor_message

from ddpwatch.core.protocol import MAX_FRAME_BYTES, MAX_QUERY_BYTES, PACE_REQUEST, AnyMessage
from ddpwatch.server.ingest import Receive
from ddpwatch.server.pace import Pace
from ddpwatch.state.state import ServerState

if TYPE_CHECKING:
    from ddpwatch.core.security import ServerCurve
    from ddpwatch.server.recording import Recorder

log = logging.getLogger("ddpwatch.server")

RECV_BATCH = 10_000
BEHIND_BEATS = 4
"""Behind, a receive takes up to this many heartbeats per known rank (``RECV_BATCH`` at
least), so that it holds most ranks more than once and applies only each one's newest: with
tens of thousands of ranks, ``RECV_BATCH`` holds no rank twice, nothing is coalesced, and a
server that fell behind by a little stays behind (measured in ``docs/performance.md``, §7).
Four, not two: a relay's batches that the next one in the receive supersedes are left
unread (``ingest.superseded``), so three in four cost a batch's decode; at 65,536 ranks
through relays a heartbeat of a backlog costs 7.3 µs, against 9.9 at two (``ingest_cpu``)."""
CONNECT_BACKLOG = 4096
"""Connections the kernel queues for the server before it accepts them (``listen``'s backlog;
ZeroMQ's default is 100, the kernel caps it at ``net.core.somaxconn``). Thousands of relays or
ranks connect within a second at a job's start; past the backlog their connects are dropped
and retried 1, 3, 7 s later, and ranks that were running look as if they never came (seen in
``benchmarks/scale.py`` at 32,768 ranks: 2,816 ranks unheard 11 s after the start)."""
SHED_AFTER_S = 10.0
"""Behind for longer than this (since the queue was last found empty), the server sheds: a
plain heartbeat (no identity, a finite loss) of a known rank that a newer one of the same
rank follows in the same receive is counted from its head alone (``state.received`` and
``state.shed``), not decoded (``ingest._Shedding`` says which: those whose records come out
the same either way). Validating and holding them is most of a superseded heartbeat's cost,
so a server far behind spends less a heartbeat and catches up sooner (``docs/performance.md``,
§7; ``benchmarks/ingest_cpu.py``). A frame refused only when decoded that follows a shed
heartbeat still counts as its successor."""
SHED_BEATS = 4
"""Shedding, a receive takes up to this many heartbeats per known rank (``BEHIND_BEATS``
otherwise): three of four are then shed."""
ANSWER_EVERY = 8192
"""Within a receive, a status query that waits is answered every this many heartbeats (tens
of milliseconds): behind, at tens of thousands of ranks, a receive lasts a second, longer
than the dashboard waits for its summary."""
RANK_MARGIN = 64  # ranks tracked beyond the known world size (elastic jobs, restarts)
UNKNOWN_WORLD_RANKS = 1024  # ranks tracked while no rank has reported a world size
RANK_CEILING = 65_536  # without --max-ranks: the most ranks, and the largest world size, taken
REFUSED_LOG_S = 10.0
FREEZE_AFTER_RANKS = 1024
"""After a receive that leaves this many ranks more than at the last freeze, what the process
holds is frozen (``gc.freeze``), the new records among it: they live as long as the server
and hold no reference cycles (a record dropped for a restarted worker is freed by its
reference count all the same), yet every full collection walked all of them, hundreds of
milliseconds at the largest jobs (``docs/performance.md``, §7), landing on whichever diagnosis
tick allocated when one was due. Garbage is
collected first, so nothing unreachable is frozen; ``close`` unfreezes."""
LISTEN_AFRESH_S = 10.0
"""Behind for this long (since the queue was last found empty), senders may have dropped
messages, so silence counts afresh once the server has caught up. Not sooner: an agent's
queue holds ``SEND_HWM`` messages (1,000: minutes of heartbeats, less where it sends stacks
and events too) and a relay keeps every rank's newest state, so a backlog of seconds loses no
rank's latest news. At 32,768 ranks the server finds its queue non-empty several times a
second; counting afresh after each such receive, a node that died was never called silent
(``benchmarks/scale.py --node-fault dies``). After a pause (``PauseWatch``), always."""
PAUSE_S = 1.0
"""Wall time this much longer than the server's own CPU time and waits: it was not running."""
ANSWERS_A_POLL = 256
"""Queries answered in one go (``Collector._answer_all``): thousands of relays ask for their
pace every ``relay_pacer.PACE_ASK_S``, a few microseconds each."""
RECEIVE_GAP_S = 0.01
"""The least time from one receive to the next: frames that come meanwhile wait for it, so a
server that keeps up takes them tens or hundreds at a time rather than one by one (each
receive has its own fixed work). A heartbeat waits at most this much longer."""


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
        self._paused = False  # ... or the server was not running meanwhile (``PauseWatch``)
        self._frozen_ranks = 0  # how many ranks there were at the last gc.freeze
        self._received_at = -math.inf  # when the last receive ended (``RECEIVE_GAP_S``)
        self._pauses = PauseWatch()
        self.pace = Pace()
        """The pace asked of relays (``server/pace.py``), moved by the lag after every poll."""
        self._context = zmq.Context()
        self._auth: Any = None
        self._monitors: list[zmq.Socket[Any]] = []
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        self._pull.setsockopt(zmq.BACKLOG, CONNECT_BACKLOG)
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

    def poll(
        self, timeout_s: float, lock: contextlib.AbstractContextManager[Any] | None = None
    ) -> int:
        """Wait up to ``timeout_s`` for traffic, then take in all that is ready; returns the count.

        ``lock`` is held only while state changes, not while waiting or answering, but for a
        query answered within a long receive (``ANSWER_EVERY``): the snapshot and query
        callbacks take it again, so it must be reentrant.
        """
        waiting = time.time()
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        if self._pauses.paused(idle_s=min(time.time() - waiting, timeout_s)):
            self._behind = self._paused = True  # what arrives next may be late or lost
        count = 0
        if self._pull in events:
            early = self._received_at + RECEIVE_GAP_S - time.monotonic()
            if early > 0:
                time.sleep(early)
            with lock or contextlib.nullcontext():
                count = self._receive()
            self._received_at = time.monotonic()
        else:
            self._caught_up(self._clock())
        self._move_pace()
        if self._query in events:
            self._answer_all()
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
        """Take in up to ``RECV_BATCH`` messages (a batch counts each one in it; behind, up to
        ``BEHIND_BEATS`` per known rank), through ingest's one path (``ingest.Receive``).

        Python's cyclic garbage collector waits meanwhile (if it was on at all): it would
        otherwise scan, again and again within one receive, what the receive holds (a
        backlog's heartbeats) or creates (the records of ranks new in it, all at a job's
        start). Nothing taken in here forms a reference
        cycle; the collector runs as before once the receive is in."""
        now = self._clock()
        shedding, limit = self._window(now)
        collecting = gc.isenabled()
        if collecting:
            gc.disable()
        try:
            taking = Receive(self.state, now, self._admit, self.recorder, shedding=shedding)
            count, drained = self._read(taking, limit)
            taking.take_all(self._answer_waiting, ANSWER_EVERY)
        finally:
            if collecting:
                gc.enable()
        if collecting:
            self._frozen_ranks = freeze_new_records(len(self.state.ranks), self._frozen_ranks)
        if drained:
            self._caught_up(now)  # the queue ran dry: all sent before ``now`` is read
        else:
            self._behind = True
        return count

    def _read(self, taking: Receive, limit: int) -> tuple[int, bool]:
        """Take frames off the socket into ``taking`` until ``limit`` messages (a batch counts
        the heartbeats it holds) or none is left; returns the count and whether it ran dry."""
        recv, noblock = self._pull.recv, zmq.NOBLOCK  # bound once
        add, add_other = taking.add, taking.add_other
        count = 0
        answer_at = ANSWER_EVERY
        while count < limit:
            if count >= answer_at:
                answer_at = count + ANSWER_EVERY
                self._answer_waiting()
            try:
                # a zmq.Frame says whether more parts follow: cheaper than asking the socket
                # (getsockopt(RCVMORE) looks its option up in a Python enum, every frame)
                part = recv(noblock, copy=False)
            except zmq.Again:
                return count, True
            count += 1
            if part.more:
                self._drop_multipart()
                continue
            frame = part.bytes
            if not add(frame):  # no rank message: a relay's batch (its heartbeats count), or bad
                count += add_other(frame)
        return count, False

    def _window(self, now: float) -> tuple[bool, int]:
        """Whether this receive sheds (``SHED_AFTER_S``), and how many messages it takes:
        ``RECV_BATCH``, or behind ``BEHIND_BEATS`` (shedding ``SHED_BEATS``) per known rank."""
        state = self.state
        if not self._behind:
            return False, RECV_BATCH
        heard = state.heard_until
        if heard is not None and now - heard > SHED_AFTER_S:
            return True, max(RECV_BATCH, SHED_BEATS * len(state.ranks))
        return False, max(RECV_BATCH, BEHIND_BEATS * len(state.ranks))

    def _caught_up(self, now: float) -> None:
        """The queue was found empty at ``now``: the state is complete up to then; after a
        pause or a backlog of ``LISTEN_AFRESH_S`` or more, silence counts afresh from here."""
        state = self.state
        heard = state.started if state.heard_until is None else state.heard_until
        state.heard_until = now
        if self._behind:
            if self._paused or now - heard >= LISTEN_AFRESH_S:
                state.listening_since = now
            self._behind = self._paused = False

    def _drop_multipart(self) -> None:
        """The protocol is one frame per message: a multipart message is one reject."""
        self.state.rejected += 1
        while self._pull.getsockopt(zmq.RCVMORE):
            try:
                self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                return

    def _move_pace(self) -> None:
        """Give the pace the lag behind the queue (since it was last found empty)."""
        now = self._clock()
        heard = self.state.heard_until
        if self.pace.update(0.0 if heard is None else max(0.0, now - heard), now):
            log.info("ddpwatch: relays are asked for one batch every %d beats", self.pace.every)
        self.state.pace = self.pace.every  # a pace held from outside (``Pace.hold``) too

    def _answer_waiting(self) -> None:
        """Within a long receive (``ANSWER_EVERY``): move the pace, which the relays would
        otherwise be asked only after the receive (seen at 65,536 ranks: 5 s each at the
        job's start, so pace 4 came 12 s late), and answer the queries that wait."""
        self._move_pace()
        if cast(int, self._query.get(zmq.EVENTS)) & zmq.POLLIN:
            self._answer_all()

    def _answer_all(self) -> None:
        """Answer up to ``ANSWERS_A_POLL`` waiting queries: one a poll would leave thousands
        of relays' ``pace`` requests queued behind each other, and a status query behind
        them."""
        for _ in range(ANSWERS_A_POLL):
            if not self._answer():
                return

    def _answer(self) -> bool:
        """``status``: ``snapshot()``; ``pace``: the relays' pace; any other request:
        ``query(request)`` when given (the summaries and pages of ``status?...``), else an
        error. Always a reply: a REP socket that does not answer is stuck. False when no
        query waited."""
        try:
            request = b"".join(self._query.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return False
        try:
            reply = self._reply(request)
        except Exception as exc:  # answered all the same: a REP socket left unanswered is stuck
            log.exception("a status query failed; it is answered with an error")
            reply = msgspec.json.encode({"error": f"the server failed: {type(exc).__name__}"})
        self._query.send(reply)
        return True

    def _reply(self, request: bytes) -> bytes:
        """The bytes that answer ``request`` (``_answer``)."""
        if request.strip() == b"status":
            return self._snapshot()
        if request == PACE_REQUEST:
            return self.pace.reply()
        if self._query_reply is not None:
            return self._query_reply(request)
        return b'{"error": "unknown request; send the bytes status"}'

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
        if self._frozen_ranks:
            gc.unfreeze()  # the records go back to the collector's oldest generation


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


def freeze_new_records(ranks: int, frozen: int) -> int:
    """``FREEZE_AFTER_RANKS``: with ``ranks`` known and ``frozen`` at the last freeze, collect
    and freeze once enough are new; returns the count the next call compares with."""
    if ranks - frozen < FREEZE_AFTER_RANKS:
        return frozen
    gc.collect()
    gc.freeze()
    return ranks


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
