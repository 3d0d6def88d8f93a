"""Orchestrates ``ddpwatch demo``: server, real torchrun job, simulated ranks, view."""

from __future__ import annotations

import importlib.util
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from typing import IO

from ddpwatch.core.ports import pick_port
from ddpwatch.demo.simulate import SimulatedCluster
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.history import print_json_line
from ddpwatch.jobs.stop import descendants, stop_job
from ddpwatch.outputs.summary import print_summary
from ddpwatch.server.collector import BindError
from ddpwatch.server.service import Server
from ddpwatch.status.provider import in_background

__all__ = ["DemoOptions", "descendants", "run_demo", "start_job", "stop_job", "torch_installed"]

NO_TORCH = (
    "ddpwatch demo: the real DDP job needs torch: pip install 'ddpwatch[torch]' "
    "(torch==2.13.0 is a CPU build); or run `ddpwatch demo --simulate 16`, which needs none"
)


@dataclass
class DemoOptions:
    ranks: int = 4
    faults: bool = True
    simulate: int = 0
    headless: bool = False
    duration: float | None = None
    port: int | None = None
    bell: bool = True


def torch_installed() -> bool:
    return importlib.util.find_spec("torch") is not None


def start_job(options: DemoOptions, port: int, log: IO[str]) -> subprocess.Popen[bytes]:
    """``torchrun -m ddpwatch.demo.job`` in its own process group, so it can be stopped whole."""
    env = {**os.environ, "DDPWATCH_ADDR": f"127.0.0.1:{port}", "OMP_NUM_THREADS": "1"}
    cmd = [
        sys.executable, "-m", "torch.distributed.run",
        f"--nproc-per-node={options.ranks}",
        "--master-addr=127.0.0.1",
        f"--master-port={pick_port(29500)}",
        "-m", "ddpwatch.demo.job",
    ]  # fmt: skip
    if options.faults:
        cmd.append("--faults")
    return subprocess.Popen(
        cmd, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True
    )


def run_demo(options: DemoOptions) -> int:
    real_job = options.ranks > 0
    if real_job and not torch_installed():
        print(NO_TORCH, file=sys.stderr)
        if not options.simulate:
            return 1
        real_job = False
    port = options.port or pick_port()
    try:
        server = Server(
            "127.0.0.1", port, Thresholds(), on_change=print_json_line if options.headless else None
        )
    except BindError as exc:
        print(f"ddpwatch demo: {exc}", file=sys.stderr)
        return 1
    fd, log_path = tempfile.mkstemp(prefix="ddpwatch-demo-", suffix=".log")
    with os.fdopen(fd, "w") as log:
        job = start_job(options, port, log) if real_job else None
        if job is not None:
            print(
                f"ddpwatch demo: {options.ranks} ranks, job output in {log_path}", file=sys.stderr
            )
        cluster = _start_simulation(options, port, first_rank=options.ranks if real_job else 0)
        try:
            if options.headless:
                return _run_headless(server, job, options.duration)
            from ddpwatch.demo.source import DemoSource
            from ddpwatch.tui.app import run_dashboard

            source = None
            if job is not None:
                source = DemoSource(server, job, options.ranks, faults=options.faults)
            return run_dashboard(server, source, bell=options.bell)
        finally:
            if cluster is not None:
                cluster.stop()
            stop_job(job)
            print_summary(server.status(final=True), sys.stderr)


def _start_simulation(options: DemoOptions, port: int, first_rank: int) -> SimulatedCluster | None:
    if not options.simulate:
        return None
    cluster = SimulatedCluster(f"tcp://127.0.0.1:{port}", options.simulate, first_rank=first_rank)
    cluster.start()
    return cluster


def _run_headless(
    server: Server, job: subprocess.Popen[bytes] | None, duration: float | None
) -> int:
    """Print alert changes until the job ends (plus a moment for the last alerts) or time is up."""
    with in_background(server):
        stop = threading.Event()
        previous = {
            sig: signal.signal(sig, lambda *_: stop.set())
            for sig in (signal.SIGINT, signal.SIGTERM)
        }
        deadline = None if duration is None else time.monotonic() + duration
        try:
            while not stop.wait(0.2):
                if deadline is not None and time.monotonic() >= deadline:
                    break
                if job is not None and job.poll() is not None:
                    stop.wait(3.0)  # the last crash and exit events still arrive
                    break
        finally:
            for sig, handler in previous.items():
                signal.signal(sig, handler)
    return 0
