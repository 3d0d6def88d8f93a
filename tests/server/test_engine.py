"""The engine live and replay share (``server/engine.py``): ticks at the time it is given, one
document per tick, ``stats.refused`` set in one place, a new run's restart; and the replay's
virtual clock."""

from __future__ import annotations

import threading

import msgspec

from ddpwatch.core.protocol import Hello, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.server.engine import Engine
from ddpwatch.server.replay import VirtualClock
from ddpwatch.state.state import ServerState
from ddpwatch.status.schema import StatusDocument


def two_ranks_heard_until(t: float) -> ServerState:
    state = ServerState(started=0.0)
    for rank in (0, 1):
        state.apply(Hello(v=1, rank=rank, t=0.0, world_size=2, host="a", pid=10 + rank), 0.0)
        state.apply(Sample(v=1, rank=rank, t=0.0, step=1, loss=1.0), t)
    return state


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


def test_a_tick_judges_at_the_time_it_is_given_not_the_clock() -> None:
    clock = Clock(1.0)  # would find every rank fresh
    engine = Engine(two_ranks_heard_until(1.0), Thresholds(), clock)
    assert engine.tick(100.0) == [] and engine.alerts == []  # a warning: found, held
    changes = engine.tick(100.5)
    assert [(c.event, c.alert.kind) for c in changes] == [("raised", "silent")]
    assert [(a.kind, a.episode, a.raised_at) for a in engine.alerts] == [("silent", 1, 100.5)]
    assert engine.tick(100.75) == []  # still up: no change


def test_the_document_is_built_once_a_tick_and_encoded_from_it() -> None:
    clock = Clock(2.0)
    engine = Engine(two_ranks_heard_until(1.0), Thresholds(), clock)
    engine.tick(2.0)
    first = engine.document()
    clock.now = 3.0
    assert engine.document() is first  # as of the first ask after the tick
    assert msgspec.json.decode(engine.document_json(), type=StatusDocument) == first
    engine.tick(3.0)
    second = engine.document()
    assert second is not first and second.server_time == 3.0
    assert msgspec.json.decode(engine.document_json(), type=StatusDocument) == second
    built = engine.document_at(5.0)  # afresh, as a replay's moving clock asks
    assert built.server_time == 5.0 and engine.document() is second


def test_refused_is_in_the_document_and_every_query_reply() -> None:
    refused = [0]
    engine = Engine(
        two_ranks_heard_until(1.0), Thresholds(), Clock(2.0), refused=lambda: refused[0]
    )
    refused[0] = 3
    engine.tick(2.0)
    for stats in (
        msgspec.to_builtins(engine.document().stats),
        msgspec.to_builtins(engine.document_at(2.0).stats),
        msgspec.json.decode(engine.query_json(b"status?view=summary"))["stats"],
        msgspec.json.decode(engine.query_json(b"status?limit=1"))["stats"],
    ):
        assert list(stats) == ["received", "rejected", "shed", "failed", "lag_s", "pace", "refused"]
        assert stats["refused"] == 3
    replay = Engine(two_ranks_heard_until(1.0), Thresholds(), Clock(2.0))
    assert replay.document().stats.refused == 0  # no collector: none refused


def test_a_restart_is_a_new_run_with_the_history_kept() -> None:
    engine = Engine(two_ranks_heard_until(1.0), Thresholds(), Clock(100.0))
    engine.tick(100.0)
    engine.tick(100.5)
    engine.restart(ServerState(started=200.0))
    assert engine.alerts == [] and engine.state.ranks == {}
    assert engine.tick(201.0) == []  # nothing up in the new run, nothing cleared either
    history = engine.document().history
    assert [(e.event, e.alert.kind) for e in history] == [("raised", "silent")]


def test_the_virtual_clock_stands_still_at_max_speed_and_once_stopped() -> None:
    clock = VirtualClock(10.0, speed=None)
    clock.wait_until(50.0, threading.Event())  # returns at once
    assert clock() == 10.0
    clock.reach(50.0)
    assert clock() == 50.0
    paced = VirtualClock(10.0, speed=1000.0)
    paced.wait_until(10.5, threading.Event())  # half a virtual second: half a millisecond
    paced.reach(10.5)
    assert 10.5 <= paced() <= 10.5 + 1e-9  # not past the last record until the next is due
    paced.stop()
    assert paced() == 10.5
