"""Sockets of the server: PULL for the ranks' messages, REP for read-only status queries.

Every frame is validated by the protocol decoder; a bad one is counted in
``state.rejected`` and dropped, never raised.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable

import zmq

from ddpwatch.protocol import MAX_FRAME_BYTES, ProtocolError, decode
from ddpwatch.server.state import ServerState

log = logging.getLogger("ddpwatch.server")

RECV_BATCH = 10_000


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
    ) -> None:
        self.state = state
        self.host = host
        self.port = port
        self._snapshot = snapshot
        self._clock = clock
        self._context = zmq.Context()
        self._pull = self._context.socket(zmq.PULL)
        self._pull.setsockopt(zmq.MAXMSGSIZE, MAX_FRAME_BYTES)
        self._pull.setsockopt(zmq.RCVHWM, 100_000)
        self._query = self._context.socket(zmq.REP)
        for sock in (self._pull, self._query):
            sock.setsockopt(zmq.LINGER, 0)
        try:
            self._pull.bind(f"tcp://{host}:{port}")
            self._query.bind(f"tcp://{host}:{port + 1}")
        except zmq.ZMQError as exc:
            self.close()
            raise BindError(_bind_message(host, port, exc)) from None
        self._poller = zmq.Poller()
        self._poller.register(self._pull, zmq.POLLIN)
        self._poller.register(self._query, zmq.POLLIN)

    def poll(self, timeout_s: float, lock: threading.Lock | None = None) -> int:
        """Wait up to ``timeout_s`` for traffic, then take in all that is ready; returns the count.

        ``lock`` is held only while state changes, not while waiting or answering.
        """
        events = dict(self._poller.poll(int(timeout_s * 1000)))
        count = 0
        if self._pull in events:
            with lock or contextlib.nullcontext():
                count = self._receive()
        if self._query in events:
            self._answer()
        return count

    def _receive(self) -> int:
        now = self._clock()
        count = 0
        while count < RECV_BATCH:
            try:
                frames = self._pull.recv_multipart(zmq.NOBLOCK, copy=True)
            except zmq.Again:
                break
            count += 1
            if len(frames) != 1:
                self.state.rejected += 1
                continue
            try:
                message = decode(frames[0])
            except ProtocolError:
                self.state.rejected += 1
                continue
            self.state.apply(message, now)
        return count

    def _answer(self) -> None:
        try:
            request = b"".join(self._query.recv_multipart(zmq.NOBLOCK))
        except zmq.Again:
            return
        if request.strip() == b"status":
            reply = self._snapshot()
        else:
            reply = b'{"error": "unknown request; send the bytes status"}'
        self._query.send(reply)

    def close(self) -> None:
        self._pull.close()
        self._query.close()
        self._context.term()


def _bind_message(host: str, port: int, exc: zmq.ZMQError) -> str:
    if exc.errno == zmq.EADDRINUSE:
        return (
            f"port {port} or {port + 1} on {host} is already in use "
            f"(another ddpwatch serve?): stop it or pick another --port"
        )
    return f"cannot listen on {host}:{port} and {port + 1}: {exc.strerror}"
