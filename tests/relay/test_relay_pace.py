"""A relay at the server's pace (``relay_pacer.py``, ``server/pace.py``): real relays, a
server's two sockets played by the test or a real ``Server``."""

from __future__ import annotations

import itertools
import statistics
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
import zmq
from conftest import LiveServer
from test_relay import Ranks, _beat, upstream, wait_for

from ddpwatch.core.protocol import PACE_REQUEST, Batch, Event, PaceReply, decode_wire, encode
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.relay import Relay


@pytest.fixture
def listen(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/relay.sock"


class FakeServer:
    """The server's PULL (batches, with their arrival times) and its query REP, answering
    ``pace`` with ``reply`` (changeable) on a thread."""

    def __init__(self, port: int, reply: bytes) -> None:
        context = zmq.Context.instance()
        self.reply = reply
        self.asked = 0
        self.pull = context.socket(zmq.PULL)
        self.pull.bind(upstream(port))
        self.rep = context.socket(zmq.REP)
        self.rep.bind(f"tcp://127.0.0.1:{port + 1}")
        self.batches: list[tuple[float, Batch]] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self.pull, zmq.POLLIN)
        poller.register(self.rep, zmq.POLLIN)
        while not self._stop.is_set():
            ready = dict(poller.poll(50))
            if self.rep in ready:
                assert self.rep.recv() == PACE_REQUEST
                self.asked += 1
                self.rep.send(self.reply)
            while self.pull in ready:
                try:
                    frame = self.pull.recv(zmq.NOBLOCK)
                except zmq.Again:
                    break
                batch = decode_wire(frame)
                assert isinstance(batch, Batch)
                self.batches.append((time.monotonic(), batch))

    def since(self, t: float) -> list[tuple[float, Batch]]:
        return [(at, b) for at, b in list(self.batches) if at >= t]

    def close(self) -> None:
        self._stop.set()
        self._thread.join(5)
        self.pull.close(linger=0)
        self.rep.close(linger=0)


def pace(every: int) -> bytes:
    return msgspec.json.encode(PaceReply(every, 3.0))


@pytest.fixture
def fake(port: int) -> Iterator[FakeServer]:
    server = FakeServer(port, pace(2))
    yield server
    server.close()


def beating(push: zmq.Socket[bytes], ranks: int, stop: threading.Event) -> None:
    """Each rank's heartbeat every 50 ms (a step each), as fast ranks send them."""
    step = 0
    while not stop.is_set():
        step += 1
        for rank in range(ranks):
            push.send(_beat(rank, step))
        stop.wait(0.05)


def test_a_relay_at_pace_2_sends_every_second_beat_each_ranks_newest_and_events_at_once(
    port: int, listen: str, fake: FakeServer
) -> None:
    relay = Relay(upstream(port), listen, beat_s=0.2).start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(listen)
    stop = threading.Event()
    sender = threading.Thread(target=beating, args=(push, 3, stop), daemon=True)
    try:
        wait_for(lambda: relay.pacer.every == 2, 5.0, "the relay to take the server's pace")
        sender.start()
        paced = time.monotonic() + 0.5
        time.sleep(2.5)
        event_at = time.monotonic()
        push.send(encode(Event(v=1, rank=1, t=0.0, event="log", text="now")))
        time.sleep(0.5)
        batches = fake.since(paced)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(batches)]
        beats = [b for _, b in batches if not any(m for m in b.frames if _is_event(m))]
        assert all(b.every == 2 for _, b in batches)
        # one batch every two 0.2 s beats but the event's, each rank's newest alone in it
        assert statistics.median(gaps) == pytest.approx(0.4, abs=0.1), gaps
        for batch in beats:
            assert sorted(batch.ranks) == [0, 1, 2], batch.ranks
        assert sum(b.coalesced for b in beats) > 0 and relay.stats.coalesced > 0
        (carried,) = [(at, b) for at, b in batches if any(_is_event(m) for m in b.frames)]
        assert carried[0] - event_at < 0.15  # not held for the pace's next beat
        fake.reply = pace(1)  # caught up: every beat again
        wait_for(lambda: relay.pacer.every == 1, 5.0, "the relay to take pace 1")
        again = time.monotonic() + 0.3
        time.sleep(1.5)
        later = fake.since(again)
        assert all(b.every == 1 for _, b in later)
        gaps = [b[0] - a[0] for a, b in itertools.pairwise(later)]
        assert statistics.median(gaps) == pytest.approx(0.2, abs=0.07), gaps
    finally:
        stop.set()
        sender.join(2)
        push.close(linger=0)
        relay.stop()


def _is_event(frame: bytes) -> bool:
    return isinstance(decode_wire(frame), Event)


def test_a_server_that_knows_no_pace_leaves_the_relay_at_every_beat(
    port: int, listen: str
) -> None:
    """An older server answers ``pace`` with its unknown-request error: pace 1."""
    fake = FakeServer(port, b'{"error": "unknown request; send the bytes status"}')
    relay = Relay(upstream(port), listen, beat_s=0.2).start()
    try:
        wait_for(lambda: fake.asked >= 1, 5.0, "the relay to ask")
        time.sleep(1.0)
        assert relay.pacer.every == 1
        batches = fake.since(time.monotonic() - 0.9)
        assert len(batches) >= 3 and all(b.every == 1 for _, b in batches)
    finally:
        relay.stop()
        fake.close()


def test_a_real_server_at_pace_2_names_nobody_and_hears_every_rank(
    port: int, listen: str
) -> None:
    """A real server asking for pace 2 (as after a backlog), a real relay and four ranks:
    for 5 s (twice the relay's lost threshold at that pace, and its ranks' silent one) no rank
    is silent, no relay lost, nothing named; every rank stays heard."""
    live = LiveServer(port, Thresholds())
    live.server.collector.pace.every = 2  # as two seconds behind would leave it
    relay = Relay(upstream(port), listen).start()
    ranks = Ranks(port, 4, relay.listen)
    try:
        wait_for(lambda: relay.pacer.every == 2, 5.0, "the relay to take pace 2")
        time.sleep(5.0)
        status = live.server.status()
        assert [c.alert.to_dict() for c in live.changes] == []
        assert {r.state for r in status.ranks} == {"running"}
        (entry,) = status.relays
        assert entry.every == 2 and entry.ranks == [0, 1, 2, 3]
        assert max(r.last_seen_s for r in status.ranks) < 2.0
    finally:
        ranks.stop()
        relay.stop()
        live.stop()
