"""A server that cannot die quietly (issue #33): a frame whose handling raises is counted and
dropped while the collector goes on; a poll or a tick that raises is logged and the loop goes
on; a collector thread that stops all the same is a ``server_behind`` error alert and one clear
line on stderr, never silence."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
from conftest import LiveServer, push_frames

from ddpwatch.core.protocol import AnyMessage, Event, Hello, Sample, encode
from ddpwatch.core.vocabulary import AlertKind, Severity
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.server import service as service_module
from ddpwatch.server.service import Server, describe
from ddpwatch.state.state import ServerState
from ddpwatch.status.client import fetch_reply, fetch_status


def test_a_frame_that_raises_is_counted_and_the_collector_goes_on(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The seam: ``apply`` raises for rank 1 (a bug injected). Over a real socket, rank 0's
    frames before and after are taken in, rank 1's are counted in ``stats.failed``, and the
    collector's thread is alive; no alert blames the server."""
    real_apply = ServerState.apply

    def apply(self: ServerState, message: AnyMessage, now: float) -> None:
        if message.rank == 1:
            raise KeyError(1)
        real_apply(self, message, now)

    monkeypatch.setattr(ServerState, "apply", apply)
    live = LiveServer(port, Thresholds())
    try:
        frames = [encode(Hello(v=1, rank=r, t=0.0, pid=10 + r)) for r in range(2)]
        push_frames(port, frames)
        push_frames(port, [encode(Sample(v=1, rank=r, t=0.0, step=7)) for r in range(2)])
        status = live.wait_for(
            lambda s: s if s["stats"]["failed"] == 2 and s["ranks"][0]["step"] == 7 else None, 10
        )
        assert [r["rank"] for r in status["ranks"]] == [0]
        assert live.thread.is_alive() and live.server.state.collector_stopped is None
        assert not live.raised(AlertKind.SERVER_BEHIND)
    finally:
        live.stop()


def test_a_poll_that_raises_is_noted_and_cleared_by_the_next(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(service_module, "RETRY_S", 0.0)
    server = Server("127.0.0.1", port)
    try:
        real_poll = server.collector.poll
        monkeypatch.setattr(server.collector, "poll", _raising(RuntimeError("injected")))
        server._poll(0.0)
        assert server.state.collector_failure is not None
        assert server.state.collector_failure.startswith("RuntimeError: injected (")
        monkeypatch.setattr(server.collector, "poll", real_poll)
        server._poll(0.0)
        assert server.state.collector_failure is None and server.state.collector_stopped is None
    finally:
        server.collector.close()


def test_a_collector_that_keeps_failing_stops_with_an_alert_and_a_line(
    port: int, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    """Every poll raises: after ``FAILURES_IN_A_ROW`` the loop ends, and a ``server_behind``
    error says "the collector stopped" with the exception, at once and with no rank heard;
    stderr has one line that says the same."""
    monkeypatch.setattr(service_module, "RETRY_S", 0.0)
    changes: list[Any] = []
    server = Server("127.0.0.1", port, on_change=changes.append)
    monkeypatch.setattr(server.collector, "poll", _raising(KeyError(1)))
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    thread.join(10)
    assert not thread.is_alive()
    assert server.state.collector_stopped is not None
    (alert,) = [c.alert for c in changes if c.alert.kind == AlertKind.SERVER_BEHIND]
    assert alert.severity == Severity.ERROR
    assert alert.message.startswith("the collector stopped: KeyError: 1 (")
    assert "live data stopped at" in alert.message
    assert [a.kind for a in server.status().alerts] == [AlertKind.SERVER_BEHIND]
    lines = [line for line in capsys.readouterr().err.splitlines() if "collector stopped" in line]
    assert len(lines) == 1 and lines[0].startswith("ddpwatch: the collector stopped: KeyError: 1")


def test_a_collector_thread_found_dead_by_a_tick_is_an_alert(port: int) -> None:
    """A thread that ended without a word (``_stopped`` never ran): the next tick from
    another thread (``ddpwatch run``'s final one) notices it is not alive and says so."""
    server = Server("127.0.0.1", port)
    try:
        server.state.apply(Sample(v=1, rank=0, t=0.0, pid=5, step=1), time.time())
        gone = threading.Thread(target=lambda: None)
        gone.start()
        gone.join()
        server._runner = gone
        server.tick()
        (alert,) = server.status().alerts
        assert alert.kind == AlertKind.SERVER_BEHIND and alert.severity == Severity.ERROR
        assert alert.message.startswith("the collector stopped: its thread ended; live data")
    finally:
        server.collector.close()


def test_a_stop_asked_for_is_no_alert(port: int) -> None:
    live = LiveServer(port, Thresholds())
    push_frames(port, [encode(Event(v=1, rank=0, t=0.0, event="exit", exit_code=0))])
    live.wait_for(lambda s: s["stats"]["received"] == 1, 10)
    live.stop()
    live.server.tick()
    assert live.server.state.collector_stopped is None and not live.server.status().alerts


def test_a_status_query_that_raises_is_answered_and_the_next_one_too(port: int) -> None:
    """A REP socket left without an answer is stuck (every later receive on it raises): a
    snapshot that raises is answered with an error, and the next query is answered."""
    live = LiveServer(port, Thresholds())
    try:
        real = live.server.collector._snapshot
        live.server.collector._snapshot = _raising(RuntimeError("injected"))
        assert b"the server failed: RuntimeError" in (fetch_reply("127.0.0.1", port, 5.0) or b"")
        live.server.collector._snapshot = real
        assert fetch_status("127.0.0.1", port, 5.0) is not None
        assert live.thread.is_alive() and live.server.state.collector_failure is None
    finally:
        live.stop()


def test_describe_names_the_exception_and_where_it_was_raised() -> None:
    try:
        {}[1]
    except KeyError as exc:
        text = describe(exc)
    assert text.startswith("KeyError: 1 (") and "test_service_failures.py, line" in text


def _raising(exc: Exception) -> Any:
    def poll(*_: object) -> int:
        raise exc

    return poll
