"""One engine for the live server and ``ddpwatch replay``: the state, diagnosis, the alert
history and the status document, driven by a clock.

The live server (``server/service.py``) is an engine, a collector that fills its state and a
recorder; a replay (``server/replay.py``) is an engine, a recording reader and a virtual
clock. Both tick it at the same times (the live server records each tick with its horizon,
``heard_until`` and ``listening_since``, and a replay restores them first), and diagnosis is
a pure function of state and time: so a replay raises and clears the same alerts, in the same
order, as the live server did.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections.abc import Callable

import msgspec

from ddpwatch.core.protocol import DEFAULT_PORT
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.history import AlertChange, AlertTracker
from ddpwatch.diagnosis.rules import Diagnosis
from ddpwatch.server.document import status_document
from ddpwatch.server.pages import QueryCache, TickView, error_reply
from ddpwatch.state.state import ServerState
from ddpwatch.status.query import Query, QueryError
from ddpwatch.status.schema import StatusDocument

TICK_S = 0.25  # how often the live server diagnoses; a recording without ticks replays at it

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


def _none_refused() -> int:
    return 0


class Engine:
    """``state`` judged at each ``tick`` into ``alerts`` and the alert history (``tracker``),
    and read as the status document (``document``) or a paged query (``query_json``).

    ``clock``: the time a document or query reply is built at (a tick is given its own).
    ``port``: the one the hints name (``with_port``). ``refused``: the failed handshakes so
    far, the document's ``stats.refused`` (a collector's count; a replay has none). Every
    method is thread-safe under ``lock``, reentrant: a collector answers queries within a
    receive it holds the lock for.
    """

    def __init__(
        self,
        state: ServerState,
        thresholds: Thresholds,
        clock: Callable[[], float],
        *,
        port: int = DEFAULT_PORT,
        refused: Callable[[], int] = _none_refused,
    ) -> None:
        self.state = state
        self.thresholds = thresholds
        self.clock = clock
        self.port = port
        self.refused = refused
        self.alerts: list[Alert] = []
        self.tracker = AlertTracker()
        self.diagnosis = Diagnosis()
        self.lock = threading.RLock()
        self.queries = QueryCache()  # paged queries' replies, per tick like the document
        self._document: StatusDocument | None = None
        self._encoded: tuple[StatusDocument, bytes] | None = None  # a document, encoded

    # ---------------------------------------------------------------- judging

    def tick(self, now: float) -> list[AlertChange]:
        """Run diagnosis as of ``now`` and return what changed; the document and the query
        replies are built afresh for the next reader."""
        with self.lock:
            state = self.state
            found = with_port(self.diagnosis(state, now, self.thresholds), self.port)
            changes = self.tracker.update(found, now, state.job_started, state.attempt)
            self.alerts = self.tracker.shown  # with hysteresis: ``AlertTracker``
            self._document = self._encoded = None
            self.queries.clear()
        return changes

    def restart(self, state: ServerState) -> None:
        """A new server run (a replayed recording's next session): its own state, no alert
        up, diagnosis's cadences from its start; the history keeps the runs before."""
        with self.lock:
            self.state = state
            self.alerts = []
            self.tracker.restart()
            self.diagnosis = Diagnosis()
            self._document = self._encoded = None
            self.queries.clear()

    # ---------------------------------------------------------------- reading

    def document(self) -> StatusDocument:
        """The status document as of the last tick, built once per tick (at the first ask)
        however many viewers ask: 8,192 ranks take tens of milliseconds. Read-only."""
        with self.lock:
            if self._document is None:
                self._document = self.document_at(self.clock())
            return self._document

    def document_at(self, now: float, *, final: bool = False) -> StatusDocument:
        """The status document as of ``now``, built afresh (a replay's clock moves between
        ticks); ``final``: its verdict judged as the watch ends."""
        with self.lock:
            document = status_document(
                self.state,
                self.alerts,
                now,
                self.thresholds,
                self.tracker.entries(),
                final=final,
            )
            return self._with_refused(document)

    def final_document(self) -> StatusDocument:
        """The status document as the watch ends, as of the last tick: what the end-of-run
        summary, the report and the trackers read (its ``verdict.final``)."""
        with self.lock:
            shown = self._document  # not built just for its time: 65,536 ranks take a second
            now = shown.server_time if shown is not None else self.clock()
            return self.document_at(now, final=True)

    def document_json(self) -> bytes:
        """``document()`` encoded, once per tick too."""
        document = self.document()
        with self.lock:
            encoded = self._encoded
            if encoded is None or encoded[0] is not document:
                encoded = self._encoded = (document, msgspec.json.encode(document))
            return encoded[1]

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
        view = TickView(
            self.state, self.alerts, self.clock(), self.thresholds, self.tracker.entries()
        )
        self._with_refused(view.envelope)
        return view

    def _with_refused(self, document: StatusDocument) -> StatusDocument:
        """The document (or a reply's envelope) with ``stats.refused``, an addition to the
        contract: the one place it is set."""
        document.stats.refused = self.refused()
        return document


class OnEngine:
    """What a server built on an ``Engine`` (the live one, a replay) shows of it: the state it
    judges, the alerts up as of the last tick and the thresholds, read-only."""

    engine: Engine

    @property
    def state(self) -> ServerState:
        return self.engine.state

    @property
    def alerts(self) -> list[Alert]:
        """The alerts up as of the last tick."""
        return self.engine.alerts

    @property
    def thresholds(self) -> Thresholds:
        return self.engine.thresholds
