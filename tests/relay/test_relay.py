"""Per-node relays (issue #13): real relay processes, real publishers, a real server.

A relay batches its node's frames into one per beat; these tests check that nothing is lost
or reordered on the way, that ranks fall back to the server when their relay dies, and that
a relay outlives a server restart.
"""

from __future__ import annotations

import math
import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from conftest import (
    EXAMPLES,
    TESTS,
    LiveServer,
    aborted_box,
    alert_of,
    as_json,
    ddpwatch_run,
    poll_status,
)

from ddpwatch import relay as relay_module
from ddpwatch.agent import publisher as publisher_module
from ddpwatch.agent.publisher import Publisher
from ddpwatch.core.boxreader import BoxReader
from ddpwatch.core.protocol import Batch, Collective, Event, Hello, Sample, decode_wire, encode
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.rules import diagnose
from ddpwatch.jobs.launch import _start_relay
from ddpwatch.relay import (
    RELAY_ENV,
    Relay,
    RelayError,
    find_relay,
    relay_endpoint,
    relay_listening,
)
from ddpwatch.server.collector import Collector
from ddpwatch.state.relays import note_batch
from ddpwatch.state.state import ServerState


@pytest.fixture
def server(port: int) -> Iterator[LiveServer]:
    live = LiveServer(port, Thresholds(interval=0.2))
    yield live
    live.stop()


@pytest.fixture
def listen(tmp_path: Path) -> str:
    return f"ipc://{tmp_path}/relay.sock"


def upstream(port: int) -> str:
    return f"tcp://127.0.0.1:{port}"


class Ranks:
    """Publishers (the agent's own) for ranks 0..n-1 of one node, each counting its steps."""

    def __init__(
        self,
        port: int,
        n: int,
        relay: str | None,
        first_rank: int = 0,
        world: int | None = None,
        step_time: float | None = None,
    ) -> None:
        self.steps = [0] * n
        self.step_time = step_time  # given: step_skew reads their steps (started together)
        self.first_rank = first_rank
        self.world = world or n
        self.publishers = []
        env_relay = os.environ.get(RELAY_ENV)
        os.environ[RELAY_ENV] = relay or "off"
        try:
            for i in range(n):
                publisher = Publisher(upstream(port), 0.1, self._beat(i))
                publisher.start()
                self.publishers.append(publisher)
            deadline = time.monotonic() + 5
            while any(p.relay is None and relay for p in self.publishers):
                assert time.monotonic() < deadline, "publishers did not pick their relay"
                time.sleep(0.01)
        finally:
            if env_relay is None:
                os.environ.pop(RELAY_ENV)
            else:
                os.environ[RELAY_ENV] = env_relay

    def _beat(self, i: int) -> Callable[[], list[Any]]:
        rank = self.first_rank + i

        def beat() -> list[Any]:
            self.steps[i] += 1
            return [
                Sample(
                    v=1,
                    rank=rank,
                    t=time.time(),
                    pid=os.getpid() * 100 + rank,
                    host="node-a" if rank < 4 else "node-b",
                    world_size=self.world,
                    step=self.steps[i],
                    step_time_s=self.step_time,
                    avg_step_time_s=self.step_time,
                )
            ]

        return beat

    def stop(self) -> None:
        for publisher in self.publishers:
            publisher.stop()


def relay_process(port: int, listen: str) -> subprocess.Popen[str]:
    """``ddpwatch relay`` as a user starts it, once it listens."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "relay", "--to", f"127.0.0.1:{port}", "--listen", listen],
        stderr=subprocess.PIPE,
        text=True,
    )  # fmt: skip
    assert proc.stderr is not None
    line = proc.stderr.readline()
    assert "→" in line, line
    return proc


def ranks_running(n: int) -> Callable[[dict[str, Any]], bool]:
    def check(status: dict[str, Any]) -> bool:
        ranks = status["ranks"]
        return len(ranks) == n and all(r["state"] == "running" for r in ranks)

    return check


def test_a_relay_batches_its_ranks_and_the_server_counts_every_frame(
    server: LiveServer, listen: str
) -> None:
    relay = Relay(upstream(server.port), listen, beat_s=0.5).start()
    # a relay coalesces while the server takes nothing, as before it is connected: not here
    wait_for(lambda: relay.stats.batches > 0 and not relay._held, 3.0, "a connected relay")
    ranks = Ranks(server.port, 4, relay.listen)
    try:
        time.sleep(2.0)
        status = as_json(server.server.status())
        assert [r["host"] for r in status["ranks"]] == ["node-a"] * 4
        (entry,) = status["relays"]
        assert entry["ranks"] == [0, 1, 2, 3] and entry["host"] == relay.host
        # four ranks at 10 Hz, one batch per 0.5 s beat: many frames, few batches
        assert entry["frames"] >= 40 and entry["batches"] <= entry["frames"] / 8
        assert status["stats"]["received"] == entry["frames"]
        assert status["stats"]["rejected"] == 0
    finally:
        ranks.stop()
        relay.stop()


def test_events_keep_their_order_and_leave_without_waiting_for_the_beat(
    server: LiveServer, listen: str
) -> None:
    relay = Relay(upstream(server.port), listen, beat_s=5.0).start()
    ranks = Ranks(server.port, 1, relay.listen)
    try:
        publisher = ranks.publishers[0]
        for i in range(50):
            publisher.publish(Event(v=1, rank=0, t=time.time(), event="log", text=f"line {i}"))
        started = time.monotonic()
        # the 5 s beat has not come: events go out at once
        poll_status(
            server.server, lambda s: s["ranks"] and len(s["ranks"][0]["log_tail"]) == 20, 2.0
        )
        assert time.monotonic() - started < 2.0
        tail = server.server.state.ranks[0].log_tail
        assert list(tail) == [f"line {i}" for i in range(50)]
    finally:
        ranks.stop()
        relay.stop()


def test_a_killed_relay_leaves_its_ranks_to_the_server(server: LiveServer, listen: str) -> None:
    relay = relay_process(server.port, listen)
    ranks = Ranks(server.port, 3, listen, step_time=0.1)  # a step a beat
    try:
        poll_status(server.server, ranks_running(3), 5.0)
        poll_status(server.server, lambda s: s["relays"] and s["relays"][0]["ranks"], 3.0)
        relay.send_signal(signal.SIGKILL)
        relay.wait(5)
        before = list(ranks.steps)
        # the ranks find the server within a beat or two; they are never reported silent
        poll_status(
            server.server,
            lambda s: all(r["step"] > before[r["rank"]] + 5 for r in s["ranks"]),
            5.0,
        )
        assert all(p.relay is None for p in ranks.publishers)
        # #26: while they switch, their last relayed steps are no evidence against the fresh
        # direct ones (step_skew named healthy ranks ~100 steps behind in 3 of 3 runs)
        named = [(a.alert.kind, a.alert.ranks) for a in server.changes if a.alert.ranks]
        assert not named, named
    finally:
        ranks.stop()
        relay.kill()


@pytest.mark.parametrize("transport", ["ipc", "tcp"])
def test_ranks_go_back_to_a_restarted_relay(
    server: LiveServer, listen: str, monkeypatch: pytest.MonkeyPatch, transport: str
) -> None:
    """A relay killed and started again (by hand, or by a supervisor) gets its ranks back:
    they sent to the server meanwhile, and would otherwise stay there for the rest of the
    job, the load relays exist to take off it. Over ``ipc://``, and over ``tcp://`` where
    ``$DDPWATCH_RELAY`` names one (no ``ipc://`` there)."""
    monkeypatch.setattr(publisher_module, "RELAY_PROBE_S", 0.3)
    if transport == "tcp":
        listen = f"tcp://127.0.0.1:{_free_port()}"
    relay = relay_process(server.port, listen)
    ranks = Ranks(server.port, 3, listen)
    try:
        poll_status(server.server, lambda s: s["relays"] and s["relays"][0]["ranks"], 5.0)
        relay.send_signal(signal.SIGKILL)
        relay.wait(5)
        wait_for(lambda: all(p.relay is None for p in ranks.publishers), 5.0, "went direct")
        time.sleep(1.0)  # a dead relay's socket file stays: looked at, it is not taken back
        assert all(p.relay is None for p in ranks.publishers)
        relay = relay_process(server.port, listen)
        wait_for(lambda: all(p.relay == listen for p in ranks.publishers), 5.0, "went back")
        frames = server.server.state.relays
        before = {name: entry.frames for name, entry in frames.items()}
        poll_status(
            server.server,
            lambda s: sum(e["frames"] for e in s["relays"]) > sum(before.values()) + 20,
            5.0,
        )
        assert not [a for a in server.changes if a.alert.kind == "silent"]
    finally:
        ranks.stop()
        relay.kill()
        relay.wait(5)


def test_ranks_started_before_their_relay_move_to_it(
    server: LiveServer, listen: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(publisher_module, "RELAY_PROBE_S", 0.3)
    ranks = Ranks(server.port, 2, listen)  # nothing listens there yet: the server, after 1 s
    relay = None
    try:
        poll_status(server.server, ranks_running(2), 5.0)
        wait_for(lambda: all(p.relay is None for p in ranks.publishers), 5.0, "went direct")
        relay = relay_process(server.port, listen)
        wait_for(lambda: all(p.relay == listen for p in ranks.publishers), 5.0, "moved")
        poll_status(server.server, lambda s: s["relays"] and s["relays"][0]["ranks"] == [0, 1], 5.0)
    finally:
        ranks.stop()
        if relay is not None:
            relay.kill()
            relay.wait(5)


def wait_for(condition: Callable[[], bool], timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out: {what}"
        time.sleep(0.02)


def test_a_restarted_relay_takes_over_the_dead_ones_socket(port: int, listen: str) -> None:
    first = relay_process(port, listen)
    first.send_signal(signal.SIGKILL)
    first.wait(5)
    assert Path(listen.removeprefix("ipc://")).exists()  # a dead relay leaves its socket file
    second = relay_process(port, listen)
    try:
        with pytest.raises(RelayError, match="already listens"):
            Relay(upstream(port), listen)
    finally:
        second.terminate()
        assert second.wait(5) == 0
    assert not Path(listen.removeprefix("ipc://")).exists()
    assert second.stderr is not None
    # what it did, said once it stops: nothing came, and no server was there
    assert second.stderr.read().strip().splitlines()[-1] == (
        "ddpwatch relay: 0 frames forwarded in 0 batches, 0 heartbeats coalesced while the"
        " server took none, 0 rejected, 0 dropped"
    )


def test_a_server_restarted_behind_a_relay_hears_every_rank_again(port: int, listen: str) -> None:
    relay = relay_process(port, listen)
    ranks = Ranks(port, 2, listen)
    try:
        first = LiveServer(port, Thresholds(interval=0.1))
        poll_status(first.server, ranks_running(2), 5.0)
        first.stop()
        time.sleep(1.0)  # the relay holds what the ranks send meanwhile
        second = LiveServer(port, Thresholds(interval=0.1))
        try:
            status = poll_status(
                second.server,
                lambda s: len(s["ranks"]) == 2 and all(r["host"] for r in s["ranks"]) and s,
                5.0,
            )
            # identity comes back at once (the relay resends it), not after ten beats
            assert [r["host"] for r in status["ranks"]] == ["node-a", "node-a"]
            assert status["world_size"] == 2
            assert status["relays"][0]["dropped"] == 0
        finally:
            second.stop()
    finally:
        ranks.stop()
        relay.terminate()
        relay.wait(5)


def test_invalid_frames_through_a_relay_are_counted_by_the_server(
    server: LiveServer, listen: str
) -> None:
    relay = Relay(upstream(server.port), listen, beat_s=0.1).start()
    context = zmq.Context.instance()
    push = context.socket(zmq.PUSH)
    push.connect(listen)
    try:
        push.send(b"\x81\xa1v\x01")  # a map with only a version
        push.send(encode(Hello(v=1, rank=5, t=time.time(), host="node-b")))
        status = poll_status(server.server, lambda s: s["ranks"] and s, 3.0)
        assert status["stats"]["rejected"] == 1
        assert status["ranks"][0]["rank"] == 5
    finally:
        push.close(linger=0)
        relay.stop()


def test_the_collector_opens_batches_and_dates_each_frame(port: int) -> None:
    now = 1000.0
    state = ServerState(started=now)
    collector = Collector(state, lambda: b"{}", port=port, clock=lambda: now)
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(upstream(port))
    try:
        frames = [
            encode(Event(v=1, rank=1, t=0.0, event="crash", error=None)),
            encode(Hello(v=1, rank=2, t=0.0)),
            b"not msgpack",
            encode(Batch(v=1, relay="x:1", t=0.0)),  # a batch inside a batch
        ]
        batch = Batch(
            v=1, relay="node-c:7", t=0.0, seq=3, frames=frames, ages_us=[2_000_000, 0, 0, 0],
            rejected=2, coalesced=5,
        )  # fmt: skip
        push.send(encode(batch))
        deadline = time.monotonic() + 3
        while not state.ranks and time.monotonic() < deadline:
            collector.poll(0.1)
        assert state.ranks[1].first_seen == pytest.approx(now - 2.0)
        assert state.ranks[2].first_seen == now
        assert state.rejected == 2 + 2  # the relay's two, the bad frame and the nested batch
        assert state.received == 2 + 5  # the two valid frames, the five the relay coalesced
        relay = state.relays["node-c:7"]
        assert relay.ranks == {1, 2} and relay.frames == 4 and relay.host is None
        assert relay.coalesced == 5
        assert decode_wire(encode(batch)) == batch
    finally:
        push.close(linger=0)
        collector.close()


def test_find_relay_follows_the_environment_and_a_live_socket(port: int, tmp_path: Path) -> None:
    server = upstream(port)
    assert find_relay(server, {RELAY_ENV: "off"}) is None
    assert find_relay(server, {RELAY_ENV: "tcp://10.0.0.1:7000"}) == "tcp://10.0.0.1:7000"
    assert find_relay(server, {}) is None  # nothing listens on the default socket
    relay = Relay(server)  # the default: a per-user socket named after the server
    try:
        assert relay.listen == relay_endpoint(server)
        assert find_relay(server, {}) == relay.listen
        directory = Path(relay.listen.removeprefix("ipc://")).parent
        assert directory.stat().st_mode & 0o077 == 0  # other users cannot inject frames
    finally:
        relay.close()
    assert find_relay(server, {}) is None


def test_a_tcp_relay_is_seen_listening_by_one_connect() -> None:
    endpoint = f"tcp://127.0.0.1:{_free_port()}"
    assert not relay_listening(endpoint)
    relay = Relay("tcp://127.0.0.1:9", endpoint)
    try:
        assert relay_listening(endpoint)
        assert relay_listening(endpoint.replace("127.0.0.1", "[127.0.0.1]"))
    finally:
        relay.close()
    assert not relay_listening(endpoint)
    assert not relay_listening("tcp://no-port") and not relay_listening("udp://x:1")


@pytest.mark.e2e
def test_ddpwatch_run_with_addr_relays_the_nodes_ranks(server: LiveServer, tmp_path: Path) -> None:
    result = ddpwatch_run(
        server, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={_free_port()}",
        str(EXAMPLES / "train_ddp.py"), "--steps", "30",
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    status = as_json(server.server.status())
    (entry,) = status["relays"]
    assert entry["ranks"] == [0, 1]
    assert {r["state"] for r in status["ranks"]} == {"exited"}


def test_without_ipc_ddpwatch_run_starts_its_relay_on_a_loopback_port_it_tells_the_ranks(
    server: LiveServer, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Windows has no ``ipc://``: there the relay ``ddpwatch run --addr`` starts listens on a
    free port of 127.0.0.1, and the ranks learn it from ``$DDPWATCH_RELAY``."""
    monkeypatch.setattr(relay_module, "ipc_available", lambda: False)
    to_server = upstream(server.port)
    assert relay_endpoint(to_server) is None
    assert find_relay(to_server, {}) is None  # no socket file to look for: send directly
    env: dict[str, str] = {}
    node_relay = _start_relay(f"127.0.0.1:{server.port}", env)
    assert node_relay is not None
    try:
        listen = env[RELAY_ENV]
        assert listen == node_relay.listen and listen.startswith("tcp://127.0.0.1:")
        assert relay_listening(listen)  # a real port, not the wildcard asked for
        ranks = Ranks(server.port, 2, listen)
        try:
            server.wait_for(lambda s: [r["ranks"] for r in s["relays"]] == [[0, 1]], 10)
        finally:
            ranks.stop()
    finally:
        node_relay.stop()
    assert not relay_listening(listen)


def _free_port() -> int:
    from ddpwatch.core.ports import free_port_pair

    return free_port_pair()


# --- diagnosis: a lost relay is named once, as the relay -----------------------------------


def node_state(lost_at: float, *, moved: bool = False, all_silent: bool = False) -> ServerState:
    """Two nodes of four ranks, each behind a relay; node-b's relay was last heard at
    ``lost_at``. Its ranks went silent with it, or (``moved``) report directly since."""
    state = ServerState(started=0.0)
    for rank in range(8):
        host = "node-a" if rank < 4 else "node-b"
        state.apply(Sample(v=1, rank=rank, t=0.0, pid=100 + rank, host=host, world_size=8), 1.0)
    for host, ranks in (("node-a", range(4)), ("node-b", range(4, 8))):
        record = note_batch(state.relays, Batch(v=1, relay=f"{host}:9", t=0.0, host=host), 1.0)
        assert record is not None
        record.ranks.update(ranks)
    now = lost_at + 6.0
    for rank in range(8):
        on_b = rank >= 4
        last = lost_at if on_b and not moved else now - 0.2
        if all_silent:
            last = lost_at
        blocked = None if on_b else Collective(op="all_reduce", seq=9, since_s=5.0)
        state.apply(Sample(v=1, rank=rank, t=0.0, step=7, collective=blocked), last)
    state.relays["node-a:9"].last_seen = lost_at if all_silent else now - 0.2
    state.relays["node-b:9"].last_seen = lost_at
    return state


def test_a_relay_lost_with_its_ranks_is_one_alert_about_that_node() -> None:
    lost_at = 10.0
    alerts = diagnose(node_state(lost_at), lost_at + 6.0, Thresholds())
    relay = [a for a in alerts if a.kind == "relay_lost"]
    assert len(relay) == 1
    assert relay[0].severity == "error" and relay[0].ranks == (4, 5, 6, 7)
    assert relay[0].waiting == (0, 1, 2, 3)
    assert "node-b" in relay[0].message
    # no second opinion naming the same ranks (or anyone else) as silent culprits
    assert not [a for a in alerts if a.kind == "silent" and a.ranks]


def test_a_lost_relay_is_named_with_all_its_ranks_once_the_last_one_is_silent() -> None:
    """Its ranks' last frames came in its last two batches, so they go silent a batch apart:
    the alert waits for the last one rather than name part of the node, then all of it (a
    second alert; seen in 2 of 3 loaded runs of the end-to-end test below)."""
    lost_at = 10.0
    named = set()
    for tick in range(24):
        now = lost_at + 1.0 + tick * 0.25
        state = node_state(lost_at)
        for rank in (4, 5):
            state.ranks[rank].last_seen = lost_at - 0.5  # in the batch before the last
        for rank in range(4):
            state.ranks[rank].last_seen = now - 0.2
        state.relays["node-a:9"].last_seen = now - 0.2
        named |= {a.ranks for a in diagnose(state, now, Thresholds()) if a.kind == "relay_lost"}
    assert named == {(4, 5, 6, 7)}


def test_a_relay_whose_ranks_moved_to_the_server_is_a_warning_without_culprit() -> None:
    lost_at = 10.0
    alerts = diagnose(node_state(lost_at, moved=True), lost_at + 6.0, Thresholds())
    (relay,) = [a for a in alerts if a.kind == "relay_lost"]
    assert relay.severity == "warning" and relay.ranks == ()
    assert "node-b" in relay.message and "directly" in relay.message


def test_everything_silent_at_once_names_no_relay() -> None:
    lost_at = 10.0
    alerts = diagnose(node_state(lost_at, all_silent=True), lost_at + 6.0, Thresholds())
    assert not [a for a in alerts if a.kind == "relay_lost"]
    assert not [a for a in alerts if a.ranks]  # the server's own network, or the whole job


def test_a_silent_rank_behind_a_live_relay_is_still_that_rank() -> None:
    state = node_state(10.0, moved=True)
    state.relays["node-b:9"].last_seen = 15.8  # the relay is fine
    state.ranks[5].last_seen = 10.0  # one rank of it went quiet
    alerts = diagnose(state, 16.0, Thresholds())
    assert not [a for a in alerts if a.kind == "relay_lost"]
    assert [a.ranks for a in alerts if a.kind == "silent"] == [(5,)]


NODE_SCRIPT = """
import os, sys, time
sys.path[:0] = [{here!r}, {tests!r}]  # this module, and the helpers it imports
from test_relay import Ranks
os.environ["DDPWATCH_RELAY"] = {listen!r}
ranks = Ranks({port}, 4, {listen!r}, first_rank=4, world=8)
print("up", flush=True)
time.sleep(60)
"""


def test_a_node_lost_with_its_relay_is_named_once_as_that_relay(
    server: LiveServer, listen: str
) -> None:
    """A whole node going away (its relay and its ranks, SIGKILLed together) while another
    node's ranks keep waiting for it: one ``relay_lost`` error, no per-rank culprits."""
    relay = relay_process(server.port, listen)
    script = NODE_SCRIPT.format(
        here=str(Path(__file__).parent), tests=str(TESTS), listen=listen, port=server.port
    )
    node = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
    others = Ranks(server.port, 4, None, world=8)  # node-a: straight to the server
    try:
        assert node.stdout is not None and node.stdout.readline() == "up\n"
        poll_status(server.server, ranks_running(8), 10.0)
        node.send_signal(signal.SIGKILL)
        relay.send_signal(signal.SIGKILL)
        found = poll_status(server.server, alert_of("relay_lost"), 10.0)
        assert found["severity"] == "error" and found["ranks"] == [4, 5, 6, 7]
        time.sleep(1.0)  # a few more ticks: nothing else names anyone
        named = [c.alert for c in server.changes if c.event != "cleared" and c.alert.ranks]
        assert {a.kind for a in named} == {"relay_lost"}, named
    finally:
        others.stop()
        node.kill()
        relay.kill()
        node.wait(5)
        relay.wait(5)


def test_a_relay_stopped_without_a_server_counts_what_it_could_not_forward(
    port: int, listen: str
) -> None:
    """Nothing listens upstream: the frames stay pending, and at stop they are counted as
    dropped (``ddpwatch relay`` prints it), never as forwarded."""
    relay = Relay(upstream(port), listen).start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(listen)
    try:
        for rank in range(5):
            push.send(encode(Hello(v=1, rank=rank, t=0.0)))
        deadline = time.monotonic() + 5
        while relay.stats.received < 5 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        push.close(linger=0)
        relay.stop()
    assert (relay.stats.received, relay.stats.forwarded, relay.stats.dropped) == (5, 0, 5)


def _beat(
    rank: int, step: int, *, loss: float = 1.0, pid: int | None = None, size: int = 0
) -> bytes:
    """A heartbeat; ``size`` GPU pids make it about as large as a real one (``size`` 60)."""
    pids = list(range(100_000, 100_000 + size)) or None
    return encode(
        Sample(v=1, rank=rank, t=float(step), step=step, loss=loss, pid=pid, gpu_pids=pids)
    )


def _received_batches(pull: zmq.Socket[bytes], until: Callable[[list[Batch]], bool]) -> list[Batch]:
    batches: list[Batch] = []
    deadline = time.monotonic() + 5
    while not until(batches):
        assert time.monotonic() < deadline, f"relay sent only {batches}"
        if pull.poll(100):
            batch = decode_wire(pull.recv())
            assert isinstance(batch, Batch)
            batches.append(batch)
    return batches


def test_a_relay_held_back_keeps_each_ranks_newest_heartbeat_and_every_event(
    port: int, listen: str
) -> None:
    """The server is away (the same as one that takes no more): the relay keeps, per rank,
    only the newest of its plain heartbeats in a row, never one with a NaN loss or an
    identity the newer lacks, never across an event; it says how many it left out, and the
    server gets every rank's last state and every event once it takes frames again."""
    relay = Relay(upstream(port), listen, beat_s=0.2).start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(listen)
    pull = zmq.Context.instance().socket(zmq.PULL)
    try:
        wait_for(lambda: relay._held, 2.0, "the relay to find no server")
        log = Event(v=1, rank=0, t=7.0, event="log", text="x")
        for rank in range(3):
            sent = [
                _beat(rank, 0, pid=100 + rank),  # tells the identity: 1 cannot replace it
                _beat(rank, 1),  # left out, and 2 with it: 3 supersedes them
                _beat(rank, 2),
                _beat(rank, 3, loss=math.nan),  # a NaN: 4 cannot replace it
                _beat(rank, 4),  # the event after it keeps it
                encode(msgspec.structs.replace(log, rank=rank)),
                _beat(rank, 5),  # left out
                _beat(rank, 6),
            ]
            for frame in sent:
                push.send(frame)
        # every frame taken in and placed (coalesced or pending): the relay's thread counts
        # a frame received before it decodes and places it. 10 s, as the next test waits for
        # its 8,000: the full suite on 2 cores once took over 3 s for these 24
        wait_for(
            lambda: (
                relay.stats.received == 24 and relay.stats.coalesced + len(relay._pending) == 24
            ),
            10.0,
            "the relay to take every frame",
        )
        assert relay.stats.coalesced == 9 and len(relay._pending) == 15

        pull.bind(upstream(port))
        batches = _received_batches(pull, lambda b: sum(len(x.frames) for x in b) >= 15)
        messages = [decode_wire(frame) for batch in batches for frame in batch.frames]
        for rank in range(3):
            mine = [m for m in messages if m.rank == rank]
            assert [getattr(m, "step", None) for m in mine] == [0, 3, 4, None, 6]
            assert isinstance(mine[3], Event) and mine[0].pid == 100 + rank
            assert math.isnan(mine[1].loss)
        assert sum(batch.coalesced for batch in batches) == 9
        # each batch says its frames' ranks and which are plain heartbeats (``Batch.plain``):
        # not the identity, the NaN or the event
        for batch in batches:
            told = [decode_wire(frame) for frame in batch.frames]
            assert batch.ranks == [m.rank for m in told]
            assert [getattr(told[i], "step", None) for i in batch.plain] == [
                m.step for m in told if isinstance(m, Sample) and m.step in (4, 6)
            ]
        # the relay's thread counts a batch forwarded once its send returned, and leaves held
        # once all is sent: the server can have them first (seen under load: forwarded 0)
        wait_for(lambda: not relay._held, 10.0, "the relay to see all sent")
        assert (relay.stats.forwarded, relay.stats.dropped) == (15, 0)
    finally:
        push.close(linger=0)
        pull.close(linger=0)
        relay.stop()


def test_a_relay_whose_server_is_away_holds_a_heartbeat_a_rank_and_loses_none(
    port: int, listen: str
) -> None:
    """Ranks beat on while the server is away: the relay keeps one heartbeat a rank however
    long that lasts (a burst within one beat included), and the server, once there, has each
    rank's newest heartbeat and identity and counts every heartbeat sent, taken in or
    coalesced: none lost, none dropped."""
    relay = Relay(upstream(port), listen, beat_s=0.02).start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.setsockopt(zmq.SNDHWM, 0)
    push.connect(listen)
    ranks, beats = 4, 2000
    try:
        for step in range(beats):
            for rank in range(ranks):
                push.send(_beat(rank, step, pid=100 + rank if step == 0 else None, size=60))
            if step % 50 == 49:
                time.sleep(0.01)  # beats come over many of the relay's beats, as they do
        wait_for(lambda: relay.stats.received == ranks * beats, 10.0, "the relay to take all")
        wait_for(lambda: relay.stats.coalesced > 0, 1.0, "the relay to hold back")
        # the identity heartbeat, then the newest heartbeat of each rank
        assert relay._held and len(relay._pending) == 2 * ranks
        state = ServerState(started=time.time())
        collector = Collector(state, lambda: b"{}", port=port)
        try:
            deadline = time.monotonic() + 10
            while state.received < ranks * beats and time.monotonic() < deadline:
                collector.poll(0.1)
        finally:
            collector.close()
        assert state.received == ranks * beats
        assert [state.ranks[r].step for r in range(ranks)] == [beats - 1] * ranks
        assert [state.ranks[r].pid for r in range(ranks)] == [100, 101, 102, 103]
        assert relay.stats.dropped == 0 and state.rejected == 0
        assert state.relays[relay.name].coalesced == relay.stats.coalesced == (beats - 2) * ranks
    finally:
        push.close(linger=0)
        relay.stop()


def test_what_waits_when_the_server_goes_away_is_coalesced_too(port: int, listen: str) -> None:
    """The server goes away while a burst waits for the relay's next beat: that send fails,
    and what already waited is coalesced as if it had come held back (one heartbeat a rank,
    not the burst); a server back on the port gets each rank's newest heartbeat."""
    ranks, burst = 3, 50
    first = Collector(ServerState(started=time.time()), lambda: b"{}", port=port)
    relay = Relay(upstream(port), listen, beat_s=1.0).start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(listen)
    try:
        deadline = time.monotonic() + 5
        while relay.stats.batches < 2 and time.monotonic() < deadline:
            first.poll(0.01)  # the second beat has just gone: the next is a second away
        assert relay.stats.batches >= 2
        first.close()
        time.sleep(0.2)  # the relay's connection is gone: its next send fails
        for step in range(burst):
            for rank in range(ranks):
                push.send(_beat(rank, step))
        wait_for(lambda: relay.stats.received == burst * ranks, 0.5, "the burst in the relay")
        assert not relay._held and len(relay._pending) == burst * ranks  # no send tried yet
        wait_for(lambda: relay._held, 2.0, "the relay to find the server gone")
        assert len(relay._pending) == ranks
        assert relay.stats.coalesced == (burst - 1) * ranks

        state = ServerState(started=time.time())
        second = Collector(state, lambda: b"{}", port=port)
        try:
            deadline = time.monotonic() + 5
            while len(state.ranks) < ranks and time.monotonic() < deadline:
                second.poll(0.05)
        finally:
            second.close()
        assert [state.ranks[r].step for r in range(ranks)] == [burst - 1] * ranks
    finally:
        push.close(linger=0)
        relay.stop()


def test_a_relay_reads_the_black_box_of_its_nodes_rank_that_a_signal_ended(
    server: LiveServer, listen: str, tmp_path: Path
) -> None:
    """A server on another host (a laptop watching a cluster) cannot read a rank's black box;
    its node's relay can: rank 1, aborted inside all_reduce #20 (as gloo aborts a rank),
    reaches the server as exited by SIGABRT inside that call, through the relay."""
    name, pid = aborted_box(tmp_path)
    node = Relay(upstream(server.port), listen, beat_s=0.1, host="node-r")
    node.boxes = BoxReader(str(tmp_path), host="node-r")
    node.start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    try:
        push.connect(listen)
        push.send(encode(Hello(v=1, rank=1, t=time.time(), host="node-r", pid=pid, box=name)))
        push.send(encode(Sample(v=1, rank=1, t=time.time(), step=19, phase="forward")))

        def exited(status: dict[str, Any]) -> dict[str, Any] | None:
            ranks = [r for r in status["ranks"] if r["exit_signal"] == "SIGABRT"]
            return ranks[0] if ranks else None

        rank = poll_status(server.server, exited, timeout=15)
        assert (rank["rank"], rank["state"], rank["step"]) == (1, "exited", 19)
        record = server.server.state.ranks[1]
        assert record.final_collective is not None
        assert (record.final_collective.op, record.final_collective.seq) == ("all_reduce", 20)
        assert not (tmp_path / name).exists()  # read once, by the relay
    finally:
        push.close(linger=0)
        node.stop()


def test_a_server_behind_its_relay_leaves_the_superseded_batches_unread(
    port: int, listen: str
) -> None:
    """A real relay's batches queue at a server that does not read for a while; once it
    reads, behind, the batches that the relay's later ones supersede are counted unread
    (``stats.shed``), and each rank's record holds its newest heartbeat."""
    state = ServerState(started=time.time())
    collector = Collector(state, lambda: b"{}", port=port)
    relay = Relay(upstream(port), listen, beat_s=0.1).start()
    push = zmq.Context.instance().socket(zmq.PUSH)
    push.connect(listen)
    try:
        for rank in range(4):  # known ranks, read at once
            push.send(_beat(rank, 0, pid=100 + rank))
        wait_for(lambda: (collector.poll(0.05), len(state.ranks) == 4)[1], 5.0, "the ranks")
        steps = 12
        for step in range(1, steps + 1):  # a batch every beat, the server not reading
            for rank in range(4):
                push.send(_beat(rank, step))
            time.sleep(0.1)
        wait_for(lambda: relay.stats.forwarded >= 4 + 4 * steps, 10.0, "the relay to send all")
        time.sleep(0.3)  # all queued at the server
        collector._behind = True
        wait_for(
            lambda: (collector.poll(0.05), state.received >= 4 + 4 * steps)[1], 10.0, "all in"
        )
        assert state.shed > 0  # superseded batches left unread
        assert all(state.ranks[r].step == steps for r in range(4))
        assert state.received == 4 + 4 * steps and state.rejected == 0
    finally:
        push.close(linger=0)
        relay.stop()
        collector.close()
