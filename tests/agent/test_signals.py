"""A terminating signal ends a rank as fast as without ddpwatch, and is still reported."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
from conftest import SCRIPTS, LiveServer, free_port_pair


@pytest.mark.e2e
def test_sigterm_ends_a_rank_blocked_in_cpp_at_once_and_is_reported(
    live_server: LiveServer,
) -> None:
    """torchrun stops the ranks left after one failed with SIGTERM, and kills them 30 s later
    if they are still there. A rank blocked in a C++ wait (the rendezvous store, a
    collective) runs no Python signal handler until the call returns: the agent's report of
    the signal must not keep it alive (seen: a restart under torchrun took 33 s, not 1 s)."""
    env = {
        **os.environ,
        "RANK": "0",
        "WORLD_SIZE": "1",
        "DDPWATCH_ADDR": f"127.0.0.1:{live_server.port}",
    }
    proc = subprocess.Popen(
        [sys.executable, str(SCRIPTS / "blocked_in_cpp.py"), str(free_port_pair())],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("BLOCKED"), "the job did not reach its wait"
        live_server.wait_for(lambda s: s["ranks"] and s["ranks"][0]["pid"] == proc.pid, 20)
        time.sleep(0.5)  # well inside the C++ wait
        sent = time.monotonic()
        proc.send_signal(signal.SIGTERM)
        code = proc.wait(20)
        took = time.monotonic() - sent
    finally:
        proc.kill()
        proc.wait()
    assert code == -signal.SIGTERM, code  # died of the signal, as without ddpwatch
    assert took < 3.0, f"SIGTERM took {took:.1f} s to end the rank"
    rank = live_server.wait_for(
        lambda s: next((r for r in s["ranks"] if r["exit_signal"] == "SIGTERM"), None), 10
    )
    assert rank["state"] == "stopped", rank


def test_a_forked_child_stopped_by_sigterm_does_not_end_its_rank() -> None:
    """A child forked after the agent attached (a DataLoader worker) shares the rank's
    signal wakeup pipe unless the fork lets it go: its SIGTERM must end the child only."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "DDPWATCH_ADDR": "127.0.0.1:1"}
    result = subprocess.run(
        [sys.executable, str(SCRIPTS / "forked_child_sigterm.py")],
        env=env, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 0, (result.returncode, result.stdout, result.stderr[-2000:])
    assert "ALIVE -15" in result.stdout, result.stdout


def test_a_program_with_its_own_sigterm_handler_decides_for_itself() -> None:
    """A program that installed its own SIGTERM handler after the agent (Lightning saves a
    checkpoint on SLURM's SIGTERM) is left to it, blocked main thread or not, as without
    ddpwatch: its handler runs when the C++ wait returns."""
    env = {**os.environ, "RANK": "0", "WORLD_SIZE": "1", "DDPWATCH_ADDR": "127.0.0.1:1"}
    job = [sys.executable, str(SCRIPTS / "blocked_in_cpp.py"), str(free_port_pair())]
    proc = subprocess.Popen(
        [*job, "--own-handler", "--wait", "3"],
        env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
    )  # fmt: skip
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().startswith("BLOCKED"), "the job did not reach its wait"
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        time.sleep(1.0)
        assert proc.poll() is None, "ended before its own handler could run"
        out, _ = proc.communicate(timeout=30)
    finally:
        proc.kill()
        proc.wait()
    assert proc.returncode == 0, (proc.returncode, out)
    assert "OWN HANDLER" in out and "WAIT ENDED" in out, out
