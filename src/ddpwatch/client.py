"""The client of a running ``ddpwatch serve``'s query socket (port + 1).

One ZeroMQ REQ socket: send ``b"status"``, read the status JSON. ``StatusClient`` is
kept open between requests (the dashboard of ``ddpwatch top`` polls through it);
``fetch_status`` asks once (``ddpwatch status``, ``ddpwatch doctor``). CurveZMQ is
on when the environment names the server's key (``DDPWATCH_SERVER_KEY``).
"""

from __future__ import annotations

import json
import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

import msgspec

from ddpwatch.protocol import DEFAULT_PORT

if TYPE_CHECKING:
    import zmq

_decoder = msgspec.json.Decoder()


class StatusClient:
    """Asks ``host:port + 1`` for the status document, at most ``timeout`` seconds each time.

    A REQ socket that timed out is stuck waiting for its reply, so it is closed
    and a fresh one is made for the next request (the "lazy pirate" pattern).
    ``environ`` (default ``os.environ``) is where the CURVE keys are read from; a bad
    key raises ``CurveKeyError`` (a ``ValueError``) from ``request``.
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = DEFAULT_PORT,
        timeout: float = 1.0,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        import zmq

        self._zmq = zmq
        self.host, self.port, self.timeout = host, port, timeout
        self._environ = environ
        self._context = zmq.Context()
        self._sock: zmq.Socket[bytes] | None = None
        self._lock = threading.Lock()  # a request (worker thread) against close (UI thread)
        self._closed = False

    @property
    def endpoint(self) -> str:
        return f"tcp://{self.host}:{self.port + 1}"

    def _socket(self) -> zmq.Socket[bytes]:
        if self._sock is None:
            zmq = self._zmq
            from ddpwatch.security import apply_client_curve

            sock = self._context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            try:
                apply_client_curve(sock, self._environ)  # CurveZMQ, as the ranks use
                sock.connect(self.endpoint)
            except BaseException:
                sock.close(linger=0)  # the context cannot end while a socket is open
                raise
            self._sock = sock
        return self._sock

    def _reset(self) -> None:
        if self._sock is not None:
            self._sock.close(linger=0)
            self._sock = None

    def request(self) -> bytes | None:
        """The server's raw reply, or None (no answer in time, a socket error, closed)."""
        zmq = self._zmq
        with self._lock:
            if self._closed:
                return None
            try:
                sock = self._socket()
                sock.send(b"status", zmq.NOBLOCK)
                if not sock.poll(int(self.timeout * 1000), zmq.POLLIN):
                    self._reset()
                    return None
                return sock.recv()
            except zmq.ZMQError:
                self._reset()
                return None

    def fetch(self) -> dict[str, Any] | None:
        """The status document, or None (no answer, or an answer that is not one)."""
        reply = self.request()
        if reply is None:
            return None
        try:
            document = _decoder.decode(reply)
        except msgspec.DecodeError:
            return None
        if not isinstance(document, dict) or "ranks" not in document:
            return None
        return document

    def close(self) -> None:
        """Close the socket (after a request in flight, at most ``timeout`` away) and the
        context. Closing twice is fine."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._reset()
        self._context.term()


def fetch_status(
    host: str, port: int, timeout: float, environ: Mapping[str, str] | None = None
) -> dict[str, Any] | None:
    """Ask a running server for its status document once; None if none answered in time.

    ``environ`` (default ``os.environ``) is where the CURVE keys are read from."""
    client = StatusClient(host, port, timeout, environ)
    try:
        reply = client.request()  # DDPWATCH_SERVER_KEY set: CurveZMQ (a bad key: ValueError)
        return None if reply is None else json.loads(reply)
    except ValueError:
        return None
    finally:
        client.close()
