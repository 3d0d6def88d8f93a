"""The early hello (``agent/early.py``): a rank is known from interpreter start, before its
imports, and only processes that are ranks for sure say it."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import zmq
from conftest import SCRIPTS, LiveServer

from ddpwatch.agent import early
from ddpwatch.agent.auto import says_hello_early
from ddpwatch.core.protocol import Hello, Sample, decode
from ddpwatch.jobs.launch import job_environment

PY = "/venv/bin/python3"
TORCHRUN = [PY, "-m", "torch.distributed.run", "--nproc-per-node=2", "train.py"]
TORCH_RANK = {"DDPWATCH_AUTO": "1", "RANK": "1", "LOCAL_RANK": "1", "WORLD_SIZE": "2"}
LIGHTNING_RANK = {"DDPWATCH_AUTO": "1", "LOCAL_RANK": "1", "NODE_RANK": "0", "WORLD_SIZE": "2"}


def test_a_rank_a_launcher_started_says_hello_early() -> None:
    argv = [PY, __file__]
    assert says_hello_early(TORCH_RANK, TORCHRUN, argv, "/") == 1
    assert says_hello_early({**TORCH_RANK, "DDPWATCH_AUTO": "0"}, TORCHRUN, argv, "/") is None
    assert says_hello_early(TORCH_RANK, TORCHRUN, [PY, "/no/such/train.py"], "/") is None


def test_a_copy_of_its_parent_given_a_local_rank_says_hello_early(tmp_path: Path) -> None:
    """How Lightning starts ranks 1.. of a node: its own script again, the path made absolute."""
    script = tmp_path / "train.py"
    script.write_text("")
    parent = [PY, "train.py", "--fast"]
    argv = [PY, str(script), "--fast"]
    assert says_hello_early(LIGHTNING_RANK, parent, argv, str(tmp_path)) == 1
    module = [PY, "-m", "project.train"]
    assert says_hello_early(LIGHTNING_RANK, module, module, str(tmp_path)) == 1


def test_workers_and_launchers_say_nothing_early(tmp_path: Path) -> None:
    script = tmp_path / "train.py"
    script.write_text("")
    parent = [PY, str(script)]
    cwd = str(tmp_path)
    worker = [PY, "-c", "from multiprocessing.spawn import spawn_main", "--multiprocessing-fork"]
    assert says_hello_early(LIGHTNING_RANK, parent, worker, cwd) is None
    compile_worker = [PY, str(Path(__file__)), "--pickler=x"]  # another program
    assert says_hello_early(LIGHTNING_RANK, parent, compile_worker, cwd) is None
    inherited = {**TORCH_RANK}  # a rank's own subprocess: its parent is no launcher
    assert says_hello_early(inherited, parent, [PY, str(script)], cwd) is None
    assert says_hello_early(TORCH_RANK, [PY, "/venv/bin/torchrun"], TORCHRUN, cwd) is None
    node_1 = {**LIGHTNING_RANK, "NODE_RANK": "1"}  # its global rank is not known yet
    assert says_hello_early(node_1, parent, [PY, str(script)], cwd) is None


def test_the_agent_takes_over_from_the_early_sender() -> None:
    pull = zmq.Context.instance().socket(zmq.PULL)
    port = pull.bind_to_random_port("tcp://127.0.0.1")
    pull.setsockopt(zmq.RCVTIMEO, 5000)
    try:
        assert early.start(3, {"DDPWATCH_ADDR": f"127.0.0.1:{port}", "RANK": "3"})
        hello = decode(pull.recv())
        beat = decode(pull.recv())
        assert isinstance(hello, Hello) and (hello.rank, hello.pid) == (3, os.getpid())
        assert isinstance(beat, Sample) and beat.phase == "starting" and beat.cpu_s is not None
        early.hand_over()
        time.sleep(0.2)  # a beat already on its way still comes
        while pull.poll(0):
            pull.recv()
        assert not pull.poll(1500), "the early sender beats on after the hand-over"
    finally:
        early.hand_over()
        pull.close(0)


def test_the_server_knows_a_rank_before_its_slow_import_ends(
    live_server: LiveServer, tmp_path: Path
) -> None:
    """A real job under ``ddpwatch run``'s boot hook: rank 0 starts rank 1 as Lightning does,
    and rank 1 imports a module that takes 4 s; the server has its hello well before, and
    hears its exit."""
    imported = tmp_path / "imported"
    env = job_environment(f"127.0.0.1:{live_server.port}")
    env.update(IMPORTED_FILE=str(imported), SLOW_IMPORT_S="4")
    job = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "slow_start.py")],
        env=env,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        ranks = live_server.server.state.ranks
        deadline = time.monotonic() + 15
        while time.monotonic() < deadline and (1 not in ranks or ranks[1].cpu_s is None):
            time.sleep(0.02)  # its hello, then its first beat
        record = ranks.get(1)
        assert record is not None and not imported.exists(), "no hello before the import ended"
        assert (record.phase, record.local_rank, record.world_size) == ("starting", 1, 2)
        assert record.pid not in (None, job.pid) and record.cpu_s is not None
        _, stderr = job.communicate(timeout=30)
    finally:
        if job.poll() is None:
            job.kill()
    assert job.returncode == 0 and imported.exists(), stderr
    assert "ddpwatch" not in stderr  # the early hello says nothing in the job's output
    # it never reached init_process_group: its exit is told, not left as a rank gone silent
    deadline = time.monotonic() + 5
    while ranks[1].exit_time is None and time.monotonic() < deadline:
        time.sleep(0.02)
    assert ranks[1].finished and ranks[1].error is None
