"""Shared fixtures: free ports, a live server on a thread, real torchrun jobs; and which tests
a plain ``pytest`` runs.

A plain ``pytest`` leaves out the slow tests, those marked with one of ``SLOW`` (by folder in
``FOLDER_MARKS``, or by a mark on the test): the unit, contract and in-process tests run in a
few minutes. ``pytest --all`` runs every test, as ``.ci/run`` does; ``-m`` picks for itself
(``pytest -m e2e``), and a file or folder named on the command line runs whole.

Tests import their helpers from here (``from conftest import LiveServer``), so this is the one
``conftest.py``: a second one, in a folder, would take the module name ``conftest`` from it.
"""

from __future__ import annotations

import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq

from ddpwatch.core.ports import free_port_pair
from ddpwatch.core.protocol import AnyMessage, Sample, decode
from ddpwatch.demo.runner import stop_job
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.history import AlertChange
from ddpwatch.server.recording import read_records
from ddpwatch.server.replay import ReplayServer
from ddpwatch.server.service import Server
from ddpwatch.state.state import ServerState
from ddpwatch.status.schema import StatusDocument

TESTS = Path(__file__).resolve().parent
ROOT = TESTS.parent
EXAMPLES = ROOT / "examples"
SRC = ROOT / "src" / "ddpwatch"  # the package, as files: what the contract tests read
BENCHMARKS = ROOT / "benchmarks"
SCRIPTS = TESTS / "scripts"  # the training scripts tests run under torchrun and launchers


SLOW = {
    "e2e": "starts real jobs: torchrun, `ddpwatch run` or `ddpwatch demo` with ranks",
    "launcher": "runs a job under mpirun, mpiexec.hydra, srun (Debian's packages), deepspeed or"
    " accelerate launch",
    "browser": "drives a headless chromium (Debian's package)",
    "fuzz": "random and flooding input at full size: hypothesis at its full examples, a million"
    " rank ids",
}
"""The marks a plain ``pytest`` leaves out, and what each test so marked needs."""

FOLDER_MARKS = {"e2e": "e2e"}
"""Folders of tests/ whose every test carries a mark: tests/e2e/ holds whole-job tests."""


def pytest_addoption(parser: pytest.Parser) -> None:
    parser.addoption(
        "--all",
        action="store_true",
        help="run every test, the slow ones too (marked " + ", ".join(SLOW) + "): as .ci/run",
    )


def pytest_configure(config: pytest.Config) -> None:
    for mark, needs in SLOW.items():
        config.addinivalue_line("markers", f"{mark}: {needs}")
    if not hasattr(config, "workerinput"):  # once, in the controller: before any worker
        _compile_the_package()


def _compile_the_package() -> None:
    """Write ddpwatch's bytecode once, for every process the tests start. Where
    ``PYTHONDONTWRITEBYTECODE`` is set (this machine, and CI's) no process caches it, so each
    rank, server and CLI run compiled the package's sources again: ~0.15 s of CPU a process
    that imports the agent and the server (0.34 against 0.19 s, measured), over the suite's
    hundreds of processes. Python reads bytecode it did not write, and checks it against the
    source's time stamp, so an edited file is compiled afresh."""
    import compileall

    compileall.compile_dir(str(SRC), quiet=2, workers=1)


WORKERS_MAX = 8


def pytest_xdist_auto_num_workers(config: pytest.Config) -> int:
    """``-n auto``: one worker more than the cores, at most ``WORKERS_MAX``. The slow tests
    mostly wait on their jobs (a fault's sleep, a threshold, a timeout): on CI's 2 cores a
    third worker fills the time those waits leave idle (docs/performance.md, §10)."""
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    return min(WORKERS_MAX, (cores or 1) + 1)


def _named_paths(config: pytest.Config) -> list[Path]:
    """The test files and folders named on the command line (``file::test`` names its file),
    less tests/ itself: a plain ``pytest`` names none."""
    named = []
    for arg in config.args:
        path = (config.invocation_params.dir / arg.split("::")[0]).resolve()
        if path.exists() and path not in (TESTS, ROOT):
            named.append(path)
    return named


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    for item in items:
        folder = item.path.relative_to(TESTS).parts[0] if item.path.is_relative_to(TESTS) else ""
        if folder in FOLDER_MARKS:
            item.add_marker(FOLDER_MARKS[folder])
    if config.getoption("--all") or config.option.markexpr:
        return
    named = _named_paths(config)
    slow = [
        item
        for item in items
        if not any(item.path.is_relative_to(path) for path in named)
        and any(item.get_closest_marker(mark) for mark in SLOW)
    ]
    if slow:
        config.hook.pytest_deselected(items=slow)
        left_out = set(slow)
        items[:] = [item for item in items if item not in left_out]


@pytest.fixture(autouse=True)
def _no_ddpwatch_environment(
    monkeypatch: pytest.MonkeyPatch, tmp_path_factory: pytest.TempPathFactory
) -> None:
    """A developer's exported DDPWATCH_* settings (a server key, an address) must not leak in;
    `ddpwatch run`'s default recordings go to a temporary folder, not the checkout."""
    for name in [n for n in os.environ if n.startswith("DDPWATCH_")]:
        monkeypatch.delenv(name)
    monkeypatch.setenv("DDPWATCH_RECORD_DIR", str(tmp_path_factory.getbasetemp() / "runs"))


def rank_zero_of_one(monkeypatch: pytest.MonkeyPatch) -> None:
    """This process as rank 0 of a world of one: the launcher's variables set, none left over."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "1")


@pytest.fixture
def port() -> int:
    return free_port_pair()


def push_frames(port: int, frames: list[bytes | list[bytes]]) -> None:
    """Send ``frames`` to a server's PULL port on one PUSH socket, in order (a list is one
    multipart message), and wait until they have left (a queue without a bound: thousands
    are sent before anyone reads)."""
    sock = zmq.Context.instance().socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 5000)
    sock.setsockopt(zmq.SNDHWM, 0)
    sock.connect(f"tcp://127.0.0.1:{port}")
    for frame in frames:
        if isinstance(frame, list):
            sock.send_multipart(frame)
        else:
            sock.send(frame)
    sock.close()


@dataclass
class AppliedState(ServerState):
    """A ``ServerState`` that notes each heartbeat applied to it, as (rank, step, loss): what a
    collector under backlog applied and what it only counted."""

    applied: list[tuple[int, int | None, float | None]] = field(default_factory=list)

    def apply(self, message: AnyMessage, now: float) -> None:
        if isinstance(message, Sample):
            self.applied.append((message.rank, message.step, message.loss))
        super().apply(message, now)

    def steps(self, rank: int) -> list[int | None]:
        """The steps of ``rank``'s heartbeats applied, in order."""
        return [step for r, step, _ in self.applied if r == rank]


def judged(document: StatusDocument, *, final: bool = True) -> StatusDocument:
    """A hand-written document with the verdict the server would give it: as the watch ends
    (``Engine.final_document``, what the summary and the report read), or live."""
    from ddpwatch.diagnosis.verdict import judged as judge

    return msgspec.structs.replace(document, verdict=judge(document, final=final))


_VALIDATORS: dict[str, Any] = {}


def published(kind: str, document: Any) -> Any:
    """``document`` (JSON values), checked against the published JSON Schema ``kind``
    (``status/schemas/``): every document a test reads this way holds to the contract."""
    import json

    import jsonschema

    from ddpwatch.status.contract import schema_text

    if kind not in _VALIDATORS:
        _VALIDATORS[kind] = jsonschema.Draft202012Validator(json.loads(schema_text(kind)))
    _VALIDATORS[kind].validate(document)
    return document


def as_json(document: Any) -> Any:
    """A status document (``status.schema``) as the JSON values it goes on the wire as: what
    a test that reads it by key wants (None stays None), checked against its published
    schema on the way."""
    from ddpwatch.status.schema import PageReply, SummaryReply

    if document is None:
        return None
    values = msgspec.to_builtins(document)
    if isinstance(document, SummaryReply):
        return published("summary", values)
    if isinstance(document, PageReply):
        return published("page", values)
    if isinstance(document, StatusDocument):
        return published("status", values)
    return values


def poll_status(server: Any, predicate: Callable[[dict[str, Any]], Any], timeout: float) -> Any:
    """Poll ``server.status()`` until ``predicate`` returns something truthy, and return that.
    ``predicate`` reads the document as plain JSON values, as it goes on the wire."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = predicate(as_json(server.status()))
        if found:
            return found
        time.sleep(0.05)
    raise AssertionError(f"timed out after {timeout} s; last status:\n{server.status()}")


def heartbeat_trace(path: Path, last: int = 60) -> str:
    """The last ``last`` heartbeats a server recorded, one line each: when it read them, the
    rank, its step and phase, the collective it said it was in and its collective counts."""
    lines = []
    records = [r for r in read_records(path) if r.kind == "frame"]
    start = records[0].t if records else 0.0
    for record in records:
        try:
            message = decode(record.data)
        except Exception:
            continue
        if not isinstance(message, Sample):
            continue
        c = message.collective
        inside = (
            f"{c.op} {c.source}:{c.group}#{c.seq} since {c.since_s:.2f}" if c is not None else "-"
        )
        counts = message.collectives
        told = f"py={counts.py} fr={counts.fr}" if counts is not None else "-"
        lines.append(
            f"+{record.t - start:7.2f} sent {message.t - start:7.2f} rank {message.rank} "
            f"step {message.step} {message.phase} in {inside} counts {told}"
        )
    return "last heartbeats heard:\n" + "\n".join(lines[-last:])


def replayed(path: Path, **kwargs: Any) -> tuple[ReplayServer, list[AlertChange]]:
    """Replay a recording as fast as it goes: the server, and the alert changes it made."""
    changes: list[AlertChange] = []
    replay = ReplayServer(path, speed=None, on_change=changes.append, **kwargs)
    replay.run()
    return replay, changes


class LiveServer:
    """A real ``Server`` on a background thread, recording every alert change."""

    def __init__(self, port: int, thresholds: Thresholds, record: Path | None = None) -> None:
        self.port = port
        self.record = record
        self.changes: list[AlertChange] = []
        self.server = Server(
            "127.0.0.1", port, thresholds, on_change=self.changes.append, record=record
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def wait_for(self, predicate: Callable[[dict[str, Any]], Any], timeout: float) -> Any:
        """Poll the status document until ``predicate`` returns something truthy; a timeout's
        error ends with the last heartbeats heard (what each rank said it was in): a race
        that shows 1 run in 20 on a loaded machine is read from the CI log, not rerun."""
        try:
            return poll_status(self.server, predicate, timeout)
        except AssertionError as failed:
            if self.record is None:
                raise
            raise AssertionError(f"{failed}\n{self.trace()}") from None

    def trace(self) -> str:
        """The last heartbeats heard (``heartbeat_trace``), for a failed assertion's message."""
        return heartbeat_trace(self.record) if self.record is not None else "(not recorded)"

    def assert_replay_agrees(self) -> None:
        """Stop the server and replay its recording: the same messages, in the same order,
        and the same alert changes, field for field (``serve --record`` then ``replay``)."""
        assert self.record is not None, "a LiveServer made without record="
        self.stop()
        replay, changes = replayed(self.record)
        assert replay.messages == self.server.state.received
        assert [c.to_dict() for c in changes] == [c.to_dict() for c in self.changes]

    def raised(self, kind: str) -> list[dict[str, Any]]:
        return [
            c.alert.to_dict() for c in self.changes if c.event != "cleared" and c.alert.kind == kind
        ]

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(5)


class Recording:
    """A real ``Server`` recording to ``path`` on a background thread."""

    def __init__(self, path: Path, thresholds: Thresholds | None = None) -> None:
        self.port = free_port_pair()
        self.changes: list[AlertChange] = []
        self.server = Server(
            "127.0.0.1", self.port, thresholds, on_change=self.changes.append, record=path
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.PUSH)
        self.sock.setsockopt(zmq.LINGER, 1000)
        self.sock.connect(f"tcp://127.0.0.1:{self.port}")

    def send(self, *frames: bytes) -> None:
        for frame in frames:
            self.sock.send(frame)

    def wait_for(
        self, predicate: Callable[[dict[str, Any]], Any], timeout: float
    ) -> dict[str, Any]:
        """The status document once ``predicate`` holds for it."""
        return poll_status(
            self.server, lambda status: status if predicate(status) else None, timeout
        )

    def stop(self) -> None:
        self.sock.close()
        self.context.term()
        self.server.stop()
        self.thread.join(5)
        assert not self.thread.is_alive()


def ddpwatch_run(
    server: LiveServer, *command: str, env: dict[str, str] | None = None, timeout: float = 300
) -> subprocess.CompletedProcess[str]:
    """``ddpwatch run --addr <server> -- command``, as a user types it."""
    addr = f"127.0.0.1:{server.port}"
    return subprocess.run(
        [sys.executable, "-m", "ddpwatch", "run", "--addr", addr, "--", *command],
        capture_output=True, text=True, timeout=timeout, env=env,
    )  # fmt: skip


def run_watched(job: list[str], cwd: Path, env: dict[str, str], timeout: float) -> tuple[int, str]:
    """``ddpwatch run -- JOB`` with its own collector, as a user types it, in ``cwd`` (where
    it records by default): its exit code and stderr. A run that does not end within
    ``timeout`` is stopped and fails the test."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "run", "--", *job],
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        start_new_session=True,
        cwd=cwd,
    )
    try:
        _, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        stop_job(proc, grace=3.0)
        _, err = proc.communicate()
        raise AssertionError(
            f"ddpwatch run did not end in {timeout:.0f} s\n{err[-4000:]}"
        ) from None
    return proc.returncode, err


@pytest.fixture
def live_server(port: int, tmp_path: Path) -> Iterator[LiveServer]:
    server = LiveServer(port, Thresholds(stall_after=4.0), record=tmp_path / "live.ddpw")
    yield server
    server.stop()


def alert_of(kind: str) -> Callable[[dict[str, Any]], dict[str, Any] | None]:
    def find(status: dict[str, Any]) -> dict[str, Any] | None:
        return next((a for a in status["alerts"] if a["kind"] == kind), None)

    return find


class Job:
    """A real torchrun job on CPU (gloo) running one of the examples."""

    def __init__(
        self,
        script: str,
        nproc: int,
        args: list[str],
        ddpwatch_port: int,
        env: dict[str, str] | None = None,
    ) -> None:
        master_port = free_port_pair()
        full_env = {
            **os.environ,
            "DDPWATCH_ADDR": f"127.0.0.1:{ddpwatch_port}",
            "DDPWATCH_STACK_AFTER": "1.0",
            "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1",
            **(env or {}),
        }
        cmd = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            f"--nproc-per-node={nproc}",
            "--master-addr=127.0.0.1",
            f"--master-port={master_port}",
            str(EXAMPLES / script),
            *args,
        ]
        self.proc = subprocess.Popen(
            cmd,
            env=full_env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def wait(self, timeout: float) -> tuple[int, str]:
        try:
            out, _ = self.proc.communicate(timeout=timeout)
        except subprocess.TimeoutExpired:
            self.kill()
            out, _ = self.proc.communicate()
            raise AssertionError(f"job did not finish in {timeout} s:\n{out}") from None
        return self.proc.returncode, out

    def kill(self) -> None:
        stop_job(self.proc, grace=3.0)


@pytest.fixture
def jobs() -> Iterator[Callable[..., Job]]:
    started: list[Job] = []

    def start(
        script: str, nproc: int, args: list[str], port: int, env: dict[str, str] | None = None
    ) -> Job:
        job = Job(script, nproc, args, port, env)
        started.append(job)
        return job

    yield start
    for job in started:
        job.kill()
        job.proc.communicate()


def wait_listening(port: int, process: subprocess.Popen[Any], timeout: float = 60.0) -> None:
    """Until something accepts TCP connections on 127.0.0.1:``port``: a server process
    started, however long its imports take on a loaded machine (seconds, not a fixed sleep)."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            assert process.poll() is None and time.monotonic() < deadline, "no listener"
            time.sleep(0.05)


@pytest.fixture
def http_server() -> Iterator[tuple[subprocess.Popen[bytes], int]]:
    """A real process holding a port: ``python -m http.server PORT`` on 127.0.0.1, listening
    once the fixture yields (doctor's and port_holder's tests name it as the holder)."""
    port = free_port_pair()
    process = subprocess.Popen(
        [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        wait_listening(port, process)
        yield process, port
    finally:
        process.kill()
        process.wait(10)


_ABORTS_IN_ALL_REDUCE = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    from ddpwatch.agent.blackbox import BlackBox
    from ddpwatch.agent.calls import CallDigests
    from ddpwatch.agent.progress import Progress

    progress = Progress()
    progress.box = BlackBox.open(int(sys.argv[2]), CallDigests(progress).exact, sys.argv[1])
    print(progress.box.name, os.getpid(), flush=True)
    for _ in range(19):
        progress.enter_collective("all_reduce", torch.ones(1))
        progress.exit_collective()
        progress.end_step()
    progress.enter_collective("all_reduce", torch.ones(1))
    threading.Timer(0.1, os.abort).start()
    time.sleep(10)
    """
)



def aborted_box(folder: Path, rank: int = 1) -> tuple[str, int]:
    """Run a process that, as ``rank``, enters all_reduce #20 (float32, one element) after 19
    steps and is aborted by another thread (as gloo aborts a rank): the name of the black
    box it left in ``folder`` and its pid."""
    done = subprocess.run(
        [sys.executable, "-c", _ABORTS_IN_ALL_REDUCE, str(folder), str(rank)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == -6, done.stderr
    name, pid = done.stdout.split()
    return name, int(pid)
