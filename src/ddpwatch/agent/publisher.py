"""The agent's one background thread: it owns the ZeroMQ socket and never blocks training.

Other threads hand it events through a bounded deque (the oldest is dropped
when full). Sends are non-blocking; with ``IMMEDIATE`` set nothing queues in
ZeroMQ while no server is connected: heartbeats are dropped (the next one
repeats them), events wait in the deque for a server, and a rank with no
server exits without waiting on the network.

Where this node runs a relay (``ddpwatch/relay.py``), the rank sends to it instead; a relay
that is not connected for ``FALLBACK_S`` (it died, or never came) is left for the server, and
a rank sending to the server looks for its relay every ``RELAY_PROBE_S`` and goes back to it
once it listens (a restarted relay gets its ranks back).
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections import deque
from collections.abc import Callable

import zmq
from zmq.utils.monitor import parse_monitor_message

from ddpwatch.core.protocol import AnyMessage, Event, encode
from ddpwatch.core.security import apply_client_curve
from ddpwatch.relay import find_relay, relay_home, relay_listening

log = logging.getLogger("ddpwatch")

QUEUE_LEN = 1000
SEND_HWM = 1000
LINGER_MS = 1000
RECONNECT_MAX_MS = 500  # a restarted server has every rank back within a heartbeat or two
FALLBACK_S = 1.0  # a relay not connected this long: send to the server directly
BEAT_TRIES = 3
"""A beat computed while an event was queued is computed again, this many times at most."""
RELAY_PROBE_S = 10.0  # sending to the server directly: look for the node's relay this often
"""The ``relay_lost`` warning's hint says "within 10 s": keep them together."""
_WATCHED = zmq.EVENT_HANDSHAKE_SUCCEEDED | zmq.EVENT_DISCONNECTED


class Publisher:
    """Sends queued messages and a heartbeat every ``interval`` seconds."""

    def __init__(
        self,
        endpoint: str,
        interval: float,
        heartbeat: Callable[[], list[AnyMessage]],
        *,
        use_relay: bool = True,
    ) -> None:
        self.endpoint = endpoint
        self.use_relay = use_relay
        self.relay: str | None = None
        """The node's relay this rank sends to; None once it sends to the server directly."""
        self.interval = interval
        self.sent = 0
        self.dropped = 0
        self.connections = 0
        """Handshakes with a server so far: one that is new to us must hear the identity again."""
        self._heartbeat = heartbeat
        self._queue: deque[AnyMessage] = deque(maxlen=QUEUE_LEN)
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._drained = threading.Condition()
        self._pending = 0
        self._published = 0  # events queued so far: a beat computed across one is stale
        self._faulted = False
        self._socket: zmq.Socket[bytes] | None = None
        self._monitor: zmq.Socket[bytes] | None = None
        self._connected = False
        self._unconnected_since = 0.0
        self._relay_home: str | None = None  # where the node's relay listens, if it does
        self._next_probe = 0.0
        self._thread = threading.Thread(target=self._run, name="ddpwatch-publisher", daemon=True)

    def start(self) -> None:
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread.is_alive()

    def publish(self, message: AnyMessage) -> None:
        """Queue a message from any thread; never blocks."""
        with self._drained:
            if len(self._queue) == QUEUE_LEN:
                self.dropped += 1  # the deque evicts the oldest message
            else:
                self._pending += 1
            self._published += 1
            self._queue.append(message)
        self._wake.set()

    def flush(self, timeout: float) -> bool:
        """Wait up to ``timeout`` for queued messages to be handed to the socket."""
        if not self.alive:
            return False
        self._wake.set()
        with self._drained:
            return self._drained.wait_for(lambda: self._pending <= 0, timeout)

    def stop(self, timeout: float = 1.5) -> None:
        """Send what is queued, close the socket (bounded linger) and end the thread."""
        self._stop.set()
        self._wake.set()
        if self.alive and threading.current_thread() is not self._thread:
            self._thread.join(timeout)

    def _run(self) -> None:
        context = zmq.Context()
        try:
            self._relay_home = relay_home(self.endpoint) if self.use_relay else None
            self.relay = find_relay(self.endpoint) if self.use_relay else None
            self._next_probe = time.monotonic() + RELAY_PROBE_S
            self._open(context, self.relay or self.endpoint)
            self._loop(context)
        except Exception as exc:
            self._fault(exc)
        finally:
            self._close(LINGER_MS)
            context.term()
            with self._drained:
                self._pending = 0
                self._drained.notify_all()

    def _open(self, context: zmq.Context[zmq.Socket[bytes]], endpoint: str) -> None:
        socket = context.socket(zmq.PUSH)
        self._socket = socket
        socket.setsockopt(zmq.SNDHWM, SEND_HWM)
        socket.setsockopt(zmq.IMMEDIATE, 1)
        socket.setsockopt(zmq.LINGER, 0)
        socket.setsockopt(zmq.RECONNECT_IVL_MAX, RECONNECT_MAX_MS)
        if endpoint != self.relay:
            # DDPWATCH_SERVER_KEY set: CurveZMQ; a bad key is logged once by _fault and the
            # agent publishes nothing (never in the clear, never raising into training).
            # A relay is local (a per-user socket) and speaks CURVE to the server itself.
            apply_client_curve(socket)
        self._monitor = socket.get_monitor_socket(_WATCHED)
        self._connected = False
        self._unconnected_since = time.monotonic()
        socket.connect(endpoint)

    def _close(self, linger_ms: int) -> None:
        if self._monitor is not None:
            if self._socket is not None:
                with contextlib.suppress(zmq.ZMQError):
                    self._socket.disable_monitor()
            self._monitor.close(linger=0)
            self._monitor = None
        if self._socket is not None:
            self._socket.setsockopt(zmq.LINGER, linger_ms)
            self._socket.close()
            self._socket = None

    def _loop(self, context: zmq.Context[zmq.Socket[bytes]]) -> None:
        next_beat = time.monotonic()
        while True:
            stopping = self._stop.is_set()
            self._watch_connection()
            if self._relay_lost():
                log.info("ddpwatch: no relay at %s; sending to %s", self.relay, self.endpoint)
                self._close(0)
                self.relay = None
                self._next_probe = time.monotonic() + RELAY_PROBE_S
                self._open(context, self.endpoint)
            elif (home := self._relay_back()) is not None:
                log.info("ddpwatch: the relay at %s is back; sending to it", home)
                self._close(LINGER_MS)  # what the server's socket still holds goes on alone
                self.relay = home
                self._open(context, home)
            self._drain()
            now = time.monotonic()
            if now >= next_beat and not stopping:
                # a beat never overtakes what is still queued (the hello, an event no server
                # took yet): it is dropped, as one no server took would be, and the next
                # repeats it. One computed across an event is neither before nor after it
                beat, in_order = self._beat_between_events()
                self._drain()
                behind = bool(self._queue) or not in_order
                for message in beat:
                    if isinstance(message, Event):
                        self.publish(message)  # a log or stack event happens once: keep it
                    elif behind or not self._send(message):
                        self.dropped += 1
                next_beat = max(next_beat + self.interval, now)
            if stopping:
                return
            self._wake.wait(max(0.0, next_beat - time.monotonic()))
            self._wake.clear()

    def _watch_connection(self) -> None:
        """Count handshakes (a new peer must hear the identity again) and note when the
        last connection went away, from the socket monitor's events."""
        while self._monitor is not None:
            try:
                event = parse_monitor_message(self._monitor.recv_multipart(zmq.NOBLOCK))
            except zmq.ZMQError:  # Again: none left
                return
            if event["event"] == zmq.EVENT_HANDSHAKE_SUCCEEDED:
                self.connections += 1
                self._connected = True
            elif self._connected:
                self._connected = False
                self._unconnected_since = time.monotonic()

    def _relay_lost(self) -> bool:
        return (
            self.relay is not None
            and not self._connected
            and time.monotonic() - self._unconnected_since >= FALLBACK_S
        )

    def _relay_back(self) -> str | None:
        """The node's relay, when this rank sends to the server directly and the relay now
        listens (looked for every ``RELAY_PROBE_S``: one local connect, on this thread)."""
        home = self._relay_home
        if self.relay is not None or home is None or time.monotonic() < self._next_probe:
            return None
        self._next_probe = time.monotonic() + RELAY_PROBE_S
        return home if relay_listening(home) else None

    def _drain(self) -> None:
        """Send queued events in order; at the first no server takes, it and all after it wait
        for the next drain (they happen once, unlike beats). Sending on past it would let a
        later event overtake: the socket can connect between two sends."""
        while self._queue:
            try:
                message = self._queue.popleft()
            except IndexError:
                break
            if self._send(message):
                with self._drained:
                    self._pending -= 1
                    self._drained.notify_all()
                continue
            with self._drained:
                self._pending -= 1 + len(self._queue)  # each tried once, as ``flush`` waits for
                if len(self._queue) < QUEUE_LEN:
                    self._queue.appendleft(message)
                else:
                    self.dropped += 1
                self._drained.notify_all()
            return

    def _beat_between_events(self) -> tuple[list[AnyMessage], bool]:
        """A beat no event was queued while it was computed, and True; else the last one
        tried, and False. Such a beat may have read the phase an event set, or the one before
        it: sent after the event, it could put the rank back (seen: 'eval' queued while the
        beat read 'started', then 'compiling': the server's phases 'eval', 'started',
        'compiling'); sent before, it could run ahead (a beat that read 'compiling' ahead of
        the 'eval' before it). A discarded beat's events happen once: they are kept."""
        before = self._published
        beat = self._safe_heartbeat()
        for _ in range(BEAT_TRIES - 1):
            if self._published == before:
                break
            for message in beat:
                if isinstance(message, Event):
                    self.publish(message)
            before = self._published
            beat = self._safe_heartbeat()
        return beat, self._published == before

    def _safe_heartbeat(self) -> list[AnyMessage]:
        try:
            return self._heartbeat()
        except Exception as exc:
            self._fault(exc)
            return []

    def _send(self, message: AnyMessage) -> bool:
        """One non-blocking send; False when no server is connected or it is not reading."""
        if self._socket is None:
            return False
        try:
            self._socket.send(encode(message), zmq.NOBLOCK, copy=True)
        except zmq.Again:
            return False
        except Exception as exc:
            self._fault(exc)
            return False
        self.sent += 1
        return True

    def _fault(self, exc: BaseException) -> None:
        if not self._faulted:
            self._faulted = True
            log.warning("ddpwatch: agent fault, continuing degraded: %r", exc)
