"""The pace the server asks of its relays (``server/pace.py``), answered on the query port,
and what diagnosis allows a relay at a slower pace and its ranks."""

from __future__ import annotations

import time

import msgspec
import pytest
import zmq

from ddpwatch.core.protocol import Batch, PaceReply, Sample, encode
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts.ranks import silent_after
from ddpwatch.diagnosis.rules import diagnose
from ddpwatch.server.collector import ANSWER_EVERY, Collector
from ddpwatch.server.ingest import Receive
from ddpwatch.server.pace import DOWN_AFTER_S, MOST, UP_AFTER_S, Pace
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState


def test_the_pace_slows_after_two_seconds_behind_and_comes_back_only_after_twenty() -> None:
    pace = Pace()
    assert not pace.update(3.0, 100.0) and pace.every == 1  # behind, but only just now
    assert not pace.update(3.0, 100.0 + UP_AFTER_S - 0.1)
    assert pace.update(3.0, 100.0 + UP_AFTER_S) and pace.every == 2
    assert not pace.update(9.0, 100.0 + 2 * UP_AFTER_S - 0.1)  # each step needs as long again
    assert pace.update(9.0, 100.0 + 2 * UP_AFTER_S) and pace.every == 4
    assert not pace.update(9.0, 110.0) and not pace.update(9.0, 130.0)  # at its slowest
    assert pace.every == MOST == 4
    t = 200.0
    assert not pace.update(0.1, t)  # caught up: not yet
    assert not pace.update(0.5, t + 10.0)  # neither far behind nor caught up: both reset
    assert not pace.update(0.1, t + 11.0)
    assert not pace.update(0.1, t + 11.0 + DOWN_AFTER_S - 0.1) and pace.every == 4
    assert pace.update(0.1, t + 11.0 + DOWN_AFTER_S) and pace.every == 2
    assert pace.update(0.1, t + 11.0 + 2 * DOWN_AFTER_S) and pace.every == 1
    assert not pace.update(0.1, t + 200.0) and pace.every == 1


def test_a_lag_that_comes_and_goes_never_flips_the_pace() -> None:
    """Behind by more than a second for a moment every few seconds: never two seconds on
    end, so the relays keep their pace."""
    pace = Pace()
    for i in range(100):
        pace.update(1.5 if i % 4 == 0 else 0.5, 100.0 + i * 0.6)
    assert pace.every == 1


def test_a_held_pace_does_not_move_with_the_lag() -> None:
    pace = Pace()
    pace.hold(2)
    assert not pace.update(0.0, 0.0) and not pace.update(0.0, 10 * DOWN_AFTER_S)
    assert pace.every == 2


def test_the_reply_says_the_pace_and_the_lag() -> None:
    pace = Pace()
    assert msgspec.json.decode(pace.reply(), type=PaceReply) == PaceReply(1, 0.0)
    pace.update(4.26, 0.0)
    pace.update(4.26, UP_AFTER_S)
    assert msgspec.json.decode(pace.reply(), type=PaceReply) == PaceReply(2, 4.3)


def test_the_collector_answers_every_relays_pace_request_in_one_poll(port: int) -> None:
    state = ServerState(started=time.time())
    collector = Collector(state, lambda: b"{}", "127.0.0.1", port)
    context = zmq.Context.instance()
    asking = []
    try:
        for _ in range(40):
            sock = context.socket(zmq.REQ)
            sock.setsockopt(zmq.LINGER, 0)
            sock.connect(f"tcp://127.0.0.1:{port + 1}")
            asking.append(sock)
        for sock in asking:
            sock.send(b"pace")
        deadline = time.monotonic() + 10
        answered: list[bytes] = []
        while len(answered) < len(asking) and time.monotonic() < deadline:
            collector.poll(0.1)
            answered += [s.recv() for s in asking if s.poll(0, zmq.POLLIN)]
        assert len(answered) == len(asking)
        assert {msgspec.json.decode(a, type=PaceReply).every for a in answered} == {1}
        asking[0].send(b"status")  # the same socket answers status queries as before
        while not asking[0].poll(100, zmq.POLLIN) and time.monotonic() < deadline:
            collector.poll(0.1)
        assert asking[0].recv() == b"{}"
    finally:
        for sock in asking:
            sock.close()
        collector.close()


def test_the_pace_moves_within_one_long_receive(port: int) -> None:
    """A receive of a backlog can last seconds at the largest jobs; the pace moves while it
    goes (every ``ANSWER_EVERY`` heartbeats), not only after it. Here each look at the clock
    takes 2.5 s: one receive of 10,000 heartbeats ends at pace 4, where moving only after
    it would have stepped once (pace 2)."""
    clock = iter(float(t) for t in range(1000, 100_000, 5))
    state = ServerState(started=999.0)
    collector = Collector(state, lambda: b"{}", "127.0.0.1", port, clock=lambda: next(clock) / 2)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 0)
    try:
        collector.poll(0.0)  # nothing yet: heard up to now
        push.connect(f"tcp://127.0.0.1:{port}")
        for i in range(20_000):
            push.send(encode(Sample(v=1, rank=i % 100, t=0.0, step=i // 100)))
        deadline = time.monotonic() + 10
        while collector._pull.get(zmq.EVENTS) == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
        time.sleep(0.5)  # the rest of the backlog queued behind the first
        assert collector.poll(1.0) >= ANSWER_EVERY
        assert collector.pace.every == 4 == state.pace
    finally:
        push.close()
        collector.close()


# --- what diagnosis allows a relay at pace 2 --------------------------------------------------


def paced_node(every: int, relay_quiet: float, ranks_quiet: float, now: float) -> ServerState:
    """Node A's 4 ranks direct and fresh; node B's 4 through a relay at ``every``, its last
    batch ``relay_quiet`` ago, its ranks last heard ``ranks_quiet`` ago (the frames in it)."""
    state = ServerState(started=now - 60)
    batch = Batch(v=1, relay="node-b:9", t=0.0, host="node-b", every=every)
    taking = Receive(state, now - relay_quiet, lambda m: True)
    for rank in range(8):
        sample = Sample(v=1, rank=rank, t=0.0, pid=100 + rank, world_size=8, step=7)
        state.apply(sample, now - 0.2 if rank < 4 else now - ranks_quiet)
    taking.add_other(encode(batch))
    taking.take_all(lambda: None, 1 << 20)
    state.relays["node-b:9"].ranks.update(range(4, 8))
    for rank in range(4, 8):
        state.ranks[rank].relayed = every
    return state


def named(state: ServerState, now: float) -> set[str]:
    return {a.kind for a in diagnose(state, now, Thresholds()) if a.ranks}


@pytest.mark.parametrize("every", [1, 2])
def test_a_relay_at_its_pace_is_not_lost_and_its_ranks_not_silent(every: int) -> None:
    """Batches every ``every`` beats; a batch late by a beat on top (the relay's thread, the
    server's receive) is still no lost relay, and its ranks' frames, held up to ``every``
    beats in it, are no silent ranks."""
    now = 1000.0
    quiet = 0.5 * every + 0.5
    assert named(paced_node(every, quiet, quiet + 0.5 * every, now), now) == set()


def test_a_relay_quiet_for_as_long_is_lost_at_pace_1_not_at_pace_2() -> None:
    """2.2 s without a batch, its ranks' last frames 3.2 s old: four beats of a relay at
    pace 1 (ranks silent after 2.5 + 0.5 s), two at pace 2 (after 2.5 + 1.0 s)."""
    now = 1000.0
    assert "relay_lost" in named(paced_node(1, 2.2, 3.2, now), now)
    assert named(paced_node(2, 2.2, 3.2, now), now) == set()
    assert "relay_lost" in named(paced_node(2, 3.2, 4.2, now), now)  # and later it is


def test_a_relayed_rank_gets_its_relays_pace_on_top_of_the_silent_threshold() -> None:
    th = Thresholds()
    record = RankRecord(rank=0, first_seen=0.0, last_seen=0.0, step=3)
    assert [silent_after(record, th, True) for record.relayed in (0, 1, 2)] == [
        th.silent,
        th.silent + 0.5,
        th.silent + 1.0,
    ]
