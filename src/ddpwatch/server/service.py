"""The running server: an engine (``server/engine.py``) with a collector filling its state and a
recorder, diagnosis every tick, raised/cleared alerts out.

Views (headless printer, TUI) subscribe to ``AlertChange``s and read ``status()``; they never
own state.
"""

from __future__ import annotations

import dataclasses
import os
import threading
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.history import AlertChange
from ddpwatch.server.collector import Collector
from ddpwatch.server.engine import TICK_S, Engine, OnEngine
from ddpwatch.server.state import ServerState
from ddpwatch.status.schema import StatusDocument

if TYPE_CHECKING:
    from ddpwatch.core.security import ServerCurve
    from ddpwatch.server.recording import Recorder


class Server(OnEngine):
    """An engine fed by a collector; ``run`` loops until ``stop`` is called (thread-safe). A
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
        self.engine = Engine(
            ServerState(started=clock()),
            thresholds or Thresholds(),
            clock,
            port=port,
            refused=self._refused,
        )
        self.port = port
        self.lock = self.engine.lock  # the collector answers queries within a receive
        self._on_change = on_change
        self._stop = threading.Event()
        self.collector = Collector(
            self.state,
            self.engine.document_json,
            host,
            port,
            clock,
            max_ranks=max_ranks,
            curve=curve,
            query=self.engine.query_json,
        )
        self.recorder: Recorder | None = None
        if record is not None:
            try:
                self.recorder = self._open_recorder(record, host, port, curve, max_ranks)
            except BaseException:
                self.collector.close()
                raise
            self.collector.recorder = self.recorder

    @property
    def clock(self) -> Callable[[], float]:
        return self.engine.clock

    def _refused(self) -> int:
        return self.collector.refused

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
            changes = self.engine.tick(now)
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
        """The status document as of the last tick (``Engine.document``). Read-only."""
        return self.engine.document()

    def status_json(self) -> bytes:
        return self.engine.document_json()

    def query_json(self, request: bytes) -> bytes:
        """The encoded reply to a ``status?...`` request (``Engine.query_json``)."""
        return self.engine.query_json(request)

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
