"""``ddpwatch run -- COMMAND``: any launch command, with ddpwatch attached in every rank.

The ranks load ``ddpwatch/boot/sitecustomize.py`` through ``PYTHONPATH`` (see
``agent/auto.py`` for which processes count as ranks). Without ``--addr`` a
collector runs here and prints each alert as it is raised and cleared.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Sequence
from pathlib import Path
from typing import IO

from ddpwatch.agent.auto import AUTO_ENV
from ddpwatch.ports import pick_port
from ddpwatch.server.alerts import Thresholds
from ddpwatch.server.service import AlertChange, Server

BOOT_DIR = Path(__file__).resolve().parent / "boot"


def job_environment(addr: str, environ: dict[str, str] | None = None) -> dict[str, str]:
    """The environment that makes every Python process of the job load the boot hook."""
    env = dict(os.environ if environ is None else environ)
    path = env.get("PYTHONPATH")
    env["PYTHONPATH"] = str(BOOT_DIR) + (os.pathsep + path if path else "")
    env[AUTO_ENV] = "1"
    env["DDPWATCH_ADDR"] = addr
    return env


def describe(change: AlertChange) -> str:
    """One line for people: the alert stream interleaved with the job's own output."""
    alert = change.alert
    culprits = ", ".join(str(r) for r in alert.ranks[:16]) + ("…" if len(alert.ranks) > 16 else "")
    if change.event == "cleared":
        return f"ddpwatch: cleared {alert.kind} (rank {culprits})"
    return (
        f"ddpwatch: [{alert.severity}] {alert.kind}: {alert.message}\nddpwatch:   fix: {alert.hint}"
    )


def run_command(command: Sequence[str], addr: str | None = None, tui: bool = False) -> int:
    """Run ``command`` watched; returns its exit code."""
    if not command:
        print(
            "ddpwatch run: give the command after --, e.g. ddpwatch run -- torchrun train.py",
            file=sys.stderr,
        )
        return 2
    server = None
    if addr is None:
        port = pick_port()
        addr = f"127.0.0.1:{port}"
        server = Server("127.0.0.1", port, Thresholds(), on_change=None if tui else _print_change)
    output, log_path = _job_log() if tui and server is not None else (None, "")
    try:
        job = subprocess.Popen(
            list(command),
            env=job_environment(addr),
            stdout=output,
            stderr=subprocess.STDOUT if output else None,
        )
    except OSError as exc:
        print(f"ddpwatch run: cannot start {command[0]}: {exc.strerror}", file=sys.stderr)
        return 127
    if server is None:
        return _wait(job)
    if output is not None:
        output.close()  # the job holds its own copy
        return _with_dashboard(server, job, log_path)
    thread = threading.Thread(target=server.run, name="ddpwatch-collector", daemon=True)
    thread.start()
    try:
        return _wait(job)
    finally:
        _settle(server)
        server.tick()  # report what the job's last messages say
        server.stop()
        thread.join(5)


def _settle(server: Server, quiet_s: float = 0.5, limit_s: float = 3.0) -> None:
    """Let the ranks' last messages in before the final diagnosis: a rank's exit or crash
    report is sent as it dies, and may still be on its way when the launcher returns."""
    deadline = time.monotonic() + limit_s
    seen, since = server.state.received, time.monotonic()
    while time.monotonic() < deadline and time.monotonic() - since < quiet_s:
        time.sleep(0.05)
        if server.state.received != seen:
            seen, since = server.state.received, time.monotonic()


def _print_change(change: AlertChange) -> None:
    print(describe(change), file=sys.stderr, flush=True)


def _wait(job: subprocess.Popen[bytes]) -> int:
    """Wait for the job, passing SIGTERM on (Ctrl-C reaches it through the terminal)."""
    previous = signal.signal(signal.SIGTERM, lambda *_: job.send_signal(signal.SIGTERM))
    try:
        while True:
            try:
                return job.wait()
            except KeyboardInterrupt:
                continue  # the job got the same Ctrl-C: let it decide when to end
    finally:
        signal.signal(signal.SIGTERM, previous)


def _job_log() -> tuple[IO[bytes], str]:
    fd, path = tempfile.mkstemp(prefix="ddpwatch-run-", suffix=".log")
    return os.fdopen(fd, "wb"), path


def _with_dashboard(server: Server, job: subprocess.Popen[bytes], log_path: str) -> int:
    """The dashboard owns the terminal; the job's output goes to a file, which ``o`` follows
    (each rank's own tail also reaches its detail pane through its agent). The header shows
    whether the job still runs; quitting the dashboard stops it."""
    from ddpwatch.demo.runner import stop_job
    from ddpwatch.tui.app import run_dashboard
    from ddpwatch.tui.sources import JobSource

    try:
        run_dashboard(server, JobSource(server, job, log_path))
    finally:
        stop_job(job)
    print(f"ddpwatch run: the job's output is in {log_path}", file=sys.stderr)
    return job.returncode if job.returncode is not None else 1
