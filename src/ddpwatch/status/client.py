"""The client of a running ``ddpwatch serve``'s query socket (port + 1).

One ZeroMQ REQ socket: send ``b"status"``, read the status JSON. ``StatusClient`` is
kept open between requests (the dashboard of ``ddpwatch top`` polls through it);
``fetch_status`` asks once (``ddpwatch status``, ``ddpwatch doctor``). CurveZMQ is
on when the environment names the server's key (``DDPWATCH_SERVER_KEY``).

A summary or a page of ranks instead of the whole document (docs/status.md, "Summary and
pages"): a ``status.query.Query``, sent by ``StatusClient.query`` or
``fetch_status(..., query=...)``; a refused query raises ``StatusQueryError``.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping
from typing import TYPE_CHECKING

import msgspec

from ddpwatch.core.protocol import DEFAULT_PORT, MAX_QUERY_BYTES
from ddpwatch.status.query import WHOLE, Query
from ddpwatch.status.schema import PageReply, StatusDocument, SummaryReply

if TYPE_CHECKING:
    import zmq

_decoder = msgspec.json.Decoder()
_document = msgspec.json.Decoder(StatusDocument)
_page = msgspec.json.Decoder(PageReply)
_summary = msgspec.json.Decoder(SummaryReply)


class StatusQueryError(Exception):
    """The server refused a query (its ``{"error": ...}`` reply), or did not send JSON: the
    message says why, on one line."""


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
            from ddpwatch.core.security import apply_client_curve

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

    def request(self, query: Query | None = None) -> bytes | None:
        """The server's raw reply to ``status`` (``status?<query>`` with a ``query``), or None
        (no answer in time, a socket error, closed)."""
        zmq = self._zmq
        message = WHOLE if query is None else _request_bytes(query)
        with self._lock:
            if self._closed:
                return None
            try:
                sock = self._socket()
                sock.send(message, zmq.NOBLOCK)
                if not sock.poll(int(self.timeout * 1000), zmq.POLLIN):
                    self._reset()
                    return None
                return sock.recv()
            except zmq.ZMQError:
                self._reset()
                return None

    def fetch(self) -> StatusDocument | None:
        """The status document, or None (no answer, or an answer that is not one)."""
        reply = self.request()
        try:
            return None if reply is None else decode_reply(reply)
        except StatusQueryError:
            return None

    def query(self, query: Query) -> StatusDocument | None:
        """The reply to ``status?<query>`` (a ``PageReply`` or a ``SummaryReply``), or None
        when none came in time; ``StatusQueryError`` when the server refused the query."""
        reply = self.request(query)
        return None if reply is None else decode_reply(reply, query)

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
    host: str,
    port: int,
    timeout: float,
    environ: Mapping[str, str] | None = None,
    query: Query | None = None,
) -> StatusDocument | None:
    """Ask a running server for its status document once; None if none answered in time.
    With a ``query``: a summary or a page instead, and a refused query
    raises ``StatusQueryError``.

    ``environ`` (default ``os.environ``) is where the CURVE keys are read from."""
    reply = fetch_reply(host, port, timeout, environ, query)
    try:
        return None if reply is None else decode_reply(reply, query)
    except StatusQueryError:
        if query is not None:
            raise
        return None  # not a status document: as if none answered


def fetch_reply(
    host: str,
    port: int,
    timeout: float,
    environ: Mapping[str, str] | None = None,
    query: Query | None = None,
) -> bytes | None:
    """The server's reply as it came (``ddpwatch status --json`` prints it), or None if none
    came in time or the CURVE key is bad; ``StatusQueryError`` for a query too long to send."""
    client = StatusClient(host, port, timeout, environ)
    try:
        return client.request(query)  # DDPWATCH_SERVER_KEY set: CurveZMQ (a bad key: ValueError)
    except ValueError:  # ``CurveKeyError``: a malformed key in the environment
        return None
    finally:
        client.close()


def decode_reply(reply: bytes, query: Query | None = None) -> StatusDocument:
    """The document a reply holds: the whole one, or the page or the summary ``query`` asked
    for; ``StatusQueryError`` for the server's error or anything that is not one."""
    try:
        if query is None:
            return _document.decode(reply)
        return (_summary if query.view == "summary" else _page).decode(reply)
    except msgspec.DecodeError as exc:  # a ValidationError too
        raise StatusQueryError(_not_a_document(reply, exc)) from None


def no_answer(host: str, port: int, timeout: float) -> str:
    """What a client found when nothing answered: the port it tried, and that it is the query
    port of ``ddpwatch serve`` (the rank port + 1), the port the README never names."""
    return (
        f"no server answered on {host}:{port + 1} within {timeout:g} s: that is the query port "
        f"of ddpwatch serve (its rank port {port} + 1)"
    )


def no_server(host: str, port: int, timeout: float, *, curve: bool = False) -> str:
    """The one line every client prints when no server answered (``status``, ``top``, ``web``;
    ``doctor`` writes ``no_answer`` with fixes of its own): ``no_answer`` and how to start a
    server or point at one; with ``curve`` (a server key is set), that the key may be wrong."""
    serve = "ddpwatch serve" + ("" if port == DEFAULT_PORT else f" --port {port}")
    text = (
        f"{no_answer(host, port, timeout)}; start one with `{serve}` (or `ddpwatch run -- "
        "COMMAND`), or point at a running one with --host/--port"
    )
    if curve:
        from ddpwatch.core.security import SERVER_KEY_ENV

        text += (
            f" (with {SERVER_KEY_ENV} set: is it the key of a server started with "
            "--curve-secret-file?)"
        )
    return text


def unanswered(
    host: str, port: int, timeout: float, environ: Mapping[str, str] | None = None
) -> str | None:
    """Ask once whether a server answers on ``host:port + 1`` (a page of one rank: cheap at any
    size; a refused query is an answer too): None when one did, else ``no_server``'s line. A
    malformed CURVE key raises ``CurveKeyError``."""
    from ddpwatch.core.security import client_curve_keys

    curve = client_curve_keys(environ) is not None
    client = StatusClient(host, port, timeout, environ)
    try:
        reply = client.request(Query(limit=1))
    finally:
        client.close()
    return None if reply is not None else no_server(host, port, timeout, curve=curve)


def _request_bytes(query: Query) -> bytes:
    """``status?<query>``, checked against the server's size limit: it drops a longer one
    unanswered, which would read as no server at all."""
    message = query.request()
    if len(message) > MAX_QUERY_BYTES:
        raise StatusQueryError(
            f"the query is {len(message)} bytes, over the server's {MAX_QUERY_BYTES}"
        )
    return message


def _not_a_document(reply: bytes, exc: msgspec.DecodeError) -> str:
    """Why ``reply`` is no document: the server's ``error``, or what is wrong with it."""
    try:
        found = _decoder.decode(reply)
    except msgspec.DecodeError:
        return "the server's reply is not JSON"
    if not isinstance(found, dict):
        return "the server's reply is not a JSON object"
    if "error" in found:
        return str(found["error"])
    if "ranks" not in found:
        return "the server's reply has no ranks"
    return f"the server's reply is not a status document: {exc}"
