"""Alert notifications: run a command and/or POST a webhook when an alert is raised.

``Notifier`` is an ``on_change`` subscriber. It filters and rate-limits on the
caller's thread (a few dict lookups, so diagnosis never waits) and hands the
rest to one daemon worker through a bounded queue: a hung command or an
unreachable webhook can delay other notifications, never the server. Failures
are counted and logged in one line each; nothing here raises into the server.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import queue
import signal
import subprocess
import threading
import time
import urllib.error
import urllib.parse
import urllib.request
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ddpwatch.core.vocabulary import SEVERITIES, HistoryEvent, Severity
from ddpwatch.status.order import SEVERITY_LEVEL, severity_level

log = logging.getLogger("ddpwatch.notify")

LEVELS = tuple(reversed(SEVERITIES))
"""Severities from least to most severe (``--notify-level``)."""
NOTIFY_EVENTS = frozenset({HistoryEvent.RAISED, HistoryEvent.ESCALATED})
"""Changes worth telling someone about; "cleared" is not."""
TEXT_ENV = "DDPWATCH_ALERT_TEXT"
"""The command also gets the one-line text here, for ``notify-send "$DDPWATCH_ALERT_TEXT"``."""


class ChangedAlert(Protocol):
    """What the notifier reads of an alert (``diagnosis.alerts.Alert``)."""

    @property
    def kind(self) -> str: ...

    @property
    def severity(self) -> str: ...

    @property
    def message(self) -> str: ...

    @property
    def hint(self) -> str: ...

    @property
    def key(self) -> tuple[str, tuple[int, ...]]: ...


class Change(Protocol):
    """What the notifier reads of an alert change (``diagnosis.history.AlertChange``): the
    alert stream, not the server that made it."""

    @property
    def event(self) -> str: ...

    @property
    def alert(self) -> ChangedAlert: ...

    def to_dict(self) -> dict[str, Any]: ...


def check_webhook_url(url: str) -> str:
    """``url`` if it is http(s) with a host, else ValueError (the CLI's one-line error)."""
    try:
        parts = urllib.parse.urlsplit(url)
        ok = parts.scheme in ("http", "https") and bool(parts.hostname)
        parts.port  # noqa: B018 (raises ValueError for a port that is not a number)
    except ValueError:
        ok = False
    if not ok:
        raise ValueError(f"not an http:// or https:// URL: {url}")
    return url


def alert_text(change: Change) -> str:
    """One line for chat: ``[error] straggler: rank 1 has not entered ... — fix: ...``."""
    alert = change.alert
    escalated = " (escalated)" if change.event == HistoryEvent.ESCALATED else ""
    return f"[{alert.severity}] {alert.kind}{escalated}: {alert.message} — fix: {alert.hint}"


def _where(url: str) -> str:
    """The webhook without its path: Slack-style URLs carry their secret there."""
    parts = urllib.parse.urlsplit(url)
    port = f":{parts.port}" if parts.port else ""
    return f"{parts.scheme}://{parts.hostname}{port}"


def _reason(exc: BaseException) -> str:
    reason = getattr(exc, "reason", exc)
    if isinstance(reason, OSError) and reason.strerror:
        return reason.strerror
    return str(reason) or type(reason).__name__


class Notifier:
    """Sends raised (and escalated) alerts of severity ≥ ``level`` to ``command`` and ``webhook``.

    ``command`` is a shell command line run with the change's JSON on stdin;
    ``webhook`` gets the same JSON as a POST, with a Slack-compatible ``text``.
    The same alert (kind and culprits) goes out at most once per ``interval``
    seconds unless it became more severe, and at most ``per_minute`` in all;
    ``clock`` (monotonic seconds) is the seam tests turn.
    """

    def __init__(
        self,
        command: str | None = None,
        webhook: str | None = None,
        *,
        level: str = Severity.WARNING,
        interval: float = 60.0,
        per_minute: int = 20,
        timeout: float = 10.0,
        queue_size: int = 64,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if level not in SEVERITY_LEVEL:
            raise ValueError(f"unknown level {level!r}: one of {', '.join(LEVELS)}")
        self.command = command
        self.webhook = check_webhook_url(webhook) if webhook is not None else None
        self.level = level
        self.interval = interval
        self.per_minute = per_minute
        self.timeout = timeout
        self.clock = clock
        self.sent = 0
        """Notifications delivered (a command that exited 0, a webhook that answered 2xx)."""
        self.failed = 0
        self.dropped = 0
        """Over the per-minute cap, the queue full, or still queued when ``close`` gave up."""
        self.suppressed = 0
        """Repeats of an alert within ``interval``."""
        self._queue: queue.Queue[dict[str, Any] | None] = queue.Queue(queue_size)
        self._last: dict[tuple[str, tuple[int, ...]], tuple[float, int]] = {}
        self._recent: deque[float] = deque()
        self._capped = False
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None
        self._deadline: float | None = None
        self._closed = False
        self._gave_up = False
        self._running: subprocess.Popen[bytes] | None = None  # the command in flight

    def __call__(self, change: Change) -> None:
        """The ``on_change`` hook: decide now, deliver later on the worker thread."""
        alert = change.alert
        if change.event not in NOTIFY_EVENTS or self._closed:
            return
        severity = severity_level(alert.severity)
        if severity < severity_level(self.level):
            return
        with self._lock:
            previous = self._last.get(alert.key)
            if not self._admit(alert.key, severity):
                return
            payload = {**change.to_dict(), "text": alert_text(change)}
            try:
                self._queue.put_nowait(payload)
            except queue.Full:  # not sent, so neither counted against the key nor the cap
                self.dropped += 1
                self._recent.pop()
                if previous is None:
                    del self._last[alert.key]
                else:
                    self._last[alert.key] = previous
                return
            self._start()

    def _admit(self, key: tuple[str, tuple[int, ...]], severity: int) -> bool:
        now = self.clock()
        last = self._last.get(key)
        if last is not None and now - last[0] < self.interval and severity <= last[1]:
            self.suppressed += 1
            return False
        while self._recent and now - self._recent[0] >= 60.0:
            self._recent.popleft()
        if len(self._recent) >= self.per_minute:
            self.dropped += 1
            if not self._capped:
                self._capped = True
                log.warning(
                    "notifications: more than %d a minute, dropping the rest until the rate falls",
                    self.per_minute,
                )
            return False
        self._capped = False
        self._recent.append(now)
        if len(self._last) >= 4096:  # forget alerts not seen for an interval
            self._last = {k: v for k, v in self._last.items() if now - v[0] < self.interval}
        self._last[key] = (now, severity)
        return True

    def _start(self) -> None:
        if self._thread is None:
            self._thread = threading.Thread(target=self._work, name="ddpwatch-notify", daemon=True)
            self._thread.start()

    def _work(self) -> None:
        while True:
            payload = self._queue.get()
            if payload is None:
                return
            if self._deadline is not None and time.monotonic() > self._deadline:
                self._add(dropped=1)
                continue
            body = json.dumps(payload).encode()
            if self.command is not None:
                ok = self._run_command(body, payload["text"])
                self._add(sent=ok, failed=not ok)
            if self.webhook is not None:
                ok = self._post(body)
                self._add(sent=ok, failed=not ok)

    def _add(self, sent: int = 0, failed: int = 0, dropped: int = 0) -> None:
        with self._lock:
            self.sent += sent
            self.failed += failed
            self.dropped += dropped

    def _run_command(self, body: bytes, text: str) -> bool:
        """Run the command in its own session: a Ctrl-C meant for serve does not cut the last
        notification short, and a timeout kills whatever the command started."""
        assert self.command is not None
        try:
            proc = subprocess.Popen(
                self.command,
                shell=True,  # the user gave a command line: pipes, quotes, $VARS
                stdin=subprocess.PIPE,
                stdout=subprocess.DEVNULL,  # never into serve's JSON stream or the dashboard
                stderr=subprocess.PIPE,
                env={**os.environ, TEXT_ENV: text},
                start_new_session=True,
            )
        except OSError as exc:
            log.warning("cannot run notify command %s: %s", self.command, _reason(exc))
            return False
        self._running = proc
        try:
            _, err = proc.communicate(body, timeout=self.timeout)
        except subprocess.TimeoutExpired:
            _kill(proc)
            proc.wait()
            if proc.stderr is not None:
                proc.stderr.close()
            log.warning("notify command timed out after %g s: %s", self.timeout, self.command)
            return False
        finally:
            self._running = None
        if self._gave_up:  # killed by close(), which says so
            return False
        if proc.returncode != 0:
            lines = err.decode(errors="replace").strip().splitlines()
            said = f": {lines[-1][:200]}" if lines else ""
            log.warning("notify command exited %d%s", proc.returncode, said)
            return False
        return True

    def _post(self, body: bytes) -> bool:
        assert self.webhook is not None
        from ddpwatch import __version__

        request = urllib.request.Request(
            self.webhook,
            data=body,
            method="POST",
            headers={"Content-Type": "application/json", "User-Agent": f"ddpwatch/{__version__}"},
        )
        where = _where(self.webhook)
        try:
            with urllib.request.urlopen(request, timeout=self.timeout) as response:
                response.read()
        except urllib.error.HTTPError as exc:
            log.warning("webhook %s answered HTTP %d %s", where, exc.code, exc.reason)
            return False
        except TimeoutError:
            log.warning("webhook %s timed out after %g s", where, self.timeout)
            return False
        except (urllib.error.URLError, OSError, ValueError) as exc:
            log.warning("webhook %s unreachable: %s", where, _reason(exc))
            return False
        return True

    def close(self, drain_s: float = 5.0) -> None:
        """Stop taking alerts; let those queued go out for up to ``drain_s`` seconds (the last
        alert of a job is raised as it ends), then give up on the rest (the worker is a daemon)."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            thread = self._thread
        if thread is not None:
            self._deadline = time.monotonic() + drain_s
            with contextlib.suppress(queue.Full):
                self._queue.put(None, timeout=drain_s)
            thread.join(max(0.0, self._deadline - time.monotonic()) + 0.1)
            if thread.is_alive():  # stuck on one: what is still queued will not go out
                self._gave_up = True
                running = self._running
                if running is not None:
                    _kill(running)  # its own session would outlive serve otherwise
                left = 0
                with contextlib.suppress(queue.Empty):
                    while True:
                        left += self._queue.get_nowait() is not None
                self._add(dropped=left)
                with contextlib.suppress(queue.Full):
                    self._queue.put_nowait(None)
                thread.join(0.5)
        if self.failed or self.dropped:
            log.warning(
                "notifications: %d sent, %d failed, %d dropped",
                self.sent,
                self.failed,
                self.dropped,
            )


def _kill(proc: subprocess.Popen[bytes]) -> None:
    """SIGKILL the command and whatever it started (its session's process group)."""
    with contextlib.suppress(OSError):
        os.killpg(proc.pid, signal.SIGKILL)


def chain(
    *callbacks: Callable[[Any], None] | None,
) -> Callable[[Any], None] | None:
    """One ``on_change`` calling each of ``callbacks`` that is not None (None if none is)."""
    live = [c for c in callbacks if c is not None]
    if not live:
        return None
    if len(live) == 1:
        return live[0]

    def each(change: Any) -> None:
        for callback in live:
            callback(change)

    return each
