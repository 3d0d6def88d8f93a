"""A relay's side of the server's pace (``server/pace.py``): ask for it, never wait for it.

Every ``PACE_ASK_S`` the relay sends ``pace`` on the server's query port (port + 1) from its
own loop, without blocking: the answer is read when it has come. A server that does not
answer within ``PACE_WAIT_S`` (stopped, gone, behind a firewall that lets only the rank port
through) leaves the pace as it was, and the socket is made anew (a ZeroMQ REQ that lost its
reply is stuck). An answer that is no pace (an older server's error) is pace 1.
"""

from __future__ import annotations

import logging
from typing import Any

import msgspec
import zmq

from ddpwatch.core.ports import host_port
from ddpwatch.core.protocol import MAX_PACE, PACE_REQUEST, PaceReply
from ddpwatch.core.security import apply_client_curve

log = logging.getLogger("ddpwatch.relay")

PACE_ASK_S = 2.0
PACE_WAIT_S = 5.0
_reply = msgspec.json.Decoder(PaceReply)


class Pacer:
    """The pace a relay sends at: ``every`` beats a batch, as its server last said."""

    def __init__(self, context: zmq.Context[Any], upstream: str) -> None:
        host, port = host_port(upstream)
        self.endpoint = None if port is None else f"tcp://{host}:{port + 1}"
        self.every = 1
        self._context = context
        self._sock: zmq.Socket[bytes] | None = None
        self._asked_at: float | None = None
        self._next_ask = 0.0

    def poll(self, now: float) -> None:
        """Read an answer that has come, or ask when it is time (``now``: monotonic)."""
        if self.endpoint is None:
            return
        if self._asked_at is not None:
            self._read(now)
        elif now >= self._next_ask:
            self._ask(now)

    def _read(self, now: float) -> None:
        sock, asked = self._sock, self._asked_at
        if sock is None or asked is None:
            return
        try:
            reply = sock.recv(zmq.NOBLOCK)
        except zmq.Again:
            if now - asked > PACE_WAIT_S:
                self._reset(now)
            return
        except zmq.ZMQError:
            self._reset(now)
            return
        self._asked_at, self._next_ask = None, now + PACE_ASK_S
        try:
            every = _reply.decode(reply).every
        except (msgspec.DecodeError, msgspec.ValidationError):
            every = 1  # an older server: it knows no pace
        every = every if 1 <= every <= MAX_PACE else 1
        if every != self.every:
            log.info("ddpwatch relay: the server asks for one batch every %d beats", every)
            self.every = every

    def _ask(self, now: float) -> None:
        try:
            if self._sock is None:
                sock = self._context.socket(zmq.REQ)
                sock.setsockopt(zmq.LINGER, 0)
                try:
                    apply_client_curve(sock)  # as the batches' socket
                    sock.connect(self.endpoint or "")
                except BaseException:
                    sock.close(linger=0)
                    raise
                self._sock = sock
            self._sock.send(PACE_REQUEST, zmq.NOBLOCK)
        except (zmq.ZMQError, ValueError):  # not connected yet, a bad key: ask again later
            self._reset(now)
            return
        self._asked_at = now

    def _reset(self, now: float) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None
        self._asked_at, self._next_ask = None, now + PACE_ASK_S

    def close(self) -> None:
        self._reset(0.0)
