"""The running server: collector in, diagnosis every tick, raised/cleared alerts out.

Views (headless printer, TUI) subscribe to ``AlertChange``s and read
``status()``; they never own state.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from ddpwatch.core.protocol import DEFAULT_PORT
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.history import AlertChange, AlertTracker, diff_alerts
from ddpwatch.diagnosis.rules import Diagnosis
from ddpwatch.server.collector import Collector
from ddpwatch.server.document import status_document
from ddpwatch.server.pages import QueryCache, TickView, error_reply
from ddpwatch.server.state import ServerState
from ddpwatch.status.query import Query, QueryError
from ddpwatch.status.schema import StatusDocument

if TYPE_CHECKING:
    from ddpwatch.core.security import ServerCurve
    from ddpwatch.server.recording import Recorder

__all__ = ["TICK_S", "AlertChange", "Server", "diff_alerts"]

TICK_S = 0.25

log = logging.getLogger("ddpwatch.server")


def with_port(alerts: list[Alert], port: int) -> list[Alert]:
    """Hints that send users to ``ddpwatch status`` name this server's port when it is not
    the default one (``ddpwatch run`` moves off a busy 5599)."""
    if port == DEFAULT_PORT:
        return alerts
    command = f"ddpwatch status --port {port}"
    return [
        dataclasses.replace(
            a,
            message=a.message.replace("ddpwatch status", command),
            hint=a.hint.replace("ddpwatch status", command),
        )
        if "ddpwatch status" in a.hint or "ddpwatch status" in a.message
        else a
        for a in alerts
    ]


class Server:
    """Owns the state; ``run`` loops until ``stop`` is called (thread-safe). A
    ``StatusProvider`` (``status/provider.py``), as ``ReplayServer`` is.

    ``record``: append every accepted frame and each diagnosis tick to this file
    (``docs/recording.md``); ``curve``: encrypt and authenticate both sockets
    (``docs/security.md``); ``max_ranks``: the most ranks tracked (default: the
    known world size + 64, or 1024 while unknown).
    """

    def __init__(
        self,
        host: str = "127.0.0.1",
        port: int = 5599,
        thresholds: Thresholds | None = None,
        on_change: Callable[[AlertChange], None] | None = None,
        clock: Callable[[], float] = time.time,
        *,
        record: str | os.PathLike[str] | None = None,
        curve: ServerCurve | None = None,
        max_ranks: int | None = None,
    ) -> None:
        self.thresholds = thresholds or Thresholds()
        self.clock = clock
        self.state = ServerState(started=clock())
        self.alerts: list[Alert] = []
        self.tracker = AlertTracker()
        self.diagnosis = Diagnosis()
        self.port = port
        self._document: StatusDocument | None = None
        self._encoded: bytes | None = None
        self.queries = QueryCache()  # paged queries' replies, per tick like the document
        self._on_change = on_change
        self._stop = threading.Event()
        self.lock = threading.RLock()  # the collector answers queries within a receive
        self.collector = Collector(
            self.state,
            self.status_json,
            host,
            port,
            clock,
            max_ranks=max_ranks,
            curve=curve,
            query=self.query_json,
        )
        self.recorder: Recorder | None = None
        if record is not None:
            try:
                self.recorder = self._open_recorder(record, host, port, curve, max_ranks)
            except BaseException:
                self.collector.close()
                raise
            self.collector.recorder = self.recorder

    def _open_recorder(
        self,
        path: str | os.PathLike[str],
        host: str,
        port: int,
        curve: ServerCurve | None,
        max_ranks: int | None,
    ) -> Recorder:
        from ddpwatch import __version__
        from ddpwatch.core.protocol import PROTOCOL_VERSION
        from ddpwatch.server.recording import Recorder

        session = {
            "started": self.state.started,
            "ddpwatch": __version__,
            "protocol": PROTOCOL_VERSION,
            "thresholds": dataclasses.asdict(self.thresholds),
            "tick_s": TICK_S,
            "ticks": True,
            "host": host,
            "port": port,
            "curve": curve is not None,
            "max_ranks": max_ranks,
        }
        return Recorder(path, session)

    def tick(self) -> list[AlertChange]:
        """Run diagnosis once and report what changed."""
        with self.lock:
            now = self.clock()
            alerts = with_port(self.diagnosis(self.state, now, self.thresholds), self.port)
            changes = self.tracker.update(alerts, now, self.state.job_started, self.state.attempt)
            self.alerts = alerts
            self._document = self._encoded = None
            self.queries.clear()
            if self.recorder is not None:
                # replay runs diagnosis at exactly these times, on the same horizon
                self.recorder.tick(now, self.state.heard_until, self.state.listening_since)
        if self.recorder is not None:
            self.recorder.flush()
        if self._on_change is not None:
            for change in changes:
                self._on_change(change)
        return changes

    def status(self) -> StatusDocument:
        """The status document as of the last tick, built once per tick however many viewers
        ask (8,192 ranks take tens of milliseconds). Treat it as read-only."""
        with self.lock:
            if self._document is None:
                document = status_document(
                    self.state, self.alerts, self.clock(), self.thresholds, self.tracker.entries()
                )
                document.stats.refused = self.collector.refused  # an addition to the contract
                self._document = document
            return self._document

    def status_json(self) -> bytes:
        document = self.status()
        with self.lock:
            if self._encoded is None or self._document is not document:
                self._encoded = msgspec.json.encode(document)
            return self._encoded

    def query_json(self, request: bytes) -> bytes:
        """The encoded reply to a ``status?...`` request (``server/pages.py``): a summary or a
        page built from a per-tick index, never the whole document; a bad request gets
        ``{"error": ...}``. Never raises: the query socket must always answer."""
        key = request.strip()
        with self.lock:
            cached = self.queries.get(key)
        if cached is not None:
            return cached
        try:
            query = Query.from_request(key)  # outside the lock: a long rank list takes a moment
            with self.lock:
                return self.queries.answer(key, query, self._tick_view)
        except QueryError as exc:
            return error_reply(str(exc))
        except Exception:
            log.exception("failed to answer the status query %r", key[:200])
            return error_reply("the server failed to answer this query; see its log")

    def _tick_view(self) -> TickView:
        """What this tick's queries read (made under ``lock``, at the first query)."""
        return TickView(
            self.state,
            self.alerts,
            self.clock(),
            self.thresholds,
            self.tracker.entries(),
            refused=self.collector.refused,
        )

    def run(self) -> None:
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                self.collector.poll(max(0.0, min(TICK_S, next_tick - time.monotonic())), self.lock)
                if time.monotonic() >= next_tick:
                    started = time.monotonic()
                    self.tick()
                    spent = time.monotonic() - started
                    # huge jobs: keep diagnosis under about a third of a core
                    next_tick = time.monotonic() + max(TICK_S, 2 * spent)
        finally:
            self.collector.close()
            if self.recorder is not None:
                self.recorder.close()

    def stop(self) -> None:
        self._stop.set()
