"""The agent in one process: API, hooks, collectives, publisher, against a real collector."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist
from conftest import free_port_pair

import ddpwatch
from ddpwatch.agent.collectives import ensure_flight_recorder
from ddpwatch.agent.hooks import find_loss
from ddpwatch.agent.progress import LossReader, Progress
from ddpwatch.agent.publisher import BEAT_TRIES, QUEUE_LEN, Publisher
from ddpwatch.agent.watcher import Watcher, main_thread_stack
from ddpwatch.core.ports import resolve_endpoint
from ddpwatch.core.protocol import Event, Sample
from ddpwatch.server.collector import Collector
from ddpwatch.state.state import ServerState


class Receiver:
    """A real collector on a thread, folding what arrives into a ServerState."""

    def __init__(self, port: int) -> None:
        self.state = ServerState(started=time.time())
        self.lock = threading.Lock()
        self.collector = Collector(self.state, lambda: b"{}", "127.0.0.1", port)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.collector.poll(0.05, self.lock)

    def wait_for(self, predicate, timeout: float = 10.0):
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self.lock:
                found = predicate(self.state)
            if found:
                return found
            time.sleep(0.05)
        raise AssertionError(f"timed out; ranks: {self.state.ranks}")

    def close(self) -> None:
        self._stop.set()
        self._thread.join(2)
        self.collector.close()


@pytest.fixture
def receiver():
    rec = Receiver(free_port_pair())
    yield rec
    rec.close()


@pytest.fixture
def rank_env(monkeypatch):
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("LOCAL_RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")
    yield
    ddpwatch.detach()


def test_resolve_endpoint_order() -> None:
    assert resolve_endpoint("node1:7000", {}) == "tcp://node1:7000"
    assert resolve_endpoint("node1", {}) == "tcp://node1:5599"
    assert (
        resolve_endpoint(None, {"DDPWATCH_ADDR": "10.0.0.5:6000", "MASTER_ADDR": "x"})
        == "tcp://10.0.0.5:6000"
    )
    assert resolve_endpoint(None, {"MASTER_ADDR": "master"}) == "tcp://master:5599"
    assert resolve_endpoint(None, {}) == "tcp://127.0.0.1:5599"
    assert resolve_endpoint("tcp://h:1", {}) == "tcp://h:1"


def test_module_api_is_a_no_op_without_a_watcher() -> None:
    ddpwatch.detach()
    assert ddpwatch.current() is None
    ddpwatch.step(1.0)
    with ddpwatch.phase("eval"):
        pass
    ddpwatch.detach()


def test_attach_is_idempotent_and_detach_restores_everything(receiver: Receiver, rank_env) -> None:
    original_all_reduce = dist.all_reduce
    original_init = dist.init_process_group
    original_hook = sys.excepthook
    model = torch.nn.Linear(2, 1)
    watcher = ddpwatch.attach(model, addr=f"127.0.0.1:{receiver.collector.port}")
    assert watcher is not None
    assert ddpwatch.attach(torch.nn.Linear(2, 2)) is watcher
    assert dist.all_reduce is not original_all_reduce
    assert sys.excepthook is not original_hook
    ddpwatch.detach()
    assert dist.all_reduce is original_all_reduce
    assert dist.init_process_group is original_init
    assert sys.excepthook is original_hook
    assert not model._forward_hooks and not model._forward_pre_hooks
    assert not watcher.publisher.alive


def test_steps_loss_and_phase_reach_the_server(receiver: Receiver, rank_env) -> None:
    ddpwatch.attach(addr=f"127.0.0.1:{receiver.collector.port}", interval=0.1)
    for i in range(5):
        ddpwatch.step(torch.tensor(float(i)))
        time.sleep(0.01)

    def eval_sample(state: ServerState):
        record = state.ranks.get(0)
        # wait for a heartbeat in "eval": the phase event carries the step (5) but no loss,
        # and the record keeps the loss of the last heartbeat, which may have come between
        # steps 1 and 2 (seen under load: step 5 from the event beside step 1's loss 0.0).
        # A heartbeat received after the phase change (a later receive) read the step again
        done = record and record.phase == "eval" and record.step == 5
        heard = done and record.sample_seen is not None and record.phase_since is not None
        return record if heard and record.sample_seen > record.phase_since else None

    with ddpwatch.phase("eval"):
        record = receiver.wait_for(eval_sample)
    assert record.step == 5
    assert record.loss == 4.0
    assert record.host and record.pid == os.getpid() and record.device == "cpu"
    assert record.step_time_s is not None and record.avg_step_time_s is not None
    receiver.wait_for(lambda s: s.ranks[0].phase == "train")


def test_a_sample_never_pairs_a_step_with_an_earlier_steps_loss(
    rank_env, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The training thread may end steps while a heartbeat is built (the memory reads take
    long enough under load): the sample's step is read before its loss, so it is never newer
    than the loss (a loss is in the ring before its step is counted)."""
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{free_port_pair()}", interval=60.0)
    assert watcher is not None
    ddpwatch.step(torch.tensor(0.0))
    read_memory = watcher._host_memory
    steps = iter([range(1, 5)])

    def steps_end_meanwhile():
        for i in next(steps, ()):  # once: steps 2 to 5 end while the first sample is built
            ddpwatch.step(torch.tensor(float(i)))
        return read_memory()

    with watcher._beat_lock:  # not beside the publisher's own first beat
        # patched under the lock: a publisher's first beat late under load would run the
        # steps itself, before the sample this test builds
        monkeypatch.setattr(watcher, "_host_memory", steps_end_meanwhile)
        first = watcher._sample()
        second = watcher._sample()
    assert first is not None and second is not None
    assert (first.step, first.loss) == (1, 0.0)
    assert (second.step, second.loss) == (5, 4.0)


def test_steps_counted_from_optimizer_then_forward(receiver: Receiver, rank_env) -> None:
    model = torch.nn.Linear(3, 1)
    watcher = ddpwatch.attach(model, addr=f"127.0.0.1:{receiver.collector.port}")
    model(torch.randn(2, 3))
    assert watcher.progress.step == 1 and watcher.progress.step_mode == "forward"
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    for _ in range(3):
        model(torch.randn(2, 3)).sum().backward()
        optimizer.step()
    # optimizer steps take over from forward counting without double counting
    assert watcher.progress.step_mode == "optimizer"
    assert watcher.progress.step == 4
    ddpwatch.step()  # ends the step optimizer.step() counted: the user's step 4 is step 4
    assert watcher.progress.step_mode == "explicit" and watcher.progress.step == 4
    model(torch.randn(2, 3))
    optimizer.step()
    assert watcher.progress.step == 4  # hooks no longer count once step() is used
    ddpwatch.step()
    assert watcher.progress.step == 5


def test_loss_found_in_model_output() -> None:
    scalar = torch.tensor(2.0)
    assert find_loss(scalar) is scalar
    assert find_loss({"loss": scalar, "logits": torch.ones(3)}) is scalar
    assert find_loss(type("Out", (), {"loss": scalar})()) is scalar
    assert find_loss(torch.ones(3)) is None
    assert find_loss((scalar,)) is None


def test_loss_reader_cpu_and_python_values() -> None:
    reader = LossReader()
    assert reader.poll() is None
    reader.submit(torch.tensor(1.5))
    assert reader.poll() == 1.5
    reader.submit(2)
    assert reader.poll() == 2.0
    reader.submit(torch.ones(3))  # not a scalar: ignored, last value kept
    assert reader.poll() == 2.0
    reader.submit(torch.tensor(float("nan")))
    value = reader.poll()
    assert value != value  # NaN is reported, not hidden


def test_collective_wrappers_time_and_name_the_op(receiver: Receiver, rank_env) -> None:
    port = free_port_pair()
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{receiver.collector.port}")
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        assert watcher.identity.world_size == 1 and watcher.identity.backend == "gloo"
        progress = watcher.progress
        assert getattr(dist.all_reduce, "__ddpwatch__", False)
        progress.enter_collective("all_reduce")
        in_flight = progress.in_flight()
        progress.exit_collective()
        assert in_flight is not None and in_flight.op == "all_reduce" and in_flight.seq == 1
        dist.all_reduce(torch.ones(1))
        dist.barrier()
        ddpwatch.step()
        assert progress.collective_seq == 3
        assert progress.collective_op is None
        assert progress.collective_time_s is not None and progress.collective_time_s >= 0
        record = receiver.wait_for(
            lambda s: s.ranks.get(0) if s.ranks.get(0) and s.ranks[0].phase == "train" else None
        )
        assert record.backend == "gloo"
    finally:
        dist.destroy_process_group()


def test_a_wrapped_collective_adds_one_self_explaining_frame_to_tracebacks() -> None:
    """Every user traceback through a collective shows ddpwatch's frame: its name and its
    line must say it only passes the call on; the failure still reaches Progress."""
    import traceback
    from types import SimpleNamespace

    from ddpwatch.agent.collectives import CollectiveWrappers

    def all_reduce(tensor: object, group: object = None) -> None:
        raise RuntimeError("Connection closed by peer")

    fake_dist = SimpleNamespace(all_reduce=all_reduce, group=SimpleNamespace(WORLD=None))
    progress = Progress()
    CollectiveWrappers(progress).install(fake_dist)
    assert fake_dist.all_reduce.__name__ == "all_reduce"  # functools.wraps: still torch's name
    with pytest.raises(RuntimeError) as caught:
        fake_dist.all_reduce("t")
    package = os.path.dirname(ddpwatch.__file__)
    frames = [
        f
        for f in traceback.extract_tb(caught.value.__traceback__)
        if f.filename.startswith(package)
    ]
    assert [(f.name, f.line) for f in frames] == [
        (
            "ddpwatch_passthrough",
            "return torch_collective(*args, **kwargs)  # ddpwatch only records the call",
        )
    ]
    failed = progress.failed_collective
    assert failed is not None and failed.op == "all_reduce" and progress.collective_depth == 0
    fake_dist.barrier = lambda group=None: "done"
    CollectiveWrappers(progress).install(fake_dist)
    assert fake_dist.barrier() == "done" and progress.collective_seq == 2
    assert progress.collective_depth == 0 and progress.collective_op is None


def test_flight_recorder_reads_entries_only_for_a_collective_that_stays_pending() -> None:
    import json

    from ddpwatch.agent.collectives import FlightRecorder

    status = {"0": {"last_completed_collective": "4", "last_enqueued_collective": "6"}}
    entry = {"collective_seq_id": 5, "profiling_name": "gloo:all_reduce", "process_group": ["0", "default_pg"],
             "time_created_ns": (time.time() - 7.0) * 1e9, "state": "scheduled"}  # fmt: skip
    full_reads: list[int] = []

    def dump(include_collectives: bool, only_active: bool) -> bytes:
        if include_collectives:
            full_reads.append(1)
            return json.dumps({"entries": [entry], "pg_status": status}).encode()
        return json.dumps({"pg_status": status}).encode()

    recorder = FlightRecorder()
    recorder._dump = dump
    assert recorder.read()[0] is None  # first sight: may complete any moment
    found = recorder.read()[0]  # still pending a heartbeat later
    assert found is not None and (found.op, found.seq) == ("all_reduce", 5)
    assert found.since_s == pytest.approx(7.0, abs=0.5)
    assert recorder.read()[0] is not None
    assert full_reads == [1]  # the entries were read once for this collective
    status["0"]["last_completed_collective"] = "6"
    assert recorder.read()[0] is None


def test_first_pending_prefers_the_default_group() -> None:
    from ddpwatch.agent.collectives import first_pending

    assert (
        first_pending({"0": {"last_completed_collective": "9", "last_enqueued_collective": "9"}})
        is None
    )
    assert first_pending({
        "3": {"last_completed_collective": "1", "last_enqueued_collective": "2"},
        "0": {"last_completed_collective": "9", "last_enqueued_collective": "10"},
    }) == ("0", 10)  # fmt: skip
    assert first_pending(
        {"3": {"last_completed_collective": "1", "last_enqueued_collective": "2"}}
    ) == ("3", 2)
    assert first_pending({"0": {"last_completed_collective": "x"}}) is None
    # a subgroup's first collective still pending: sequence numbers start at 1, and a
    # group with none completed says -1 (seen with torch 2.13)
    assert first_pending(
        {"1": {"last_completed_collective": "-1", "last_enqueued_collective": "1"}}
    ) == ("1", 1)


def test_flight_recorder_defaults_follow_the_users_choice(caplog) -> None:
    env: dict[str, str] = {}
    ensure_flight_recorder("2.5.1", env)
    assert env == {"TORCH_FR_BUFFER_SIZE": "2000"}
    env = {}
    ensure_flight_recorder("2.13.0+cpu", env)
    assert env == {}  # on by default there
    env = {"TORCH_FR_BUFFER_SIZE": "0"}
    with caplog.at_level("WARNING", logger="ddpwatch"):
        ensure_flight_recorder("2.5.1", env)
    assert env == {"TORCH_FR_BUFFER_SIZE": "0"}  # never overrides the user
    assert "disables the flight recorder" in caplog.text


def test_main_thread_stack_while_it_waits() -> None:
    ready = threading.Event()
    stacks: list[str | None] = []

    def grab() -> None:
        ready.wait()
        time.sleep(0.1)
        stacks.append(main_thread_stack(threading.main_thread().ident))

    thread = threading.Thread(target=grab)
    thread.start()
    ready.set()
    time.sleep(0.3)
    thread.join()
    assert stacks[0] is not None and "test_main_thread_stack_while_it_waits" in stacks[0]


def test_publisher_never_blocks_without_a_server() -> None:
    port = free_port_pair()  # nobody listens here
    publisher = Publisher(
        f"tcp://127.0.0.1:{port}", 0.05, lambda: [Sample(v=1, rank=0, t=time.time())]
    )
    publisher.start()
    started = time.perf_counter()
    for i in range(QUEUE_LEN * 3):
        publisher.publish(Event(v=1, rank=0, t=time.time(), event="log", text=str(i)))
    assert time.perf_counter() - started < 1.0
    assert len(publisher._queue) <= QUEUE_LEN
    assert publisher.flush(2.0)
    stop_started = time.perf_counter()
    publisher.stop()
    assert time.perf_counter() - stop_started < 1.5
    assert publisher.dropped > 0 and not publisher.alive


@pytest.mark.parametrize("read", ["started", "compiling"])
def test_a_beat_computed_across_events_is_computed_again(receiver, read: str) -> None:
    """The training thread enters 'eval' then 'compiling' while the publisher computes a
    beat, which may have read the phase before them ('started') or after ('compiling'):
    sent after the events, the first put the rank back (seen under load: the compile test's
    phases 'eval', 'started', 'compiling'); sent before them, the second ran ahead ('started',
    'compiling', 'eval'). The beat is computed again, and the server's phases are in order."""
    calls = 0
    dropped: list[int] = []  # before the events

    def heartbeat() -> list[Sample]:
        nonlocal calls
        calls += 1
        if calls == 6:  # connected by then (a beat before is dropped, no server has it)
            dropped.append(publisher.dropped)
            for phase in ("eval", "compiling"):  # as the training thread would, meanwhile
                publisher.publish(Event(v=1, rank=0, t=time.time(), event="phase", phase=phase))
        phase = "started" if calls < 6 else read if calls == 6 else "compiling"
        return [Sample(v=1, rank=0, t=time.time(), world_size=1, phase=phase)]

    publisher = Publisher(f"tcp://127.0.0.1:{receiver.collector.port}", 0.05, heartbeat)
    publisher.start()
    try:
        record = receiver.wait_for(
            lambda state: (r := state.ranks.get(0)) is not None and len(r.phases) >= 3 and r
        )
        time.sleep(0.2)  # a beat that put the rank back would have come by now
        assert [name for name, _ in record.phases] == ["started", "eval", "compiling"]
        assert dropped == [publisher.dropped]  # computed again, not dropped
    finally:
        publisher.stop()


def test_a_beat_computed_across_events_every_time_is_not_sent(receiver) -> None:
    """Events queued during every try: the beat is dropped (the next repeats it), its own
    events are kept, and the beats after it go as before."""
    calls = 0
    dropped: list[int] = []  # before the events

    def heartbeat() -> list[Sample | Event]:
        nonlocal calls
        calls += 1
        if calls == 6:
            dropped.append(publisher.dropped)
        if 6 <= calls < 6 + BEAT_TRIES:
            publisher.publish(Event(v=1, rank=0, t=time.time(), event="log", text=str(calls)))
        stack = Event(v=1, rank=0, t=time.time(), event="log", text=f"beat {calls}")
        return [stack, Sample(v=1, rank=0, t=time.time(), world_size=1, step=calls)]

    publisher = Publisher(f"tcp://127.0.0.1:{receiver.collector.port}", 0.05, heartbeat)
    publisher.start()
    try:
        record = receiver.wait_for(
            lambda state: (r := state.ranks.get(0)) is not None and "beat 12" in r.log_tail and r
        )
    finally:
        publisher.stop()
    assert [publisher.dropped - 1] == dropped
    tried = [f"beat {n}" for n in range(6, 6 + BEAT_TRIES)]  # each try's own event, kept
    assert all(line in record.log_tail for line in tried)


def test_progress_step_timing_and_data_wait() -> None:
    progress = Progress()
    progress.end_step()
    time.sleep(0.02)
    progress.forward_started()
    assert progress.data_wait_s is not None and progress.data_wait_s >= 0.015
    assert progress.phase == "forward"
    progress.end_step()
    assert progress.step == 2 and progress.step_time_s >= 0.015
    progress.pinned = 1
    progress.auto_phase("backward")
    assert progress.phase == "forward"  # a user phase() block is not overwritten by hooks


CRASHING_RANK = """
import os, sys, time
import ddpwatch
ddpwatch.attach(addr=sys.argv[1])
ddpwatch.step(0.5)
time.sleep(0.6)
print("collating batch 7", flush=True)  # shipped with the crash, not 2 s later
raise ValueError("bad batch shape (3, 5)")
"""

TERMINATED_RANK = """
import os, signal, sys, time
import ddpwatch
ddpwatch.attach(addr=sys.argv[1])
ddpwatch.step(0.5)
time.sleep(0.6)
print("saving checkpoint", flush=True)
print(f"killed at {time.time()}", file=sys.stderr, flush=True)
os.kill(os.getpid(), signal.SIGTERM)
time.sleep(5)
"""


def _run_rank(code: str, port: int) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "RANK": "3", "LOCAL_RANK": "1", "WORLD_SIZE": "4"}
    return subprocess.run(
        [sys.executable, "-c", code, f"127.0.0.1:{port}"],
        env=env,
        capture_output=True,
        text=True,
        timeout=30,
    )


def test_crash_is_reported_with_traceback_and_the_process_dies_as_before(
    receiver: Receiver,
) -> None:
    result = _run_rank(CRASHING_RANK, receiver.collector.port)
    assert result.returncode == 1
    assert "ValueError: bad batch shape (3, 5)" in result.stderr  # the user's excepthook still ran
    record = receiver.wait_for(
        lambda s: s.ranks.get(3) if s.ranks.get(3) and s.ranks[3].error else None
    )
    assert record.error.type == "ValueError"
    assert record.error.message == "bad batch shape (3, 5)"
    assert "<string>" in record.error.traceback
    assert record.local_rank == 1 and record.world_size == 4
    receiver.wait_for(lambda s: s.ranks[3].exit_time is not None)
    assert "collating batch 7" in receiver.state.ranks[3].log_tail


def test_sigterm_is_reported_then_the_process_dies_of_it(receiver: Receiver) -> None:
    result = _run_rank(TERMINATED_RANK, receiver.collector.port)
    assert result.returncode == -15
    killed = float(result.stderr.split("killed at ")[1].split()[0])
    assert time.time() - killed < 4  # died of it, not after the 5 s sleep (python's start-up
    # and imports, seconds on a loaded machine, are not counted)
    record = receiver.wait_for(
        lambda s: s.ranks.get(3) if s.ranks.get(3) and s.ranks[3].exit_time else None
    )
    assert record.exit_signal == "SIGTERM"
    assert "saving checkpoint" in record.log_tail  # printed since the last heartbeat


def test_fault_inside_the_agent_never_reaches_training(receiver: Receiver, rank_env) -> None:
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{receiver.collector.port}", interval=0.05)

    def broken() -> None:
        raise RuntimeError("probe exploded")

    watcher.progress.on_step = broken  # runs on the training thread every 64 steps
    ddpwatch.step()  # step 1 calls it: must not raise
    watcher._heartbeat = broken  # the publisher thread's work fails too
    watcher.publisher._heartbeat = broken
    time.sleep(0.2)
    assert watcher.publisher.alive
    ddpwatch.step()


def test_startup_phases_and_checkpoints_are_reported(
    receiver: Receiver, rank_env, tmp_path
) -> None:
    original_save, original_ddp_init = (
        torch.save,
        torch.nn.parallel.DistributedDataParallel.__init__,
    )
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{receiver.collector.port}", interval=0.1)
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{free_port_pair()}", rank=0, world_size=1
    )
    try:
        ddp = torch.nn.parallel.DistributedDataParallel(torch.nn.Linear(2, 1))
        assert watcher.progress.phase == "first_step"  # wrapped: waiting for its first step
        path = tmp_path / "model.pt"
        torch.save(ddp.state_dict(), path)
        torch.save({"x": 1}, __import__("io").BytesIO())  # not a path: not a checkpoint event
        record = receiver.wait_for(
            lambda s: s.ranks.get(0) if s.ranks.get(0) and s.ranks[0].checkpoint_paths else None
        )
        assert record.checkpoint_paths == [str(path)]
        phases = [
            name
            for name, _ in receiver.wait_for(
                lambda s: s.ranks[0].phases if len(s.ranks[0].phases) >= 3 else None
            )
        ]
        assert (
            phases.index("rendezvous") < phases.index("model_wrap") < phases.index("first_step")
        ), phases
    finally:
        dist.destroy_process_group()
    ddpwatch.detach()
    assert torch.save is original_save
    assert torch.nn.parallel.DistributedDataParallel.__init__ is original_ddp_init


def test_line_buffer_splits_lines_and_progress_bars() -> None:
    from ddpwatch.agent.logtail import LineBuffer

    buffer = LineBuffer(keep=3)
    buffer.feed("epoch 1\nstep 1")
    buffer.feed(" done\n 10%\r 50%\r100%\n\n")
    assert buffer.take() == ["epoch 1", "step 1 done", "100%"]
    assert buffer.take() == []
    buffer.feed("".join(f"line {i}\n" for i in range(10)))
    assert buffer.take() == ["line 7", "line 8", "line 9"]


def test_output_printed_while_no_server_listens_arrives_once_one_does(rank_env, capsys) -> None:
    """Log lines (like stacks) happen once: a heartbeat no server took must not lose them."""
    port = free_port_pair()
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{port}", interval=0.1)
    watcher._next_log = 0.0
    print("epoch 1: loading shard 3 of 8")
    time.sleep(0.5)  # several beats, none of them taken: the lines are already out of the tail
    receiver = Receiver(port)
    try:
        record = receiver.wait_for(
            lambda s: s.ranks.get(0) if s.ranks.get(0) and s.ranks[0].log_tail else None
        )
        assert list(record.log_tail) == ["epoch 1: loading shard 3 of 8"]
        # the server is new to the agent: it is told the identity on the next heartbeat
        assert receiver.wait_for(lambda s: s.ranks[0].host is not None and s.ranks[0].pid)
    finally:
        ddpwatch.detach()
        receiver.close()
    assert capsys.readouterr().out == "epoch 1: loading shard 3 of 8\n"


def test_a_restarted_server_is_told_the_identity_at_once(rank_env, monkeypatch) -> None:
    """Heartbeats repeat the identity only when it changes or a server (re)connects: the
    safety net (every IDENTITY_EVERY beats) is turned off here to see the reconnect rule."""
    monkeypatch.setattr("ddpwatch.agent.watcher.IDENTITY_EVERY", 10**9)
    port = free_port_pair()
    first = Receiver(port)
    ddpwatch.attach(addr=f"127.0.0.1:{port}", interval=0.1)
    try:
        first.wait_for(lambda s: s.ranks.get(0) and s.ranks[0].host and s.ranks[0].step is None)
        first.close()  # the Hello went to this one
        time.sleep(0.3)
        second = Receiver(port)
        try:
            record = second.wait_for(lambda s: s.ranks.get(0) and s.ranks[0].host and s.ranks[0])
            assert record.pid == os.getpid() and record.device == "cpu"
        finally:
            second.close()
    finally:
        ddpwatch.detach()


def test_heartbeats_carry_the_identity_when_it_changed_or_a_server_connected(rank_env) -> None:
    watcher = Watcher(addr=f"127.0.0.1:{free_port_pair()}")  # not started: no heartbeats
    identity = {"host": "node-a", "device": "cuda:0"}
    due = [watcher._identity_due(identity) for _ in range(12)]
    assert due == [True] + [False] * 9 + [True, False]  # then every 10th beat
    assert watcher._identity_due({**identity, "device": "cuda:1"})  # set_device moved it
    assert not watcher._identity_due({**identity, "device": "cuda:1"})
    watcher.publisher.connections += 1  # a server (re)connected
    assert watcher._identity_due({**identity, "device": "cuda:1"})


def test_printed_lines_reach_the_server_and_output_is_untouched(
    receiver: Receiver, rank_env, capsys
) -> None:
    watcher = ddpwatch.attach(addr=f"127.0.0.1:{receiver.collector.port}", interval=0.1)
    watcher._next_log = 0.0
    print("loading shard 3 of 8")
    print("warning: slow disk", file=sys.stderr)
    record = receiver.wait_for(
        lambda s: s.ranks.get(0) if s.ranks.get(0) and len(s.ranks[0].log_tail) >= 2 else None
    )
    assert list(record.log_tail) == ["loading shard 3 of 8", "warning: slow disk"]
    ddpwatch.detach()
    captured = capsys.readouterr()
    assert captured.out == "loading shard 3 of 8\n"
    assert captured.err == "warning: slow disk\n"
    assert type(sys.stdout).__name__ != "Tee"


TORCH_AFTER_ATTACH = """
import sys
import ddpwatch
watcher = ddpwatch.attach(addr="127.0.0.1:1", interval=5)
print("torch before:", "torch" in sys.modules)
import torch
import torch.distributed as dist
print("hooked:", getattr(dist.init_process_group, "__ddpwatch__", False),
      getattr(torch.save, "__ddpwatch__", False))
ddpwatch.detach()
print("restored:", not getattr(dist.init_process_group, "__ddpwatch__", False))
"""


def test_attach_does_not_import_torch_and_hooks_it_once_the_program_does() -> None:
    """A torch-free script is not charged torch's import for being watched; a script that
    attaches first and imports torch after still gets every torch hook."""
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    result = subprocess.run(
        [sys.executable, "-c", TORCH_AFTER_ATTACH],
        env=env,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert result.returncode == 0, result.stderr
    assert "torch before: False" in result.stdout
    assert "hooked: True True" in result.stdout
    assert "restored: True" in result.stdout
