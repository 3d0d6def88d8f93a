"""The agent never hurts training, whatever the server does; a paused rank recovers visibly.

The tests that do something to a server (kill it, pause it) or to one rank share one endless
job (``endless_job``): each puts its own server on the job's port, and the job outlives them.
"""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest
from conftest import ROOT, SCRIPTS, LiveServer, alert_of, as_json, free_port_pair

from ddpwatch.demo.runner import descendants, stop_job
from ddpwatch.diagnosis.alerts import Thresholds

pytestmark = pytest.mark.xdist_group("faults")  # one worker: its module fixture

JOB = SCRIPTS / "deterministic.py"


def torchrun(port: int, steps: int, watch: bool, **env: str) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2", "--master-addr=127.0.0.1",
         f"--master-port={free_port_pair()}", str(JOB), str(steps)],
        env={**os.environ, "DDPWATCH_ADDR": f"127.0.0.1:{port}", "WATCH": "1" if watch else "0", "OMP_NUM_THREADS": "1", **env},
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True,
    )  # fmt: skip


def checksum(out: str) -> str:
    found = re.search(r"CHECKSUM (\S+)", out)
    assert found, out
    return found.group(1)


def serve(port: int) -> subprocess.Popen[str]:
    return subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(port)],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=ROOT,
    )  # fmt: skip


def status(port: int) -> dict:
    from ddpwatch.cli import fetch_status

    document = as_json(fetch_status("127.0.0.1", port, 1.0))
    return document or {}


GLOO_EXIT_ABORT = "terminate called without an active exception"
"""torch 2.13's gloo aborts a rank now and then as its interpreter exits, after
``destroy_process_group`` returned and the job's work is done: 3 of 20 runs of this job with
no ddpwatch in it at all (https://github.com/pytorch/pytorch/issues/190489, and PR 179291 on
gloo's threads at interpreter finalization)."""


def finished_job(port: int, steps: int, watch: bool) -> tuple[int, str]:
    """Run the job to its end: once more if torch aborted it on the way out (``GLOO_EXIT_ABORT``,
    after its checksum), so only what the job itself did decides."""
    for _ in range(2):
        job = torchrun(port, steps, watch=watch)
        out, _ = job.communicate(timeout=120)
        if job.returncode == 0 or GLOO_EXIT_ABORT not in out or "CHECKSUM" not in out:
            break
    return job.returncode, out


def test_training_result_is_identical_with_and_without_ddpwatch(port: int) -> None:
    """The agent changes nothing in training, and a job watched by nobody (no server on its
    port) runs to its end as fast, with not a line from ddpwatch in its output."""
    bare, out_bare = finished_job(port, 150, watch=False)
    started = time.monotonic()
    watched, out_watched = finished_job(port, 150, watch=True)
    assert bare == 0, out_bare
    assert watched == 0, out_watched
    assert checksum(out_bare) == checksum(out_watched)
    assert "Traceback" not in out_watched and "ddpwatch" not in out_watched, out_watched
    assert time.monotonic() - started < 60


@pytest.fixture(scope="module")
def endless_job() -> Iterator[tuple[subprocess.Popen[str], int]]:
    """A 2-rank job that trains until stopped, reporting to a port no server holds yet: the
    job, and its port for the tests' servers."""
    port = free_port_pair()
    job = torchrun(port, 10**9, watch=True, STEP_SLEEP_S="0.01")  # ~100 steps/s at most
    try:
        yield job, port
    finally:
        stop_job(job, grace=2)


def test_server_killed_and_restarted_mid_run(
    endless_job: tuple[subprocess.Popen[str], int],
) -> None:
    """Both servers start after the ranks (the job trains with nobody listening first): each
    rebuilds the whole picture from the heartbeats alone."""
    job, port = endless_job
    assert job.poll() is None
    first = serve(port)
    try:
        deadline = time.monotonic() + 60
        # both ranks training, not still starting: on a loaded machine a rank says hello
        # seconds before its first step, and "mid-run" is what this test is about
        while not _stepping(status(port)):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        first.send_signal(signal.SIGKILL)
        first.wait()
        time.sleep(3)  # the ranks train on with nobody listening
        assert job.poll() is None
        second = serve(port)
        try:
            deadline = time.monotonic() + 30
            while not status(port):  # the new server starts (an interpreter and imports)
                assert time.monotonic() < deadline
                time.sleep(0.05)
            answering = time.monotonic()
            while True:
                ranks = [
                    r for r in status(port).get("ranks", []) if r["state"] in ("running", "waiting")
                ]
                if len(ranks) == 2 and all(r["host"] and r["world_size"] == 2 for r in ranks):
                    break
                assert time.monotonic() - answering < 10, status(port)
                time.sleep(0.1)
            # the whole picture is back within a few heartbeats (0.5 s each) of the server answering
            assert time.monotonic() - answering < 3.0
            # and a server that joins a job mid-run cries no wolf: no rank "never connected"
            # or "silent" for the seconds before it listened
            document = status(port)
            assert all(r["pid"] and (r["step"] or 0) >= 3 for r in document["ranks"]), document
            assert document["alerts"] == [], document["alerts"]
        finally:
            stop_job(second, grace=2)
    finally:
        stop_job(first, grace=1)


def test_server_paused_keeps_training_and_agent_memory_bounded(
    endless_job: tuple[subprocess.Popen[str], int],
) -> None:
    job, port = endless_job
    assert job.poll() is None
    server = serve(port)
    try:
        deadline = time.monotonic() + 60
        while not _stepping(status(port)):
            assert time.monotonic() < deadline
            time.sleep(0.5)
        ranks = descendants(job.pid)
        rss_before = {pid: _rss(pid) for pid in ranks}
        before = max(r["step"] for r in status(port)["ranks"])
        server.send_signal(signal.SIGSTOP)
        time.sleep(8)
        rss_after = {pid: _rss(pid) for pid in ranks}
        server.send_signal(signal.SIGCONT)
        time.sleep(1.5)
        after = min(r["step"] for r in status(port)["ranks"])
        assert after > before + 20, (before, after)  # training went on while the server was frozen
        growth = max(rss_after[p] - rss_before[p] for p in ranks if rss_before[p] and rss_after[p])
        assert growth < 50 << 20  # bounded queues: no unbounded buffering of heartbeats
    finally:
        server.send_signal(signal.SIGCONT)
        stop_job(server, grace=1)


def _stepping(document: dict) -> bool:
    ranks = document.get("ranks", [])
    return len(ranks) == 2 and all((r["step"] or 0) > 5 for r in ranks)


def _rss(pid: int) -> int:
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("VmRSS:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return 0


def test_paused_rank_is_silent_then_recovers_and_the_alert_clears(
    endless_job: tuple[subprocess.Popen[str], int],
) -> None:
    job, port = endless_job
    assert job.poll() is None
    server = LiveServer(port, Thresholds())
    try:
        # a server started after the job hears each rank's identity (its pid) at the rank's next
        # identity beat, up to 10 beats after its first one: wait for it too
        server.wait_for(
            lambda s: (
                len(s["ranks"]) == 2 and all((r["step"] or 0) > 5 and r["pid"] for r in s["ranks"])
            ),
            60,
        )
        rank_pids = {r["rank"]: r["pid"] for r in as_json(server.server.status())["ranks"]}
        os.kill(rank_pids[1], signal.SIGSTOP)
        try:
            alert = server.wait_for(alert_of("silent"), 15)
            assert alert["ranks"] == [1]
        finally:
            os.kill(rank_pids[1], signal.SIGCONT)
        server.wait_for(lambda s: not any(a["kind"] == "silent" for a in s["alerts"]), 15)
        server.wait_for(lambda s: all(r["state"] in ("running", "waiting") for r in s["ranks"]), 15)
        assert any(c.event == "cleared" and c.alert.kind == "silent" for c in server.changes)
    finally:
        server.stop()
