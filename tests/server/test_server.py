"""Collector, service and CLI over real ZeroMQ sockets on 127.0.0.1."""

from __future__ import annotations

import gc
import json
import os
import signal
import subprocess
import sys
import threading
import time

import msgspec
import pytest
import zmq
from conftest import ROOT, AppliedState, LiveServer, free_port_pair, published, push_frames

from ddpwatch.cli import fetch_status, format_status, main
from ddpwatch.core.protocol import Collective, ErrorInfo, Event, Sample, encode
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.history import AlertChange, diff_alerts
from ddpwatch.server import collector as collector_module
from ddpwatch.server.collector import RECEIVE_GAP_S, BindError, Collector
from ddpwatch.server.document import status_document
from ddpwatch.state.state import ServerState
from ddpwatch.status.schema import CollectiveWait

RANK_FIELDS = {
    "rank", "local_rank", "world_size", "host", "pid", "device", "device_uuid", "state", "phase",
    "step", "loss", "step_time_s", "mem_allocated_bytes", "mem_reserved_bytes", "gpu_mem_used_bytes",
    "gpu_mem_total_bytes", "collective", "last_seen_s", "stack", "error",
}  # fmt: skip


def sample(rank: int, **fields) -> bytes:
    base = {
        "world_size": 3,
        "host": "node-a",
        "pid": 100 + rank,
        "local_rank": rank,
        "device": "cpu",
    }
    return encode(Sample(v=1, rank=rank, t=time.time(), **{**base, **fields}))


@pytest.fixture
def server(port: int):
    live = LiveServer(port, Thresholds(stall_after=3.0))
    yield live
    live.stop()


def test_status_document_follows_the_contract(server: LiveServer) -> None:
    push_frames(server.port, [sample(0, step=5, loss=0.5), sample(1, step=5, loss=float("nan"))])
    status = server.wait_for(
        lambda s: s if len(s["ranks"]) == 3 and s["stats"]["received"] == 2 else None, 10
    )
    assert status["schema"] == 1 and status["world_size"] == 3
    assert set(status) >= {"schema", "server_time", "world_size", "ranks", "alerts", "stats"}
    assert [r["rank"] for r in status["ranks"]] == [0, 1, 2]
    for rank in status["ranks"]:
        assert set(rank) >= RANK_FIELDS  # every field present, unknown ones null
    assert status["ranks"][2]["state"] == "not_connected" and status["ranks"][2]["host"] is None
    assert status["ranks"][1]["loss"] is None  # NaN is not JSON: null plus a nan_loss alert
    json.dumps(status, allow_nan=False)
    nan = server.wait_for(
        lambda s: next((a for a in s["alerts"] if a["kind"] == "nan_loss"), None), 5
    )
    assert nan["ranks"] == [1]
    for alert in status["alerts"] + [nan]:
        assert set(alert) == {
            "kind",
            "severity",
            "ranks",
            "waiting",
            "message",
            "hint",
            "episode",
            "raised",
        }


def test_bad_frames_are_counted_and_dropped(server: LiveServer) -> None:
    bad = [
        b"",
        b"not msgpack",
        msgspec.msgpack.encode([1, 2]),
        msgspec.msgpack.encode({"v": 2, "type": "sample", "rank": 0, "t": 1.0}),
    ]
    push_frames(server.port, [*bad, sample(0, step=1)])
    status = server.wait_for(
        lambda s: s if s["stats"]["rejected"] == 4 and s["stats"]["received"] == 1 else None, 10
    )
    assert [r["rank"] for r in status["ranks"] if r["state"] != "not_connected"] == [0]
    # multipart messages are not part of the protocol either
    context = zmq.Context.instance()
    sock = context.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://127.0.0.1:{server.port}")
    sock.send_multipart([sample(0), sample(1)])
    sock.close()
    server.wait_for(lambda s: s["stats"]["rejected"] == 5, 10)


def test_status_query_and_cli(server: LiveServer, capsys) -> None:
    push_frames(server.port, [sample(0, step=3), sample(1, step=3), sample(2, step=3)])
    server.wait_for(lambda s: s["stats"]["received"] == 3, 10)
    document = fetch_status("127.0.0.1", server.port, 2.0)
    assert document is not None and len(document.ranks) == 3
    assert main(["status", "--port", str(server.port), "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["world_size"] == 3
    assert main(["status", "--port", str(server.port)]) == 0
    table = capsys.readouterr().out
    assert "node-a" in table and "3/3 ranks" in table


def test_status_without_a_server_fails_in_one_line(capsys, monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("DDPWATCH_RECORD_DIR", str(tmp_path))  # no run recorded: one line
    port = free_port_pair()
    started = time.monotonic()
    assert main(["status", "--port", str(port), "--timeout", "0.5"]) == 1
    assert time.monotonic() - started < 2
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "no server answered" in err


def test_unknown_query_gets_an_error_not_a_hang(server: LiveServer) -> None:
    context = zmq.Context.instance()
    sock = context.socket(zmq.REQ)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{server.port + 1}")
    sock.send(b"drop tables")
    assert sock.poll(2000)
    assert "error" in json.loads(sock.recv())
    sock.close()


def test_second_server_on_the_same_port_gets_a_clear_error(server: LiveServer) -> None:
    with pytest.raises(BindError, match="already in use"):
        Collector(ServerState(started=0.0), lambda: b"", "127.0.0.1", server.port)


def test_restarted_worker_starts_a_fresh_record() -> None:
    state = ServerState(started=0.0)
    state.apply(Sample(v=1, rank=0, t=0, pid=1, step=50), 1.0)
    state.apply(Event(v=1, rank=0, t=0, event="crash", error=ErrorInfo(type="E")), 2.0)
    state.apply(Sample(v=1, rank=0, t=0, pid=2, step=1), 3.0)
    record = state.ranks[0]
    assert record.pid == 2 and record.error is None and record.step == 1
    assert state.attempt == 2 and record.attempt == 2  # its process before had ended


def test_a_launcher_restart_is_a_new_attempt_with_the_last_one_kept() -> None:
    """torchrun --max-restarts 1: rank 1 crashes, torchrun stops ranks 0 and 2 and starts all
    three again (TORCHELASTIC_RESTART_COUNT=1). The new processes start attempt 2 afresh; the
    first attempt's records, a late exit report included, stay as attempt 1."""
    state = ServerState(started=0.0)
    for rank in range(3):
        state.apply(Sample(v=1, rank=rank, t=0, pid=10 + rank, restart_count=0, step=5), 1.0)
    state.apply(Event(v=1, rank=1, t=0, event="crash", error=ErrorInfo(type="RuntimeError")), 2.0)
    state.apply(Event(v=1, rank=0, t=0, event="exit", signal="SIGTERM"), 2.1)
    state.apply(Sample(v=1, rank=0, t=0, pid=20, restart_count=1), 3.0)  # attempt 2 begins
    assert state.attempt == 2 and sorted(state.ranks) == [0]
    state.apply(Event(v=1, rank=2, t=0, event="exit", signal="SIGTERM"), 3.1)  # late, old
    assert sorted(state.ranks) == [0]
    state.apply(Sample(v=1, rank=1, t=0, pid=21, restart_count=1), 3.2)
    state.apply(Sample(v=1, rank=2, t=0, pid=22, restart_count=1), 3.3)
    assert sorted(state.ranks) == [0, 1, 2] and state.attempt == 2
    document = status_document(state, [], 4.0, Thresholds())
    assert document.attempt == 2 and [r.attempt for r in document.ranks] == [2, 2, 2]
    (first,) = document.attempts
    assert (first.attempt, first.started, first.ended) == (1, 1.0, 3.0)
    assert [(r.rank, r.state) for r in first.ranks] == [
        (0, "stopped"),
        (1, "crashed"),
        (2, "stopped"),
    ]
    assert first.ranks[1].ended_at == 2.0 and document.ranks[0].ended_at is None


def test_a_backlog_keeps_each_ranks_order_and_counts_every_frame(port: int) -> None:
    """Under backlog a known rank's heartbeats are coalesced; its events stay in order."""
    state = AppliedState(started=0.0)
    collector = Collector(state, lambda: b"", "127.0.0.1", port)
    try:
        push_frames(port, [sample(0, step=0), sample(1, step=0), sample(2, step=0)])
        deadline = time.monotonic() + 10
        while state.received < 3 and time.monotonic() < deadline:
            collector.poll(0.1)

        def stack(rank: int) -> bytes:
            return encode(Event(v=1, rank=rank, t=time.time(), event="stack", stack="line 9"))

        frames = [sample(0, step=n) for n in range(1, 11)] + [stack(0)]
        frames += [sample(0, step=n) for n in range(11, 21)] + [b"junk"]
        frames += [sample(1, step=6, loss=float("nan")), sample(1, step=7, loss=0.5)]
        frames += [sample(1, step=8, device="cuda:1")]  # identity changes are applied,
        frames += [encode(Sample(v=1, rank=1, t=time.time(), step=9))]  # even if not repeated
        frames += [sample(2, step=n) for n in range(1, 6)] + [stack(2)]
        push_frames(port, frames)
        time.sleep(0.5)  # all queued: one batch
        while state.received + state.rejected < 3 + len(frames) and time.monotonic() < deadline:
            collector.poll(0.1)
    finally:
        collector.close()
    assert (state.received, state.rejected) == (3 + len(frames) - 1, 1)
    rank0, rank1, rank2 = state.ranks[0], state.ranks[1], state.ranks[2]
    assert rank0.step == 20 and rank0.stack is None  # the stack came before steps 11-20
    assert (rank1.step, rank1.device, rank1.host) == (9, "cuda:1", "node-a")
    assert [step for r, step, loss in state.applied if loss != loss] == [6]  # never skipped
    assert rank2.step == 5 and rank2.stack == "line 9"  # after step 5: still stuck there


def test_a_server_that_keeps_up_takes_a_trickle_of_frames_in_few_receives(port: int) -> None:
    """Frames that come one by one (thousands of ranks, each on its own beat) are taken a
    few at a time, not one receive each: a receive has fixed work of its own, which made
    8,192 direct ranks cost the server twice the CPU (``RECEIVE_GAP_S``)."""
    state = ServerState(started=0.0)
    collector = Collector(state, lambda: b"", "127.0.0.1", port)
    sent = 300
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 2000)
    sock.connect(f"tcp://127.0.0.1:{port}")

    def trickle() -> None:
        for n in range(sent):
            sock.send(sample(n % 3, step=n))
            time.sleep(0.001)

    sender = threading.Thread(target=trickle)
    receives, started = 0, time.monotonic()
    try:
        sender.start()
        deadline = started + 20
        while state.received < sent and time.monotonic() < deadline:
            receives += collector.poll(0.1) > 0
        took = time.monotonic() - started
    finally:
        sender.join(10)
        sock.close()
        collector.close()
    assert state.received == sent
    # one receive per RECEIVE_GAP_S at most (with room for a late start), not one per frame
    assert receives <= took / RECEIVE_GAP_S + 5, (receives, took)


def test_a_server_behind_many_ranks_reads_far_enough_to_coalesce(port: int, monkeypatch) -> None:
    """With more ranks than half a receive, a receive of ``RECV_BATCH`` holds no rank twice:
    nothing was coalesced and a server that fell behind at 65,536 ranks stayed behind
    (``benchmarks/scale.py --modes nodes``: 35k of 131k heartbeats/s). Behind, it reads
    ``BEHIND_BEATS`` heartbeats per known rank, applies each rank's newest, counts all."""
    monkeypatch.setattr(collector_module, "RECV_BATCH", 50)  # 120 ranks: more than half
    ranks, beats = 120, 3
    state = ServerState(started=0.0)
    applied: list[int] = []
    apply = state.apply

    def counting_apply(message, now: float) -> None:
        applied.append(message.rank)
        apply(message, now)

    monkeypatch.setattr(state, "apply", counting_apply)
    collector = Collector(state, lambda: b"", "127.0.0.1", port)
    try:
        push_frames(port, [sample(r, step=0, world_size=ranks) for r in range(ranks)])
        deadline = time.monotonic() + 10
        while state.received < ranks and time.monotonic() < deadline:
            collector.poll(0.1)
        applied.clear()
        push_frames(port, [sample(r, step=s) for s in range(1, beats + 1) for r in range(ranks)])
        time.sleep(0.5)  # all queued
        taken = [collector.poll(0.1)]  # not behind yet: RECV_BATCH
        while state.received < ranks * (beats + 1) and time.monotonic() < deadline:
            taken.append(collector.poll(0.1))
    finally:
        collector.close()
    behind = collector_module.BEHIND_BEATS
    # behind: up to BEHIND_BEATS heartbeats per rank (all that is left here, at four)
    assert taken[:2] == [50, min(behind * ranks, ranks * beats - 50)], taken
    assert state.received == ranks * (beats + 1)  # every one counted
    assert len(applied) < ranks * beats  # many superseded within a receive: not applied
    assert all(state.ranks[r].step == beats for r in range(ranks))  # each rank's newest


def test_records_of_many_new_ranks_leave_the_cyclic_collectors_full_passes(
    port: int, monkeypatch
) -> None:
    """A full collection walked every record: 350 ms at 65,536 ranks, landing on a diagnosis
    tick (``benchmarks/scale.py``: live ticks took 0.8-0.9 s of CPU, 0.3 s with records
    frozen). Once ``FREEZE_AFTER_RANKS`` ranks are new, the records are frozen; not before,
    and ``close`` unfreezes them."""
    monkeypatch.setattr(collector_module, "FREEZE_AFTER_RANKS", 40)
    assert gc.isenabled()
    before = gc.get_freeze_count()  # 0, unless a collector of another test was left open
    state = ServerState(started=0.0)
    collector = Collector(state, lambda: b"", "127.0.0.1", port)

    def take(frames: list[bytes], total: int) -> None:
        push_frames(port, frames)
        deadline = time.monotonic() + 10
        while state.received < total and time.monotonic() < deadline:
            collector.poll(0.1)

    try:
        take([sample(r, world_size=64) for r in range(39)], 39)
        assert gc.get_freeze_count() == before  # 39 new ranks: not yet
        take([sample(39, world_size=64)], 40)
        frozen = gc.get_freeze_count()
        tracked = {id(o) for o in gc.get_objects()}
        assert not any(id(record) in tracked for record in state.ranks.values())
        take([sample(r, world_size=64) for r in range(40, 60)], 60)  # 20 more: not yet
        # no new freeze (a frozen object that dies by its refcount lowers the count: one
        # another test of this worker left frozen)
        assert gc.get_freeze_count() <= frozen
        assert id(state.ranks[59]) in {id(o) for o in gc.get_objects()}
    finally:
        collector.close()
    assert frozen >= before + 40 and gc.get_freeze_count() == 0


def test_a_query_is_answered_within_a_long_receive(port: int, monkeypatch) -> None:
    """Behind at 65,536 ranks a receive lasts a second; the dashboard waits one for its
    summary. A query that comes meanwhile is answered every ``ANSWER_EVERY`` heartbeats
    (``benchmarks/scale.py``: summaries took 1.8-4.8 s without, behind such receives)."""
    monkeypatch.setattr(collector_module, "ANSWER_EVERY", 100)
    state = ServerState(started=0.0)
    seen_at_answer: list[int] = []

    def reply(request: bytes) -> bytes:
        seen_at_answer.append(state.received)
        return b"{}"

    collector = Collector(state, lambda: b"{}", "127.0.0.1", port, query=reply)
    frames = [sample(n % 10, step=n) for n in range(1_000)]
    client = zmq.Context.instance().socket(zmq.REQ)
    client.setsockopt(zmq.LINGER, 0)
    client.setsockopt(zmq.RCVTIMEO, 5000)
    client.connect(f"tcp://127.0.0.1:{port + 1}")
    try:
        push_frames(port, frames)
        client.send(b"status?view=summary")
        time.sleep(0.5)  # all queued, and the query
        collector.poll(0.1)  # one receive takes the 1,000 (RECV_BATCH) and answers
        assert client.recv() == b"{}"
    finally:
        client.close()
        collector.close()
    assert state.received == len(frames)
    assert seen_at_answer and seen_at_answer[0] < len(frames)  # during the receive


def test_a_heartbeat_without_identity_keeps_the_last_one_told() -> None:
    state = ServerState(started=0.0)
    state.apply(Sample(v=1, rank=0, t=0, pid=7, host="a", device="cuda:0", simulated=True), 1.0)
    state.apply(Sample(v=1, rank=0, t=0, step=3), 2.0)  # identity not repeated
    record = state.ranks[0]
    assert (record.pid, record.host, record.device, record.simulated, record.step) == (
        7, "a", "cuda:0", True, 3,
    )  # fmt: skip
    state.apply(Sample(v=1, rank=0, t=0, pid=7, host="a", device="cuda:1", step=4), 3.0)
    assert state.ranks[0].device == "cuda:1" and state.ranks[0] is record


def test_collective_age_grows_between_samples() -> None:
    state = ServerState(started=0.0)
    state.apply(
        Sample(v=1, rank=0, t=0, step=1, collective=Collective(op="barrier", seq=3, since_s=2.0)),
        10.0,
    )
    assert state.ranks[0].collective_age(12.5) == pytest.approx(4.5)
    doc = status_document(state, [], 12.5, Thresholds())
    assert doc.ranks[0].collective == CollectiveWait(op="barrier", seq=3, since_s=4.5)


def test_alert_diff_raises_and_clears_by_kind_and_culprits() -> None:
    from ddpwatch.diagnosis.alerts import Alert

    a = Alert("straggler", "warning", (1,), (0,), "m", "h")
    a2 = Alert("straggler", "warning", (1,), (0, 2), "m2", "h")
    a3 = Alert("straggler", "error", (1,), (0, 2), "m3", "h")
    b = Alert("silent", "error", (2,), (), "m", "h")
    assert diff_alerts({}, [a]) == [AlertChange("raised", a)]
    assert diff_alerts({a.key: a}, [a2]) == []  # same alert, updated numbers
    assert diff_alerts({a.key: a}, [a3]) == [AlertChange("escalated", a3, previous=a)]
    assert diff_alerts({a3.key: a3}, [a2]) == []  # calmer again: no event
    assert diff_alerts({a.key: a}, [b]) == [AlertChange("cleared", a), AlertChange("raised", b)]


def test_serve_headless_prints_alert_lines_and_exits_on_sigterm() -> None:
    port = free_port_pair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(port), "--silent-after", "1"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    try:
        assert proc.stderr is not None and proc.stdout is not None
        said = ""
        while "listening" not in said:  # its port is bound: frames pushed now land
            said = proc.stderr.readline()
            assert said, "serve ended before it listened"
        push_frames(port, [sample(0, step=1), sample(1, step=1), sample(2, step=1)])
        line = proc.stdout.readline()  # all three go silent after 1 s
        change = published("change", json.loads(line))  # the stream's contract
        assert change["event"] == "raised" and change["alert"]["kind"] == "silent"
    finally:
        proc.send_signal(signal.SIGTERM)
        proc.communicate(timeout=10)
    assert proc.returncode == 0


def test_serve_reports_a_taken_port_in_one_line(server: LiveServer) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(server.port)],
        capture_output=True, text=True, timeout=30, env={**os.environ},
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stderr.strip().count("\n") == 0 and "already in use" in result.stderr


def test_format_status_handles_missing_values() -> None:
    state = ServerState(started=0.0)
    state.apply(Sample(v=1, rank=1, t=0, world_size=2), 1.0)
    text = format_status(status_document(state, [], 1.0, Thresholds()))
    assert "not_connected" in text and "1/2 ranks" in text


def test_the_server_side_needs_no_torch() -> None:
    """A laptop with `pip install ddpwatch` (no torch) can watch a cluster."""
    code = (
        "import sys; sys.modules['torch'] = None\n"
        "import ddpwatch.server.service, ddpwatch.server.replay, ddpwatch.outputs.prometheus\n"
        "import ddpwatch.tui.app, ddpwatch.commands.web, ddpwatch.demo.runner\n"
        "from ddpwatch.cli import main\n"
        f"sys.exit(main(['status', '--port', '{free_port_pair()}', '--timeout', '0.3']))\n"
    )
    result = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, timeout=60
    )
    assert result.returncode == 1, result.stderr  # ran, found no server, said so
    assert "no server answered" in result.stderr


def test_the_collector_queues_a_connect_storm(port: int) -> None:
    """Thousands of relays or ranks connect at a job's start: ZeroMQ's default listen backlog
    (100) dropped their connects, retried seconds later (``CONNECT_BACKLOG``)."""
    collector = Collector(ServerState(started=0.0), lambda: b"", "127.0.0.1", port)
    try:
        assert collector._pull.getsockopt(zmq.BACKLOG) == collector_module.CONNECT_BACKLOG
        assert collector_module.CONNECT_BACKLOG >= 4096
    finally:
        collector.close()
