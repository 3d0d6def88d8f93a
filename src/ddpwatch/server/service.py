"""The running server: an engine (``server/engine.py``) with a collector filling its state and a
recorder, diagnosis every tick, raised/cleared alerts out.

Views (headless printer, TUI) subscribe to ``AlertChange``s and read ``status()``; they never
own state.

The loop that polls the collector and ticks cannot die quietly: a poll or a tick that raises
is logged (once per kind of failure) and the loop goes on, as a frame whose handling raises
is isolated by ingest and a raising rule by diagnosis; a collector that fails
``FAILURES_IN_A_ROW`` polls in a row is stopped. A thread that ends while the server is
meant to run (``_stopped``, or a tick that finds it not alive) says so in one line on stderr
and in a ``server_behind`` error alert, "the collector stopped: ...", with the time live
data stopped, never as a quiet, healthy-looking job.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import sys
import threading
import time
import traceback
from collections.abc import Callable
from typing import TYPE_CHECKING

import msgspec

from ddpwatch.core.boxreader import BoxReader
from ddpwatch.core.protocol import encode
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.history import AlertChange
from ddpwatch.server.collector import Collector
from ddpwatch.server.engine import TICK_S, Engine, OnEngine
from ddpwatch.state.state import ServerState
from ddpwatch.status.schema import JobEnd, StatusDocument

if TYPE_CHECKING:
    from ddpwatch.core.security import ServerCurve
    from ddpwatch.server.recording import Recorder

log = logging.getLogger("ddpwatch.server")

FAILURES_IN_A_ROW = 20
"""Polls in a row that raise before the collector is taken as stopped (``RETRY_S`` apart:
two seconds): one that cannot take a frame in any more must say so, not log forever."""
RETRY_S = 0.1
"""The pause after a poll that raised: a failure that repeats does not spin a core."""


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
        self._runner: threading.Thread | None = None  # the thread in ``run``, once started
        self._failures_in_a_row = 0
        self._failures_logged: set[tuple[str, str]] = set()  # (what, exception type)
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
        self.boxes = BoxReader()
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
        """Run diagnosis once and report what changed (from any thread: the final tick of
        ``ddpwatch run`` notices a collector thread that ended, ``_check_runner``)."""
        self._check_runner()
        with self.lock:
            now = self.clock()
            self._read_boxes(now)
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

    def _read_boxes(self, now: float) -> None:
        """The exits this host's late ranks could not send, from their black boxes
        (``core/boxreader.py``): taken in, and recorded, as if they had sent them."""
        late_s = 2 * self.thresholds.interval
        ended = self.state.job_end is not None
        for event, died in self.boxes.due(self.state.ranks.values(), now, late_s, ended=ended):
            if self.recorder is not None:
                self.recorder.frame(died, encode(event))
            self.state.apply(event, died)

    def end_job(self, job_end: JobEnd) -> None:
        """Say how the job ended, as the ``ddpwatch run`` that launched it saw it: in the
        state (so every document from the next tick on), and in the recording, for replays
        and ``ddpwatch report``."""
        with self.lock:
            self.state.job_end = job_end
            if self.recorder is not None:
                self.recorder.job(self.clock(), msgspec.json.encode(job_end))

    def status(self, *, final: bool = False) -> StatusDocument:
        """The status document as of the last tick (``Engine.document``), read-only;
        ``final``: built afresh, its verdict judged as the watch ends
        (``Engine.final_document``: what the summary and the hand-offs read)."""
        return self.engine.final_document() if final else self.engine.document()

    def status_json(self) -> bytes:
        return self.engine.document_json()

    def query_json(self, request: bytes) -> bytes:
        """The encoded reply to a ``status?...`` request (``Engine.query_json``)."""
        return self.engine.query_json(request)

    def run(self) -> None:
        """Poll the collector and tick until ``stop``; a failure is isolated (``_poll``,
        ``_tick``), and a thread that ends all the same says why (``_stopped``)."""
        self._runner = threading.current_thread()
        next_tick = time.monotonic()
        try:
            while not self._stop.is_set():
                self._poll(max(0.0, min(TICK_S, next_tick - time.monotonic())))
                if time.monotonic() >= next_tick:
                    started = time.monotonic()
                    self._tick()
                    spent = time.monotonic() - started
                    # huge jobs: keep diagnosis under about a third of a core
                    next_tick = time.monotonic() + max(TICK_S, 2 * spent)
        except BaseException as exc:  # the thread ends: say so, in one line and an alert
            self._stopped(exc)
        finally:
            self.collector.close()
            if self.recorder is not None:
                self.recorder.close()

    def _poll(self, timeout_s: float) -> None:
        """One poll of the collector; one that raises is logged and noted in the state
        (``collector_failure``), and raises on only after ``FAILURES_IN_A_ROW`` in a row."""
        try:
            self.collector.poll(timeout_s, self.lock)
        except Exception as exc:
            self._failures_in_a_row += 1
            if self._failures_in_a_row >= FAILURES_IN_A_ROW:
                raise
            self._failed("the collector's poll", exc)
            with self.lock:
                self.state.collector_failure = describe(exc)
            time.sleep(RETRY_S)
            return
        if self._failures_in_a_row:
            self._failures_in_a_row = 0
            with self.lock:
                self.state.collector_failure = None

    def _tick(self) -> None:
        """A tick of the loop; one that raises is logged and the loop goes on (the rules
        are isolated already: this is the rest, the document and the recording)."""
        try:
            self.tick()
        except Exception as exc:
            self._failed("a diagnosis tick", exc)

    def _failed(self, what: str, exc: Exception) -> None:
        """Log a failure of the loop with its traceback, once per (what, exception type)."""
        key = (what, type(exc).__name__)
        if key in self._failures_logged:
            return
        self._failures_logged.add(key)
        log.error("%s failed (%s); the server goes on", what, describe(exc), exc_info=exc)

    def _stopped(self, exc: BaseException | None) -> None:
        """The loop ended while the server was meant to run: note when and why in the state,
        say it in one line on stderr (then the traceback, to report), and tick once so the
        ``server_behind`` alert goes out to the views at once."""
        if self._stop.is_set() and exc is None:
            return
        why = "its thread ended" if exc is None else describe(exc)
        with self.lock:
            state = self.state
            if state.collector_stopped is not None:
                return
            state.collector_stopped = now = self.clock()
            state.collector_failure = why
            heard = now if state.heard_until is None else min(state.heard_until, now)
        print(
            f"ddpwatch: the collector stopped: {why}; live data stopped at "
            f"{time.strftime('%H:%M:%S', time.localtime(heard))}: the alerts and the summary "
            "judge the ranks as of then (a bug in ddpwatch: please report it)",
            file=sys.stderr,
            flush=True,
        )
        if exc is not None and not isinstance(exc, KeyboardInterrupt | SystemExit):
            log.error("the collector's traceback, to report:", exc_info=exc)
        try:
            self.tick()
        except Exception as failed:  # the alert is in the state: the next tick shows it
            self._failed("the tick after the collector stopped", failed)

    def _check_runner(self) -> None:
        """A thread that was running ``run`` and is gone, with no ``stop`` asked and no
        word of it (``_stopped`` did not run: it cannot have, in practice), is said too."""
        runner = self._runner
        if runner is None or runner.is_alive() or self._stop.is_set():
            return
        if self.state.collector_stopped is None:
            self._runner = None  # once
            self._stopped(None)

    def stop(self) -> None:
        self._stop.set()


def describe(exc: BaseException) -> str:
    """An exception in one line, with where it was raised: "KeyError: 1 (server/ingest.py,
    line 223, in _take)", the ddpwatch path shortened."""
    text = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
    frames = traceback.extract_tb(exc.__traceback__)
    if not frames:
        return text
    last = frames[-1]
    path = last.filename.replace("\\", "/")
    path = path.split("/ddpwatch/", 1)[-1] if "/ddpwatch/" in path else path.rsplit("/", 1)[-1]
    return f"{text} ({path}, line {last.lineno}, in {last.name})"
