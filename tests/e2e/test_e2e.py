"""End to end: real torchrun jobs (gloo, CPU) reporting to a real server."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from conftest import LiveServer, alert_of, as_json

from ddpwatch.diagnosis.alerts import Thresholds


def all_ranks_stepping(n: int):
    """A predicate for ``wait_for``: the status document once ``n`` ranks have stepped."""

    def check(status):
        ranks = [r for r in status["ranks"] if r["state"] != "not_connected"]
        return status if len(ranks) == n and all((r["step"] or 0) >= 3 for r in ranks) else None

    return check


def test_healthy_run_raises_no_alert(live_server: LiveServer, jobs) -> None:
    """The baseline every fault is told against: a clean job raises nothing, ever, and its
    verdict says so."""
    # long enough that its ranks are seen stepping before they exit, even on a loaded machine
    # (300 steps, under a second here, were twice over before a document saw both step)
    job = jobs("train_ddp.py", 2, ["--steps", "1500"], live_server.port)
    status = live_server.wait_for(all_ranks_stepping(2), timeout=60)
    assert status["world_size"] == 2
    for rank in status["ranks"]:
        assert rank["host"] and rank["pid"] and rank["device"] == "cpu"
        assert rank["local_rank"] == rank["rank"]
        assert rank["loss"] is not None and rank["step_time_s"] is not None
        assert rank["state"] in ("running", "waiting")
    rc, out = job.wait(120)
    assert rc == 0, out
    time.sleep(1.0)
    assert [c.alert.to_dict() for c in live_server.changes] == []
    document = live_server.server.status()
    final = as_json(document)
    assert all(r["state"] == "exited" for r in final["ranks"]), final["ranks"]
    told = live_server.server.status(final=True).verdict  # what the summary words
    assert told is not None and told.final
    verdict = told.text
    assert verdict == "the job finished: every rank exited 0; no problems seen", verdict


@pytest.mark.parametrize(
    ("fault", "op_hint"),
    [("straggler", "all_reduce"), ("slow-forward", "all_reduce")],
    ids=["explicit-all_reduce", "ddp-backward"],
)
def test_straggler_is_named_with_its_stack(
    live_server: LiveServer, jobs, fault: str, op_hint: str
) -> None:
    jobs(
        "faults.py",
        3,
        ["--fault", fault, "--rank", "1", "--at", "8", "--sleep", "25"],
        live_server.port,
    )
    alert = live_server.wait_for(alert_of("straggler"), timeout=60)
    assert alert["ranks"] == [1]
    assert alert["waiting"] == [0, 2]
    assert op_hint in alert["message"]
    assert "rank 1" in alert["message"]
    # the straggler's own stack shows where it really is
    status = live_server.wait_for(lambda s: s if s["ranks"][1]["stack"] else None, timeout=15)
    assert "faults.py" in status["ranks"][1]["stack"]
    assert "sleep" in status["ranks"][1]["stack"]
    assert status["ranks"][0]["state"] == "waiting"
    assert "faults.py" in alert["message"] or status["ranks"][1]["stack"]
    # stopped while the job still runs (Ctrl-C of `serve --record`): its replay says the same
    live_server.assert_replay_agrees()


def test_exception_on_one_rank_is_the_root_cause(live_server: LiveServer, jobs) -> None:
    message = "CUDA error: invalid device ordinal"
    job = jobs(
        "faults.py",
        3,
        ["--fault", "exception", "--rank", "1", "--at", "5", "--message", message],
        live_server.port,
    )
    alert = live_server.wait_for(alert_of("crashed"), timeout=60)
    assert alert["ranks"] == [1]
    rc, _ = job.wait(60)
    assert rc != 0
    status = live_server.wait_for(
        lambda s: (
            s
            if len(s["ranks"]) == 3 and all(r["state"] in ("crashed", "exited") for r in s["ranks"])
            else None
        ),
        timeout=20,
    )
    crashed = [a for a in status["alerts"] if a["kind"] == "crashed"]
    assert [a["ranks"] for a in crashed] == [[1]], status["alerts"]
    assert set(crashed[0]["waiting"]) <= {0, 2}
    error = status["ranks"][1]["error"]
    assert error["type"] == "RuntimeError" and "invalid device ordinal" in error["message"]
    assert "faults.py" in error["traceback"]
    # this CPU machine shows the rank no GPU: set_device(local_rank) would crash the same way,
    # so the fix says what the rank saw (issue 25), in the crash alert and device_ordinal alike
    hints = [a["hint"] for a in status["alerts"] if a["kind"] in ("crashed", "device_ordinal")]
    assert hints and all("shows this rank no GPU" in h for h in hints), status["alerts"]
    assert not any("set_device" in h for h in hints), hints
    live_server.assert_replay_agrees()  # the whole job, replayed: the same alerts


def test_killed_rank_is_silent_culprit(port: int, jobs, tmp_path: Path) -> None:
    server = LiveServer(port, Thresholds(stall_after=4.0), record=tmp_path / "live.ddpw")
    try:
        jobs("faults.py", 3, ["--fault", "kill", "--rank", "1", "--at", "8"], port)
        alert = server.wait_for(alert_of("silent"), timeout=60)
        # a loaded full run once named rank 0 too: its heartbeats stopped within 1.5 s of
        # rank 1's (#32); the trace says what each had last reported
        assert alert["ranks"] == [1], f"{alert}\n{server.trace()}"
        time.sleep(3)
        status = as_json(server.server.status())
        culprits = {r for a in status["alerts"] if a["severity"] == "error" for r in a["ranks"]}
        assert culprits == {1}, f"{status['alerts']}\n{server.trace()}"
    finally:
        server.stop()


def test_startup_hang_names_the_rank_that_never_reached_rendezvous(port: int, jobs) -> None:
    server = LiveServer(port, Thresholds(startup_after=3.0))
    try:
        jobs("faults.py", 3, ["--fault", "hang-startup", "--rank", "2", "--sleep", "30"], port)
        alert = server.wait_for(alert_of("startup_hang"), timeout=60)
        assert alert["ranks"] == [2]
        assert alert["waiting"] == [0, 1]
        assert "rendezvous" in alert["message"]
        status = as_json(server.server.status())
        assert status["ranks"][0]["phase"] == "rendezvous"
        assert status["ranks"][2]["phase"] == "started"
    finally:
        server.stop()
