"""A per-node relay: one process batches its node's ranks' frames into one frame per beat.

At 8 GPUs per node the server sees 8 times fewer frames, which is what lets one server take a
65,536-rank job. Ranks find the relay on a local socket (``relay_endpoint``) and fall back
to the server directly when it is not there or goes away (``agent/publisher.py``).

What the relay keeps, and why:

- **Every frame, in order, while the server takes them.** One PULL socket keeps each rank's
  order; frames leave in arrival order, in one ``Batch`` per beat, sooner when an event (a
  crash, an exit) is in.
- **What the server cannot take yet.** Here ZeroMQ holds only ``UPSTREAM_HWM`` batches and
  the kernel ``UPSTREAM_KERNEL_BYTES``; past that (the server away, stopped, or its own
  queue full) the relay is *held back* and keeps the rest itself. Held back, a rank's
  heartbeat takes the place of the one of the same rank still waiting
  (``protocol.keeps_news``: never one with a NaN loss or an identity the newer lacks, never
  across an event), counted in the next batch's ``coalesced``: the server, once it takes
  frames again, gets each rank's newest state and every event, and the relay's memory is
  bounded by its ranks, not by how long the server was away. ``BACKLOG_FRAMES`` bounds the
  rest (the oldest go first, counted in ``dropped``), and what a stopping relay could not
  send is counted too.
- **What a newer batch may supersede**: each batch says its frames' ranks and which are
  plain heartbeats (``Batch.ranks``, ``Batch.plain``), so that a server behind can leave out
  an older batch's heartbeats that its next one supersedes without decoding them.
- **The server's pace**: a server behind its queue asks for one batch every second or
  fourth beat (``relay_pacer.py``, ``server/pace.py``); between two, the relay keeps each
  rank's newest heartbeat as when held back, and events still leave at once.
- **Each rank's identity**: a restarted server hears it again as soon as it is back (the
  ranks' own connection, to the relay, did not change, so they would not resend it soon).

The relay validates every frame (an invalid one is counted in ``rejected`` and dropped) so
the server's counts stay per inner message; the server validates them again anyway.
"""

from __future__ import annotations

import contextlib
import errno
import itertools
import logging
import os
import re
import socket as pysocket
import tempfile
import threading
import time
from collections import deque
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

import msgspec
import zmq

from ddpwatch.core.boxreader import BoxReader
from ddpwatch.core.ports import host_port
from ddpwatch.core.protocol import (
    IDENTITY_FIELDS,
    MAX_BATCH_FRAMES,
    MAX_FRAME_BYTES,
    PROTOCOL_VERSION,
    Batch,
    Event,
    Hello,
    Identity,
    ProtocolError,
    Sample,
    decode,
    encode,
    keeps_news,
    plain_beat,
)
from ddpwatch.core.security import apply_client_curve
from ddpwatch.core.vocabulary import EventKind
from ddpwatch.relay_pacer import Pacer

log = logging.getLogger("ddpwatch.relay")

RELAY_ENV = "DDPWATCH_RELAY"
"""A relay's endpoint for the ranks (``ipc://…`` or ``tcp://…``), or ``off``: no relay."""
BEAT_S = 0.5  # the agent's heartbeat interval: one batch per beat carries every rank's beat
EVENT_FLUSH_S = 0.02  # an event (crash, exit, stack) waits at most this for its batch
BACKLOG_FRAMES = 200_000
BATCH_BYTES = MAX_FRAME_BYTES - 64 * 1024  # room for the batch's own fields
RECV_BATCH = 10_000
UPSTREAM_HWM = 2
"""Batches queued in ZeroMQ for the server. What the server does not take stays with the
relay, which coalesces it (held back) and counts what it cannot keep (``dropped``, and at
stop), rather than in ZeroMQ's queue, which holds stale heartbeats in order and is lost
uncounted when the relay stops (docs/performance.md, section 7, R5)."""
UPSTREAM_KERNEL_BYTES = 64 * 1024
"""The relay's send buffer in the kernel (``SO_SNDBUF``), for the same reason: the kernel
otherwise grows it to megabytes, which hold stale batches in order too."""


LOCAL_TCP = "tcp://127.0.0.1:*"
"""Where a relay listens when there is no ``ipc://`` (Windows) and it was given no address:
a free port on the loopback, which ``ddpwatch run`` tells its ranks (``$DDPWATCH_RELAY``)."""


def ipc_available() -> bool:
    """Whether ZeroMQ can listen on ``ipc://`` here and Python can probe it (not Windows)."""
    return bool(zmq.has("ipc")) and hasattr(pysocket, "AF_UNIX")


def relay_endpoint(server: str, uid: int | None = None) -> str | None:
    """The local address of the relay for ``server`` (``tcp://HOST:PORT``) on this node;
    None where there is no ``ipc://``: ranks there learn their relay's from ``$DDPWATCH_RELAY``.

    A per-user directory (mode 0700) keeps other users from injecting frames."""
    if not ipc_available():
        return None
    uid = os.getuid() if uid is None and hasattr(os, "getuid") else (uid or 0)
    name = re.sub(r"[^A-Za-z0-9.-]+", "_", server.removeprefix("tcp://"))
    return f"ipc://{tempfile.gettempdir()}/ddpwatch-{uid}/relay-{name}.sock"


def find_relay(server: str, environ: Mapping[str, str] | None = None) -> str | None:
    """The relay a rank should send to: ``$DDPWATCH_RELAY`` (``off``: none), else the local
    relay for ``server`` if one is listening, else None (send to the server directly)."""
    env = os.environ if environ is None else environ
    endpoint = relay_home(server, env)
    if endpoint is None or env.get(RELAY_ENV, "").strip():
        return endpoint
    return endpoint if relay_listening(endpoint) else None


def relay_home(server: str, environ: Mapping[str, str] | None = None) -> str | None:
    """Where this node's relay for ``server`` is, listening or not: ``$DDPWATCH_RELAY``
    (``off``: none), else ``relay_endpoint(server)`` (None without ``ipc://``). A rank that
    sends to the server directly looks there again now and then, and goes back to a relay
    that came (back)."""
    env = os.environ if environ is None else environ
    value = env.get(RELAY_ENV, "").strip()
    if value.lower() in ("off", "0", "none", "no"):
        return None
    return value or relay_endpoint(server)


def _ipc_path(endpoint: str) -> str | None:
    return endpoint.removeprefix("ipc://") if endpoint.startswith("ipc://") else None


def _tcp_address(endpoint: str) -> tuple[str, int] | None:
    """``tcp://HOST:PORT`` (``[::1]`` for IPv6) as an address to connect to; None otherwise."""
    if not endpoint.startswith("tcp://"):
        return None
    host, port = host_port(endpoint)
    if not host or port is None:
        return None
    return host.strip("[]"), port


PROBE_TIMEOUT_S = 0.2


def relay_listening(endpoint: str) -> bool:
    """Whether a process accepts connections on a relay's endpoint: ``ipc://`` (a local
    socket file) or ``tcp://`` (where there is no ``ipc://``, or ``$DDPWATCH_RELAY`` says so:
    one TCP connect, closed at once, which ZeroMQ takes as a peer that went away)."""
    path = _ipc_path(endpoint)
    if path is None:
        address = _tcp_address(endpoint)
        if address is None:
            return False
        try:
            pysocket.create_connection(address, timeout=PROBE_TIMEOUT_S).close()
        except OSError:
            return False
        return True
    if not hasattr(pysocket, "AF_UNIX") or not os.path.exists(path):
        return False
    probe = pysocket.socket(pysocket.AF_UNIX, pysocket.SOCK_STREAM)
    try:
        probe.settimeout(PROBE_TIMEOUT_S)
        probe.connect(path)
        return True
    except OSError:
        return False
    finally:
        probe.close()


class RelayError(RuntimeError):
    """The relay could not start (another relay has the address, bad address, bad key)."""


@dataclass
class RelayStats:
    """What the relay has done so far (``ddpwatch relay`` prints it when it stops)."""

    received: int = 0
    forwarded: int = 0
    rejected: int = 0
    dropped: int = 0
    coalesced: int = 0
    batches: int = 0
    reconnects: int = 0


LATE_S = 2 * BEAT_S  # a rank this late has its black box read (``core/boxreader.py``)


@dataclass
class RelayedRank:
    """What the relay knows of one rank of its node, for its black box (``Watched``)."""

    rank: int
    last_seen: float  # time.time of its last frame
    box: str | None = None
    host: str | None = None
    pid: int | None = None
    step: int | None = None
    exit_time: float | None = None
    error: object | None = None

    def heard(self, message: Hello | Sample | Event, now: float) -> None:
        """Note a frame of the rank's: its identity, step, and how it said it ended."""
        self.last_seen = now
        if isinstance(message, Event):
            if message.event == EventKind.EXIT:
                self.exit_time = now
            elif message.event == EventKind.CRASH and message.error is not None:
                self.error = message.error
            return
        if message.pid is not None and message.pid != self.pid:  # a new process
            self.pid, self.exit_time, self.error = message.pid, None, None
        self.box = message.box or self.box
        self.host = message.host or self.host
        if isinstance(message, Sample) and message.step is not None:
            self.step = message.step


class _Waiting:
    """One frame waiting in the relay: its rank, when it came (monotonic) and, for a
    heartbeat, the decoded ``Sample`` (a newer one may replace it while held back)."""

    __slots__ = ("arrived", "beat", "frame", "rank")

    def __init__(self, frame: bytes, rank: int, arrived: float, beat: Sample | None) -> None:
        self.frame = frame
        self.rank = rank
        self.arrived = arrived
        self.beat = beat


class Relay:
    """Forwards the frames arriving on ``listen`` to the server at ``upstream``, batched.

    ``run(stop)`` loops until ``stop`` is set; ``start()`` runs it on a daemon thread.
    """

    def __init__(
        self,
        upstream: str,
        listen: str | None = None,
        *,
        beat_s: float = BEAT_S,
        host: str | None = None,
    ) -> None:
        self.upstream = upstream
        self.listen = listen or relay_endpoint(upstream) or LOCAL_TCP
        self.beat_s = beat_s
        self.host = host or pysocket.gethostname()
        self.name = f"{self.host}:{os.getpid()}"
        self.stats = RelayStats()
        self._pending: deque[_Waiting] = deque()
        self._last_beat: dict[int, _Waiting] = {}  # rank -> its waiting heartbeat, if its last
        self._held = False  # the server took no more at the last try: coalesce
        self._identities: dict[int, Hello] = {}
        self._ranks: dict[int, RelayedRank] = {}
        self.boxes = BoxReader(host=self.host)
        """The black boxes of this node's late ranks: what they say goes on as the rank's
        own frames (a server on another host cannot read them)."""
        self._dropped_unsent = 0  # dropped since the last batch that left
        self._rejected_unsent = 0
        self._coalesced_unsent = 0
        self._handshakes = 0
        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._push = self._context.socket(zmq.PUSH)
        self.pacer = Pacer(self._context, upstream)
        """The server's pace: one batch every ``pacer.every`` beats (``relay_pacer.py``)."""
        self._beats = 0  # beats since the start: a batch on those the pace does not skip
        self._monitor: zmq.Socket[bytes] | None = None
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()
        try:
            self._setup()
        except Exception:
            self.close()
            raise

    def _setup(self) -> None:
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        self._pull.setsockopt(zmq.LINGER, 0)
        self._push.setsockopt(zmq.SNDHWM, UPSTREAM_HWM)
        self._push.setsockopt(zmq.SNDBUF, UPSTREAM_KERNEL_BYTES)
        self._push.setsockopt(zmq.IMMEDIATE, 1)  # no pipe to a server that is not there
        self._push.setsockopt(zmq.LINGER, 2000)  # at stop, the last batches still leave
        self._push.setsockopt(zmq.RECONNECT_IVL_MAX, 500)
        try:
            apply_client_curve(self._push)
        except ValueError as exc:
            raise RelayError(f"bad server key: {exc}") from None
        self._bind()
        self._monitor = self._push.get_monitor_socket(zmq.EVENT_HANDSHAKE_SUCCEEDED)
        try:
            self._push.connect(self.upstream)
        except zmq.ZMQError as exc:
            raise RelayError(f"cannot connect to {self.upstream}: {exc.strerror}") from None

    def _bind(self) -> None:
        path = _ipc_path(self.listen)
        if path is not None:
            if relay_listening(self.listen):
                raise RelayError(f"a relay already listens on {self.listen}")
            directory = Path(path).parent
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            with contextlib.suppress(FileNotFoundError):
                os.unlink(path)  # a dead relay's socket file
        try:
            self._pull.bind(self.listen)
        except zmq.ZMQError as exc:
            reason = "in use" if exc.errno == zmq.EADDRINUSE else exc.strerror
            raise RelayError(f"cannot listen on {self.listen}: {reason}") from None
        if self.listen.endswith((":*", ":0")):  # a free port: the one taken, for the ranks
            self.listen = self._pull.getsockopt_string(zmq.LAST_ENDPOINT)

    def start(self) -> Relay:
        """Run on a daemon thread (``ddpwatch run`` does); ``stop()`` ends it."""
        self._thread = threading.Thread(
            target=self.run, args=(self._stop,), name="ddpwatch-relay", daemon=True
        )
        self._thread.start()
        return self

    def stop(self, timeout: float = 2.0) -> None:
        """End the thread started by ``start()`` (what is pending is sent first) and close."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout)
        self.close()

    def run(self, stop: threading.Event) -> None:
        """Relay until ``stop`` is set; on the way out, send what is pending."""
        poller = zmq.Poller()
        poller.register(self._pull, zmq.POLLIN)
        next_beat = time.monotonic()
        send_at = next_beat
        while not stop.is_set():
            timeout = max(0.0, min(send_at, next_beat) - time.monotonic())
            if poller.poll(min(100, int(timeout * 1000))) and self._take():
                send_at = min(send_at, time.monotonic() + EVENT_FLUSH_S)
            self._note_handshakes()
            now = time.monotonic()
            self.pacer.poll(now)
            on_beat = now >= next_beat
            event_due = send_at < next_beat and now >= send_at  # an event waits: send now
            if on_beat:
                self._read_boxes()
                self._beats += 1
            if on_beat and not event_due and self._beats % self.pacer.every:
                self._hold()  # a beat the server's pace skips: each rank's newest waits
            elif on_beat or event_due:
                self._send(beat=on_beat)
            if on_beat or event_due:
                if on_beat:
                    next_beat = max(next_beat + self.beat_s, now)
                send_at = next_beat
        self._take()
        self._send(beat=True)
        if self._pending:  # the server is not there or not reading: say what is lost
            self.stats.dropped += len(self._pending)
            log.warning(
                "ddpwatch relay: stopped with %d frames the server never took",
                len(self._pending),
            )

    def _take(self) -> bool:
        """Take in what has arrived; True if an event is among it (send it soon)."""
        event = False
        for _ in range(RECV_BATCH):
            try:
                frame = self._pull.recv(zmq.NOBLOCK)
            except zmq.Again:
                break
            self.stats.received += 1
            try:
                message = decode(frame)
            except ProtocolError:
                self.stats.rejected += 1
                self._rejected_unsent += 1
                continue
            self._heard(message)
            if isinstance(message, Event):
                event = True
            elif message.pid is not None:  # it tells the identity: keep the latest
                self._remember(message)
            if isinstance(message, Sample):
                if not self._coalesce(frame, message):
                    self._queue(frame, message.rank, beat=message)
            else:
                self._queue(frame, message.rank)
        return event

    def _heard(self, message: Hello | Sample | Event) -> None:
        now = time.time()
        known = self._ranks.get(message.rank)
        if known is None:
            known = self._ranks[message.rank] = RelayedRank(message.rank, now)
        known.heard(message, now)

    def _read_boxes(self) -> None:
        """Queue, as if its rank had sent it, what the box of a late rank of this node says
        of how it died; never raises (a box is the rank's leftover, read as untrusted)."""
        try:
            found = self.boxes.due(self._ranks.values(), time.time(), LATE_S)
        except Exception as exc:
            log.debug("ddpwatch relay: black boxes not read: %r", exc)
            return
        for event, _ in found:
            self._heard(event)
            self._queue(encode(event), event.rank)

    def _coalesce(self, frame: bytes, beat: Sample, arrived: float | None = None) -> bool:
        """Held back, put ``beat`` in place of its rank's heartbeat still waiting, if that is
        the rank's last message and says nothing ``beat`` does not (``keeps_news``)."""
        waiting = self._last_beat.get(beat.rank)
        if not self._held or waiting is None or waiting.beat is None:
            return False
        if keeps_news(waiting.beat, beat):
            return False
        waiting.frame, waiting.beat = frame, beat
        waiting.arrived = time.monotonic() if arrived is None else arrived
        self.stats.coalesced += 1
        self._coalesced_unsent += 1
        return True

    def _hold(self) -> None:
        """The server took no more, or its pace skips this beat: from now until all is sent,
        coalesce; what already waits is coalesced as if it had come now (a burst within one
        beat, or a server that was keeping up until this beat, leaves one heartbeat a rank,
        not all of them)."""
        if self._held:
            return
        self._held = True
        waiting, self._pending, self._last_beat = self._pending, deque(), {}
        for entry in waiting:
            if entry.beat is None or not self._coalesce(entry.frame, entry.beat, entry.arrived):
                self._append(entry)

    def _remember(self, message: Identity) -> None:
        known = self._identities.get(message.rank)
        fields = {n: getattr(message, n) for n in IDENTITY_FIELDS}
        if known is not None:
            fields = {n: v if v is not None else getattr(known, n) for n, v in fields.items()}
        self._identities[message.rank] = Hello(
            v=PROTOCOL_VERSION, rank=message.rank, t=message.t, **fields
        )

    def _queue(
        self, frame: bytes, rank: int, beat: Sample | None = None, front: bool = False
    ) -> None:
        if len(self._pending) >= BACKLOG_FRAMES:
            self._forget(self._pending.popleft())
            self.stats.dropped += 1
            self._dropped_unsent += 1
        waiting = _Waiting(frame, rank, time.monotonic(), beat)
        if front:  # before the rank's other messages: its last one is still its last
            self._pending.appendleft(waiting)
        else:
            self._append(waiting)

    def _append(self, waiting: _Waiting) -> None:
        self._pending.append(waiting)
        if waiting.beat is None:
            self._last_beat.pop(waiting.rank, None)
        else:
            self._last_beat[waiting.rank] = waiting

    def _forget(self, waiting: _Waiting) -> None:
        """``waiting`` left the relay (sent or dropped): nothing can replace it any more."""
        if self._last_beat.get(waiting.rank) is waiting:
            del self._last_beat[waiting.rank]

    def _note_handshakes(self) -> None:
        """A new connection after the first is a restarted server: it hears every identity."""
        if self._monitor is None:
            return
        while True:
            try:
                self._monitor.recv_multipart(zmq.NOBLOCK)
            except zmq.ZMQError:
                return
            self._handshakes += 1
            if self._handshakes > 1:
                self.stats.reconnects += 1
                now = time.time()
                for hello in reversed(list(self._identities.values())):
                    frame = encode(msgspec.structs.replace(hello, t=now))
                    self._queue(frame, hello.rank, front=True)

    def _send(self, beat: bool) -> None:
        """Send pending frames in batches under the frame limit; on a beat, send even an
        empty one (the relay's heartbeat). Frames the server cannot take now stay pending."""
        while self._pending or beat:
            frames = self._next_frames()
            sent = time.monotonic()
            ages: list[int] = []
            ranks: list[int] = []
            plain: list[int] = []  # positions of plain heartbeats (``Batch.plain``)
            for i, waiting in enumerate(itertools.islice(self._pending, len(frames))):
                ages.append(int((sent - waiting.arrived) * 1e6))
                ranks.append(waiting.rank)
                if waiting.beat is not None and plain_beat(waiting.beat):
                    plain.append(i)
            batch = Batch(
                v=PROTOCOL_VERSION,
                relay=self.name,
                t=time.time(),
                host=self.host,
                seq=self.stats.batches,
                frames=frames,
                ages_us=ages,
                rejected=self._rejected_unsent,
                dropped=self._dropped_unsent,
                coalesced=self._coalesced_unsent,
                ranks=ranks,
                plain=plain,
                every=self.pacer.every,
            )
            try:
                self._push.send(encode(batch), zmq.NOBLOCK)
            except zmq.Again:
                self._hold()  # no server, or it is not reading: keep the frames
                return
            except zmq.ZMQError as exc:
                if exc.errno != errno.EINTR:
                    log.warning("ddpwatch relay: send failed: %s", exc)
                return
            for _ in frames:
                self._forget(self._pending.popleft())
            self.stats.batches += 1
            self.stats.forwarded += len(frames)
            self._rejected_unsent = self._dropped_unsent = self._coalesced_unsent = 0
            beat = False
        self._held = False  # all sent

    def _next_frames(self) -> list[bytes]:
        """The oldest pending frames that fit in one batch (they stay pending until sent)."""
        frames: list[bytes] = []
        size = 0
        for waiting in self._pending:
            frame = waiting.frame
            if len(frames) == MAX_BATCH_FRAMES or (frames and size + len(frame) > BATCH_BYTES):
                break
            frames.append(frame)
            size += len(frame) + 5  # MessagePack's bin header
        return frames

    def close(self) -> None:
        if self._monitor is not None:
            with contextlib.suppress(zmq.ZMQError):
                self._push.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        self._pull.close(linger=0)
        self._push.close()
        self.pacer.close()
        self._context.term()
        path = _ipc_path(self.listen)
        if path is not None and not relay_listening(self.listen):
            with contextlib.suppress(OSError):
                os.unlink(path)
