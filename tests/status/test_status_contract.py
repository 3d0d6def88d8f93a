"""The status JSON is a contract (docs/status.md): its bytes, for documents of varied states,
pages, summaries and a replay, are held in ``tests/status_contract/``, and the schema of
``ddpwatch.status.schema`` decodes each one and encodes it back to the same bytes.

The states are built on a frozen clock, in UTC, so the bytes are the same on every machine.
A field added to the contract changes them on purpose: rewrite them with
``DDPWATCH_WRITE_CONTRACT=1 pytest tests/status/test_status_contract.py`` and read the diff.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import msgspec
import pytest
from tui_fixtures import big, document, healthy

from ddpwatch.core.ports import free_port_pair
from ddpwatch.core.protocol import (
    DEFAULT_PORT,
    Batch,
    Collective,
    CollectiveCounts,
    ErrorInfo,
    Event,
    Sample,
    encode,
)
from ddpwatch.core.vocabulary import JobStop
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.server.document import status_document
from ddpwatch.server.recording import Recorder
from ddpwatch.server.replay import ReplayServer
from ddpwatch.server.service import Server
from ddpwatch.state.relays import note_batch
from ddpwatch.state.state import ServerState
from ddpwatch.status.schema import JobEnd, PageReply, StatusDocument, SummaryReply

pytestmark = pytest.mark.xdist_group("status_contract")  # one worker: its module fixture

HELD = Path(__file__).parent / "status_contract"
WRITE = os.environ.get("DDPWATCH_WRITE_CONTRACT") == "1"
T0 = 1_700_000_000.0
HOSTS = ("node-a", "node-b")
QUERIES = {
    "page_all": b"status?",
    "page_filtered": b"status?state=crashed,not_connected,exited&limit=2&offset=1",
    "page_ranks": b"status?ranks=0-3,9&host=node-a",
    "summary": b"status?view=summary",
    "summary_scoped": b"status?view=summary&worst=3&host=node-b",
    "summary_counts": b"status?view=summary&worst=0",
    "refused": b"status?limit=0",
}


class Clock:
    def __init__(self, now: float) -> None:
        self.now = now

    def __call__(self) -> float:
        return self.now


@pytest.fixture(autouse=True)
def _utc(monkeypatch: pytest.MonkeyPatch) -> Iterator[None]:
    """The timeline's ``time`` is written in the server's zone: UTC here, on every machine."""
    monkeypatch.setenv("TZ", "UTC")
    time.tzset()
    yield
    monkeypatch.undo()
    time.tzset()


def _sample(rank: int, t: float, **fields: object) -> Sample:
    local = rank % 4
    base: dict[str, object] = {
        "world_size": 10,
        "local_world_size": 4,
        "node_rank": rank // 4,
        "local_rank": local,
        "host": HOSTS[rank // 4],
        "pid": 4000 + rank,
        "launcher": "torchrun",
        "device": f"cuda:{local}",
        "device_index": local,
        "device_name": "NVIDIA H100 80GB HBM3",
        "device_uuid": f"GPU-{rank:08x}",
        "device_pci_bus_id": f"00000000:{rank + 16:02X}:00.0",
        "pg_timeout_s": 600.0,
        "phase": "forward",
        "step_time_s": 0.25 + 0.01 * rank,
        "avg_step_time_s": 0.26,
        "data_wait_s": 0.01,
        "collective_time_s": 0.05,
        "input_wait_s": 0.012,
        "compute_s": 0.2,
        "grad_wait_s": 0.03,
        "mem_allocated_bytes": (10 + rank) << 30,
        "mem_reserved_bytes": (12 + rank) << 30,
        "mem_peak_bytes": (13 + rank) << 30,
        "gpu_mem_used_bytes": (14 + rank) << 30,
        "gpu_mem_total_bytes": 80 << 30,
        "gpu_pids": [4000 + rank],
        "host_rss_bytes": (3 << 30) + int((t - T0) * (1 << 20) * (8 if rank == 3 else 1)),
        "workers_rss_bytes": 1 << 30,
        "host_available_bytes": 200 << 30,
        "host_total_bytes": 512 << 30,
        "cgroup_limit_bytes": (64 << 30) if rank == 3 else None,
        "cgroup_used_bytes": (20 << 30) if rank == 3 else None,
        "collectives": CollectiveCounts(py=140, fr={"0": 420}),
    }
    base.update(fields)
    return Sample(v=1, rank=rank, t=t, **base)  # type: ignore[arg-type]


def _rich(server: Server, clock: Clock) -> None:
    """Eight ranks of ten on two hosts: a straggler and the ranks that wait for it, a crash
    in a collective, an exit, a NaN loss, stacks, logs, a checkpoint, a relay, and the
    timeline's raises, escalations and clearings over a minute."""
    state = server.state
    for second in range(0, 61, 2):
        t = T0 + second
        for rank in range(8):
            if (rank in (5, 6) and second > 20) or (rank == 4 and 44 <= second <= 50):
                continue  # ended; silent for a while
            fields: dict[str, object] = {"step": 100 + second // 2 - (5 if rank == 1 else 0)}
            fields["loss"] = float("nan") if rank == 7 and second > 30 else 2.5 - 0.01 * second
            if rank in (0, 2, 3) and second > 40:  # wait for rank 1, which is not there yet
                fields["collective"] = Collective(
                    op="all_reduce",
                    seq=141,
                    since_s=second - 40.5,
                    source="py",
                    shape=[1],
                    dtype="f32",
                )
                fields["collectives"] = CollectiveCounts(py=141, fr={"0": 421})
                fields["phase"] = "backward"
            state.apply(_sample(rank, t, **fields), t + 0.01)
        if second == 20:
            crash = Event(
                v=1,
                rank=5,
                t=t,
                event="crash",
                error=ErrorInfo(type="RuntimeError", message="NCCL error", traceback="Tb\n  x"),
                collective=Collective(op="broadcast", seq=77, shape=[2, 3], dtype="bf16"),
            )
            state.apply(crash, t + 0.02)
            state.apply(Event(v=1, rank=6, t=t, event="exit", exit_code=3), t + 0.03)
            state.apply(Event(v=1, rank=4, t=t, event="stack", stack="File x, line 1"), t + 0.04)
            state.apply(Event(v=1, rank=0, t=t, event="log", text="epoch 1 done"), t + 0.05)
            state.apply(Event(v=1, rank=0, t=t, event="checkpoint", path="/ck/1.pt"), t + 0.06)
            relay = Batch(v=1, relay="node-b:77", t=t, host="node-b", seq=3, frames=[b"x"])
            note_batch(state.relays, relay, t + 0.07)
        clock.now = t + 0.5
        server.tick()
    state.heard_until = clock.now - 0.125


def _straggler(server: Server, clock: Clock) -> None:
    """Four ranks: ranks 0, 2 and 3 wait for rank 1 from second 10 until it catches up at 30
    (a straggler raised, escalated, cleared), then rank 3 falls silent for a while."""
    for second in range(0, 51):
        t = T0 + second
        for rank in range(4):
            if rank == 3 and 34 <= second <= 40:
                continue
            fields: dict[str, object] = {"world_size": 4, "step": 10 + second}
            if 10 <= second < 30:
                fields["step"] = 20
                if rank != 1:
                    fields["collective"] = Collective(
                        op="all_reduce", seq=141, since_s=second - 10.0, source="py"
                    )
                    fields["collectives"] = CollectiveCounts(py=141)
                    fields["phase"] = "backward"
                else:
                    fields["phase"] = "data"
            server.state.apply(_sample(rank, t, **fields), t + 0.01)
        clock.now = t + 0.5
        server.tick()


def _attempts(server: Server, clock: Clock) -> None:
    """torchrun --max-restarts 1: rank 1 crashes, all three start again as attempt 2."""
    state = server.state
    for rank in range(3):
        state.apply(_sample(rank, T0, world_size=3, restart_count=0, step=5), T0 + 1)
    clock.now = T0 + 1.5
    server.tick()
    crash = Event(v=1, rank=1, t=T0, event="crash", error=ErrorInfo(type="RuntimeError"))
    state.apply(crash, T0 + 2)
    state.apply(Event(v=1, rank=0, t=T0, event="exit", signal="SIGTERM"), T0 + 2.1)
    clock.now = T0 + 2.5
    server.tick()
    for rank in range(3):
        state.apply(_sample(rank, T0, world_size=3, restart_count=1, pid=50 + rank), T0 + 3 + rank)
    clock.now = T0 + 6
    server.tick()


def _stopped(server: Server, clock: Clock) -> None:
    """``ddpwatch run``: two ranks train, the user presses Ctrl-C, the ranks end on the
    SIGTERM torchrun passes on, and ``run`` says how the job ended (``job_end``)."""
    state = server.state
    for second in range(5):
        for rank in range(2):
            state.apply(_sample(rank, T0 + second, world_size=2, step=second), T0 + second + 0.1)
        clock.now = T0 + second + 0.5
        server.tick()
    for rank in range(2):
        state.apply(Event(v=1, rank=rank, t=T0, event="exit", signal="SIGTERM"), T0 + 5.2)
    server.end_job(JobEnd(at=T0 + 5.5, exit_code=1, stopped_by=JobStop.CTRL_C, stopped_at=T0 + 5.1))
    clock.now = T0 + 5.75
    server.tick()


def _empty(server: Server, clock: Clock) -> None:
    clock.now = T0 + 0.25
    server.tick()


SCENARIOS: dict[str, Callable[[Server, Clock], None]] = {
    "rich": _rich,
    "straggler": _straggler,
    "attempts": _attempts,
    "stopped": _stopped,
    "empty": _empty,
}


def _replies(scenario: str) -> dict[str, bytes]:
    """Every reply the live server gives in ``scenario``: the document and the queries."""
    clock = Clock(T0)
    server = Server("127.0.0.1", free_port_pair(), Thresholds(stall_after=20.0), clock=clock)
    server.engine.port = DEFAULT_PORT  # the hints name the port when it is another one
    try:
        SCENARIOS[scenario](server, clock)
        replies = {f"{scenario}": server.status_json()}
        if scenario == "rich":
            for name, request in QUERIES.items():
                replies[f"{scenario}_{name}"] = server.query_json(request)
        return replies
    finally:
        server.collector.close()


def _replay() -> bytes:
    """A replay's document, ``replay`` key and all, of a short recording with ticks."""
    path = Path("run.ddpw")  # relative, in ``tmp``: the document names it
    recorder = Recorder(path, {"started": T0, "ticks": True, "tick_s": 0.25})
    for second in range(12):
        t = T0 + second
        for rank in range(2):
            if rank == 1 and second > 4:
                continue  # falls silent
            recorder.frame(t, encode(_sample(rank, t, world_size=3, step=second)))
        recorder.tick(t + 0.5, t + 0.5)
    recorder.close()
    replay = ReplayServer(path, speed=None)
    replay.run()
    return replay.status_json()


def _all_replies(tmp: Path) -> dict[str, bytes]:
    replies: dict[str, bytes] = {}
    for scenario in SCENARIOS:
        replies.update(_replies(scenario))
    with pytest.MonkeyPatch.context() as patch:
        patch.chdir(tmp)
        replies["replay"] = _replay()
    return replies


@pytest.fixture(scope="module")
def replies(tmp_path_factory: pytest.TempPathFactory) -> dict[str, bytes]:
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TZ", "UTC")
        time.tzset()
        try:
            return _all_replies(tmp_path_factory.mktemp("contract"))
        finally:
            patch.undo()
            time.tzset()


def _type_of(name: str) -> type[StatusDocument]:
    if "_summary" in name:
        return SummaryReply
    if "_page" in name:
        return PageReply
    return StatusDocument


def test_the_bytes_are_the_held_ones(replies: dict[str, bytes]) -> None:
    if WRITE:
        HELD.mkdir(exist_ok=True)
        for name, data in replies.items():
            (HELD / f"{name}.json").write_bytes(data)
    held = {path.stem: path.read_bytes() for path in HELD.glob("*.json")}
    assert sorted(held) == sorted(replies)
    for name, data in replies.items():
        assert data == held[name], name


@pytest.mark.parametrize("name", sorted(p.stem for p in HELD.glob("*.json")))
def test_the_schema_gives_back_the_same_bytes(name: str) -> None:
    data = (HELD / f"{name}.json").read_bytes()
    if name.endswith("_refused"):
        assert msgspec.json.decode(data).keys() == {"error"}
        return
    typed = msgspec.json.decode(data, type=_type_of(name))
    assert msgspec.json.encode(typed) == data


def test_the_held_documents_show_what_they_are_for() -> None:
    """The scenarios still reach what they were built to hold (a change in diagnosis that
    loses one would leave the contract untested there)."""
    rich = msgspec.json.decode((HELD / "rich.json").read_bytes(), type=StatusDocument)
    states = {entry.state for entry in rich.ranks}
    assert {"crashed", "exited", "not_connected", "waiting"} <= states
    assert {entry.event for entry in rich.history} == {"raised", "escalated"}
    assert rich.relays and rich.stats.refused == 0 and rich.stats.lag_s > 0
    crashed = next(e for e in rich.ranks if e.state == "crashed")
    assert crashed.error is not None and crashed.final_collective is not None
    assert any(e.host_mem_growth_bytes_per_s for e in rich.ranks)
    assert any(e.log_tail and e.checkpoints for e in rich.ranks)
    straggler = msgspec.json.decode((HELD / "straggler.json").read_bytes(), type=StatusDocument)
    assert {entry.event for entry in straggler.history} == {"raised", "escalated", "cleared"}
    assert any(e.alert.waited_s is not None and e.alert.phase for e in straggler.history)
    attempts = msgspec.json.decode((HELD / "attempts.json").read_bytes(), type=StatusDocument)
    assert attempts.attempt == 2 and attempts.attempts
    assert any(e.closed_by == "new_attempt" for e in attempts.history)
    replay = msgspec.json.decode((HELD / "replay.json").read_bytes(), type=StatusDocument)
    assert replay.replay
    stopped = msgspec.json.decode((HELD / "stopped.json").read_bytes(), type=StatusDocument)
    assert stopped.job_end and stopped.job_end.stopped_by == "ctrl_c"
    assert all(not isinstance(held.job_end, JobEnd) for held in (rich, straggler, replay))


def test_a_document_of_a_state_alone_has_no_refused() -> None:
    """``stats.refused`` comes from the server that takes connections, not the state."""
    document = status_document(ServerState(started=T0), [], T0, Thresholds())
    assert b'"refused"' not in msgspec.json.encode(document)


def test_the_dashboards_fixture_documents_fit_the_schema() -> None:
    """The hand-written documents of the dashboard's tests are documents the schema reads."""
    for doc in (document(0), document(80), healthy(4), big(64)):
        typed = msgspec.convert(doc, StatusDocument)
        assert [entry.rank for entry in typed.ranks] == [entry["rank"] for entry in doc["ranks"]]


def test_the_contract_imports_only_the_shared_kernel() -> None:
    """``ddpwatch.status`` is what the server and every view share: it imports nothing of
    either side (only ``core`` and itself), so a view reads it without the server."""
    import ast

    import ddpwatch.status

    folder = Path(ddpwatch.status.__file__).parent
    for path in sorted(folder.glob("*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            names = []
            if isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names = [node.module]
            elif isinstance(node, ast.Import):
                names = [alias.name for alias in node.names]
            for name in names:
                parts = name.split(".")
                if parts[0] == "ddpwatch":
                    assert parts[1] in ("core", "status"), f"{path.name} imports {name}"
