"""Silence is evidence only where the server listened.

A rank is called silent when the server heard nothing from it for a while. That is only
evidence if the server was reading all along: a server behind its queue (ranks' heartbeats
wait unread, senders drop them once their queues fill), a server that was not running
(a suspended laptop, SIGSTOP, a starved host), a relay holding frames for its beat, and a
rank whose heartbeat thread waits for the GIL while it starts all make healthy ranks look
silent. Measured before these tests: a server 10 s behind named 15,535 healthy ranks silent
(``benchmarks/scale.py`` at 32,768 ranks), and under a load average above 4 the data-loader
failure mode (PyTorch #8976) first named ranks 1, 0-2, 0 and 2 silent while they were
building DDP.
"""

from __future__ import annotations

import json
import math
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

import pytest
import zmq
from conftest import ROOT, free_port_pair, push_frames

from ddpwatch.core.protocol import Collective, CollectiveCounts, Sample, encode
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts.ranks import rank_state
from ddpwatch.diagnosis.rules import diagnose
from ddpwatch.server.collector import (
    LISTEN_AFRESH_S,
    PAUSE_S,
    RECV_BATCH,
    Collector,
    PauseWatch,
)
from ddpwatch.server.document import status_document
from ddpwatch.state.state import ServerState

TH = Thresholds()  # silent after 2.5 s; 15 s while a rank starts


def job(last_seen: dict[int, float], *, phase: str = "train", step: int | None = 7) -> ServerState:
    """Three ranks of one job, each last heard at ``last_seen[rank]``."""
    state = ServerState(started=0.0)
    for rank, seen in last_seen.items():
        state.apply(
            Sample(v=1, rank=rank, t=0.0, pid=100 + rank, world_size=3, phase=phase, step=step),
            seen,
        )
    return state


def silent_culprits(state: ServerState, now: float) -> list[tuple[int, ...]]:
    return [a.ranks for a in diagnose(state, now, TH) if a.kind == "silent"]


# --- a server behind its queue ---------------------------------------------------------------


def test_a_server_behind_its_queue_judges_ranks_as_of_what_it_has_read() -> None:
    """Last caught up at 10.2 s and still reading: ranks 0 and 1 were fine then, rank 2 had
    been quiet since 5 s. Only rank 2 is named, however late the clock is."""
    state = job({0: 10.0, 1: 10.1, 2: 5.0})
    state.heard_until = 10.2
    assert silent_culprits(state, 30.0) == [(2,)]
    document = status_document(state, [], 30.0, TH)
    assert [r.state for r in document.ranks] == ["running", "running", "silent"]
    assert document.stats.lag_s == pytest.approx(19.8)
    # and it says why it is quiet: a warning naming no one
    behind = [a for a in diagnose(state, 30.0, TH) if a.kind == "server_behind"]
    assert [(a.severity, a.ranks) for a in behind] == [("warning", ())]
    assert "19.8 s" in behind[0].message
    assert not [a for a in diagnose(state, 12.0, TH) if a.kind == "server_behind"]  # 1.8 s
    # without the horizon the same state names everyone
    state.heard_until = None
    assert silent_culprits(state, 30.0) != [(2,)]


def test_a_failing_or_stopped_collector_is_named_in_server_behind() -> None:
    """A collector whose polls raise is behind with a reason: the warning names it, not the
    load. One whose thread stopped is an error at once, with when live data stopped."""
    state = job({0: 10.0, 1: 10.1, 2: 10.0})
    state.heard_until = 10.2
    state.collector_failure = "KeyError: 1 (server/ingest.py, line 223, in _take)"
    assert not [a for a in diagnose(state, 12.0, TH) if a.kind == "server_behind"]
    (failing,) = [a for a in diagnose(state, 30.0, TH) if a.kind == "server_behind"]
    assert failing.severity == "warning"
    assert "its collector fails (KeyError: 1 (server/ingest.py" in failing.message
    state.collector_stopped = 10.5
    for now in (10.6, 30.0):  # at once, and on
        (stopped,) = [a for a in diagnose(state, now, TH) if a.kind == "server_behind"]
        assert stopped.severity == "error" and stopped.ranks == ()
        stopped_at = time.strftime("%H:%M:%S", time.localtime(10.2))
        assert stopped.message.startswith(
            f"the collector stopped: KeyError: 1 (server/ingest.py, line 223, in _take); "
            f"live data stopped at {stopped_at} ("
        )


def test_silence_counts_afresh_once_the_server_listens_again() -> None:
    """After a backlog or a pause (listening since 20 s) no rank is silent for a full
    threshold, then the quiet one is."""
    state = job({0: 10.0, 1: 10.0, 2: 10.0})
    state.listening_since = 20.0
    for rank in (0, 1):
        state.apply(Sample(v=1, rank=rank, t=0.0, step=8), 21.8)
    assert silent_culprits(state, 22.0) == []
    assert rank_state(state.ranks[2], 22.0, TH, 10.0, since=20.0) == "running"
    for rank in (0, 1):
        state.apply(Sample(v=1, rank=rank, t=0.0, step=9), 22.4)
    assert silent_culprits(state, 22.6) == [(2,)]


def test_a_stall_is_not_counted_across_a_pause_either() -> None:
    """A laptop asleep for an hour: on waking, no rank made progress 'for an hour'."""
    state = job({0: 10.0, 1: 10.0, 2: 10.0})
    state.listening_since = 3610.0
    for rank in (0, 1, 2):
        state.apply(Sample(v=1, rank=rank, t=0.0, step=7), 3610.1)  # same step as before
    alerts = diagnose(state, 3610.3, TH)
    assert [a.kind for a in alerts if a.ranks] == []


def straggle_job(reports: dict[int, tuple[float, int, float | None]]) -> ServerState:
    """Four lockstep ranks, each last read at ``reports[rank]``: (read at, collectives entered,
    how long it said it had waited in all-reduce #51 then, None: in none)."""
    state = ServerState(started=0.0)
    for rank, (read_at, entered, waited) in reports.items():
        state.apply(Sample(v=1, rank=rank, t=0.0, pid=100 + rank, world_size=4, step=40), 1.0)
        collective = None
        if waited is not None:
            collective = Collective(op="all_reduce", seq=51, since_s=waited, source="py")
        sample = Sample(
            v=1, rank=rank, t=0.0, step=50, step_time_s=0.25, avg_step_time_s=0.25,
            collective=collective, collectives=CollectiveCounts(py=entered),
        )  # fmt: skip
        state.apply(sample, read_at)
    return state


def test_a_server_behind_names_no_straggler_on_a_report_sent_before_the_wait() -> None:
    """``benchmarks/scale.py``, 65,536 ranks for 60 s through per-node relays, on a server
    short of CPU: rank 55,517 stopped before all-reduce #51 at 100 s; the server, last caught
    up at 100.2 s, then read some nodes' backlogs further than others'. Rank 2's heartbeat
    from 99.7 s, before it entered #51, came in at 111.8 s among reports of ranks waiting
    there for 11 s, and 57,928 such ranks were named stragglers. Only a report sent after
    the first rank entered #51 says a rank has not, and its arrival does not date it."""
    state = straggle_job(
        {
            0: (111.5, 51, 11.3),  # in #51 since 100.2 s, as it said at 111.5 s
            1: (111.6, 51, 11.1),
            2: (111.8, 50, None),  # sent at 99.7 s, before it entered #51: read late
            3: (100.1, 50, None),  # the straggler, read before the horizon
        }
    )
    state.heard_until = 100.2
    assert [a.ranks for a in diagnose(state, 112.0, TH) if a.ranks] == []
    # caught up: rank 2's later reports are in, in #51 with the others, and rank 3's report
    # of 112.9 s, long after the others entered, says it has not
    in_51 = Collective(op="all_reduce", seq=51, since_s=12.6, source="py")
    rank_2 = Sample(
        v=1, rank=2, t=0.0, step=50, collective=in_51, collectives=CollectiveCounts(py=51)
    )
    state.apply(rank_2, 112.8)
    state.apply(Sample(v=1, rank=3, t=0.0, step=50, collectives=CollectiveCounts(py=50)), 112.9)
    state.heard_until = 113.0
    straggler = [a for a in diagnose(state, 113.0, TH) if a.kind == "straggler"]
    assert [a.ranks for a in straggler] == [(3,)]


# --- a rank still starting, a rank behind a relay ---------------------------------------------


def test_a_rank_still_starting_gets_the_startup_threshold() -> None:
    """In model_wrap with no step yet, a heartbeat thread starved for 10 s (seen on a
    loaded host) is not a culprit; 15 s is."""
    state = job({0: 19.9, 1: 19.9, 2: 10.0}, phase="model_wrap", step=None)
    assert silent_culprits(state, 20.0) == []
    for rank in (0, 1):
        state.apply(Sample(v=1, rank=rank, t=0.0), 25.9)
    assert silent_culprits(state, 26.0) == [(2,)]


def test_the_startup_grace_ends_once_a_peer_steps() -> None:
    """#26's regression: a rank SIGKILLed at step 12, in the job's first second, before any
    heartbeat of its carried a step, was named silent only after 15 s, "before its first
    step", while its peers had been in step collectives for seconds. Once a peer reports a
    step, the short threshold holds, and the message does not claim it never stepped."""
    state = job({0: 10.0, 1: 10.0, 2: 10.0}, phase="first_step", step=None)
    for t in (10.5, 11.0, 11.5, 12.0, 12.5, 13.0):
        for rank in (0, 1):
            state.apply(Sample(v=1, rank=rank, t=0.0, phase="train", step=int(t * 10)), t)
    assert silent_culprits(state, 13.0) == [(2,)]  # 3 s unheard: not 15
    (alert,) = [a for a in diagnose(state, 13.0, TH) if a.kind == "silent"]
    assert "before it reported a step" in alert.message, alert.message
    assert rank_state(state.ranks[2], 13.0, TH, 10.0, stepping=True) == "silent"
    assert status_document(state, [], 13.0, TH).ranks[2].state == "silent"


def test_a_training_rank_keeps_the_short_threshold() -> None:
    state = job({0: 12.9, 1: 12.9, 2: 10.0})
    assert silent_culprits(state, 13.0) == [(2,)]


def test_a_relayed_rank_gets_its_relays_beat_on_top() -> None:
    """A relay sends one batch per 0.5 s beat: its ranks' frames come up to 0.5 s later."""
    state = job({0: 12.6, 1: 12.6, 2: 10.0})
    for record in state.ranks.values():
        record.relayed = True
    assert silent_culprits(state, 12.7) == []  # 2.7 s: within 2.5 + 0.5
    for rank in (0, 1):
        state.apply(Sample(v=1, rank=rank, t=0.0, step=8), 13.0)
        state.ranks[rank].relayed = True
    assert silent_culprits(state, 13.1) == [(2,)]


# --- the collector: where its view is complete ----------------------------------------------


def test_the_collector_moves_its_horizon_only_when_it_has_read_everything(port: int) -> None:
    state = ServerState(started=0.0)
    collector = Collector(state, lambda: b"", "127.0.0.1", port)
    try:
        collector.poll(0.05)
        first = state.heard_until
        assert first is not None and abs(first - time.time()) < 1.0  # nothing queued: complete
        frame = encode(Sample(v=1, rank=0, t=0.0, step=1))
        push_frames(port, [frame] * (RECV_BATCH + 5_000))
        deadline = time.monotonic() + 20
        while state.received == 0 and time.monotonic() < deadline:
            time.sleep(0.2)  # let ZeroMQ queue them all
            collector.poll(0.0)
        assert 0 < state.received <= RECV_BATCH  # one call's worth: more wait in the queue
        assert state.heard_until == first and state.listening_since == -math.inf
        while state.received < RECV_BATCH + 5_000 and time.monotonic() < deadline:
            collector.poll(0.1)
        collector.poll(0.0)
    finally:
        collector.close()
    assert state.received == RECV_BATCH + 5_000
    assert state.heard_until is not None and state.heard_until > first
    # behind for well under LISTEN_AFRESH_S: no sender dropped a thing, silence counts on
    assert state.listening_since == -math.inf


def test_silence_counts_afresh_after_a_backlog_long_enough_to_lose_heartbeats(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind for ``LISTEN_AFRESH_S`` or more, senders may have dropped heartbeats: silence
    counts from the catch-up. Behind for less, it does not (``scale.py --node-fault dies`` at
    32,768 ranks: a server briefly behind several times a second never named a dead node)."""
    clock = [1000.0]
    state = ServerState(started=clock[0])
    collector = Collector(state, lambda: b"", "127.0.0.1", port, clock=lambda: clock[0])
    monkeypatch.setattr(collector._pauses, "paused", lambda idle_s: False)  # a loaded host's
    try:
        collector.poll(0.05)
        assert state.heard_until == 1000.0
        frame = encode(Sample(v=1, rank=0, t=0.0, step=1))
        for backlog_s, afresh in ((LISTEN_AFRESH_S - 1.0, False), (LISTEN_AFRESH_S, True)):
            push_frames(port, [frame] * (RECV_BATCH + 5_000))
            expected, deadline = state.received + RECV_BATCH + 5_000, time.monotonic() + 20
            time.sleep(0.2)  # let ZeroMQ queue them all
            while state.received + 5_000 < expected and time.monotonic() < deadline:
                collector.poll(0.1)  # behind: one receive's worth taken, more queued
            assert state.received < expected  # the rest waits in the queue
            clock[0] += backlog_s
            while state.received < expected and time.monotonic() < deadline:
                collector.poll(0.1)
            collector.poll(0.0)
            assert state.heard_until == clock[0]
            assert (state.listening_since == clock[0]) == afresh, (backlog_s, state)
    finally:
        collector.close()


def test_pause_watch_tells_a_pause_from_work_and_from_waiting() -> None:
    watch = PauseWatch()
    time.sleep(1.3)  # neither CPU nor a wait the server asked for: a pause
    assert watch.paused(idle_s=0.0)
    time.sleep(1.3)
    assert not watch.paused(idle_s=1.3)  # the same time, asked for
    wall, cpu = time.time(), time.process_time()
    while time.process_time() < cpu + 1.3:  # busy longer than PAUSE_S: work, not a pause
        pass
    starved = (time.time() - wall) - (time.process_time() - cpu)  # waiting for a core
    # on a loaded host, time spent waiting for a core is a pause too (by design)
    assert watch.paused(idle_s=0.0) == (starved > PAUSE_S)


# --- a real server, stopped and continued -----------------------------------------------------


@pytest.fixture
def headless() -> Iterator[tuple[subprocess.Popen[str], int]]:
    port = free_port_pair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(port)],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, cwd=ROOT,
    )  # fmt: skip
    yield proc, port
    if proc.poll() is None:
        os.kill(proc.pid, signal.SIGCONT)
        proc.send_signal(signal.SIGTERM)
    proc.communicate(timeout=10)


def heartbeats(port: int, ranks: dict[int, threading.Event], stop: threading.Event) -> None:
    """Ranks at 2 Hz, each until its event is set."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    step = 0
    while not stop.is_set():
        step += 1
        for rank, dead in ranks.items():
            if not dead.is_set():
                sample = Sample(v=1, rank=rank, t=time.time(), pid=100 + rank, world_size=3,
                                host="node-a", phase="train", step=step)  # fmt: skip
                sock.send(encode(sample), zmq.NOBLOCK)
        stop.wait(0.5)
    sock.close()


def test_a_server_stopped_for_seconds_names_no_one_then_the_rank_that_died(
    headless: tuple[subprocess.Popen[str], int],
) -> None:
    """SIGSTOP the server for 4 s while three ranks train: on SIGCONT it must not call them
    silent (their heartbeats of those 4 s are still on their way in). Then rank 2 really
    stops: it alone is named."""
    proc, port = headless
    dead = {rank: threading.Event() for rank in range(3)}
    stop = threading.Event()
    sender = threading.Thread(target=heartbeats, args=(port, dead, stop), daemon=True)
    sender.start()
    try:
        time.sleep(2.0)  # connected and running
        os.kill(proc.pid, signal.SIGSTOP)
        time.sleep(4.0)
        os.kill(proc.pid, signal.SIGCONT)
        time.sleep(3.0)  # long past the 2.5 s threshold, had the pause counted
        dead[2].set()
        assert proc.stdout is not None
        change = json.loads(proc.stdout.readline())  # the first alert it ever raised
    finally:
        stop.set()
        sender.join(5)
    assert change["event"] == "raised"
    assert (change["alert"]["kind"], change["alert"]["ranks"]) == ("silent", [2])
