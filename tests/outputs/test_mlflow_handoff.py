"""The run's account in MLflow: a local tracking store, read back through MLflow's client."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient
from test_report import SLOW_VERDICT, record_run

from ddpwatch.core.ports import free_port_pair
from ddpwatch.outputs.handoff import handoff
from ddpwatch.outputs.mlflow_handoff import TrackerError, log_to_mlflow
from ddpwatch.server.replay import replay_to_end

pytestmark = pytest.mark.xdist_group("report")  # beside test_report: its recordings' pace


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real server's recording of 3 ranks, rank 1 slow and then crashing."""
    return record_run(tmp_path_factory.mktemp("runs") / "slow.ddpw", True)


@pytest.fixture
def store(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> str:
    """A local MLflow tracking store (MLflow 3 asks for an opt-in to its file store)."""
    uri = (tmp_path / "mlruns").as_uri()
    monkeypatch.setenv("MLFLOW_TRACKING_URI", uri)
    monkeypatch.setenv("MLFLOW_ALLOW_FILE_STORE", "true")
    monkeypatch.delenv("MLFLOW_RUN_ID", raising=False)
    return uri


def report(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpwatch", "report", *args],
        capture_output=True, text=True, timeout=120, env=env,
    )  # fmt: skip


def runs(client: MlflowClient) -> list:  # type: ignore[type-arg]
    return client.search_runs(["0"])


def test_report_logs_the_verdict_culprit_and_files_to_a_new_run(slow_run: Path, store: str) -> None:
    done = report(str(slow_run), "--mlflow", "--format", "json", env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    client = MlflowClient(tracking_uri=store)
    [run] = runs(client)
    assert f"logged to MLflow run {run.info.run_id}" in done.stderr
    tags = run.data.tags
    assert tags["ddpwatch.verdict"] == SLOW_VERDICT
    assert tags["ddpwatch.culprits"] == "1" and tags["ddpwatch.ranks"] == "3"
    assert run.data.metrics["ddpwatch.ranks"] == 3
    assert run.data.metrics["ddpwatch.alerts_raised"] >= 1
    assert run.info.status == "FAILED"  # the job ended by rank 1's crash
    assert run.info.run_name == "slow"
    files = {f.path for f in client.list_artifacts(run.info.run_id, "ddpwatch")}
    assert files == {f"ddpwatch/{n}" for n in
                     ("status.json", "timeline.json", "ranks.json", "report.json", "report.html")}  # fmt: skip
    folder = Path(client.download_artifacts(run.info.run_id, "ddpwatch"))
    ranks = json.loads((folder / "ranks.json").read_text())
    assert [r["rank"] for r in ranks] == [0, 1, 2] and ranks[1]["state"] == "crashed"
    assert json.loads((folder / "report.json").read_text()) == json.loads(done.stdout)
    assert "<html" in (folder / "report.html").read_text()
    timeline = json.loads((folder / "timeline.json").read_text())
    assert any(e["alert"]["kind"] == "crashed" and e["alert"]["ranks"] == [1] for e in timeline)


def test_the_scripts_own_run_gets_the_account_and_stays_open(
    slow_run: Path, store: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    client = MlflowClient(tracking_uri=store)
    script_run = client.create_run("0", run_name="train")
    monkeypatch.setenv("MLFLOW_RUN_ID", script_run.info.run_id)  # shared with the ranks
    done = report(str(slow_run), "--mlflow", "-o", os.devnull, env=dict(os.environ))
    assert done.returncode == 0, done.stderr
    [run] = runs(client)
    assert run.info.run_id == script_run.info.run_id
    assert run.data.tags["ddpwatch.culprits"] == "1"
    assert run.info.status == "RUNNING"  # the script's to end


def test_a_tracker_that_cannot_be_reached_is_one_line(slow_run: Path) -> None:
    closed = free_port_pair()
    env = {**os.environ, "MLFLOW_TRACKING_URI": f"http://127.0.0.1:{closed}",
           "MLFLOW_HTTP_REQUEST_MAX_RETRIES": "0"}  # fmt: skip
    started = time.monotonic()
    done = report(str(slow_run), "--mlflow", "-o", os.devnull, env=env)
    assert done.returncode == 1
    lines = [line for line in done.stderr.splitlines() if "not logged" in line]
    assert len(lines) == 1 and lines[0].startswith("ddpwatch report: the run was not logged: MLflow:")
    assert "Traceback" not in done.stderr
    assert time.monotonic() - started < 60


def test_the_account_is_read_from_the_published_document(slow_run: Path) -> None:
    document = replay_to_end(slow_run).document
    account = handoff(document)
    assert account.failed and account.tags["ddpwatch.culprits"] == "1"
    assert set(account.files) == {"status.json", "timeline.json", "ranks.json"}
    assert json.loads(account.files["status.json"])["verdict"]["text"] == SLOW_VERDICT
    lost = {k: v for k, v in account.metrics.items() if k.startswith("ddpwatch.time_lost_s.")}
    assert sum(lost.values()) == pytest.approx(account.metrics["ddpwatch.time_lost_s"], abs=0.01)


def test_bad_arguments_are_refused_before_anything_runs(slow_run: Path) -> None:
    done = report(str(slow_run), "--mlflow-run-id", "abc")
    assert done.returncode == 2 and "--mlflow-run-id needs --mlflow" in done.stderr
    done = report(str(slow_run), str(slow_run), "--mlflow")
    assert done.returncode == 2 and "one recording" in done.stderr


def test_a_bad_store_raises_a_tracker_error(tmp_path: Path) -> None:
    with pytest.raises(TrackerError, match=r"^MLflow: "):
        log_to_mlflow(
            handoff(replay_to_end(record_run(tmp_path / "r.ddpw", False)).document),
            env={"MLFLOW_TRACKING_URI": "nosuchscheme://x"},
        )


def test_serve_logs_the_run_when_it_stops(store: str) -> None:
    """``serve --mlflow``: when the server stops, the job it watched is logged (here one rank
    that reported and exited 0)."""
    import signal

    from conftest import push_frames, wait_listening

    from ddpwatch.core.protocol import Event, Sample, encode
    from ddpwatch.status.client import fetch_status

    port = free_port_pair()
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(port), "--mlflow"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ),
    )  # fmt: skip
    try:
        wait_listening(port, proc)
        beat = Sample(v=1, rank=0, t=time.time(), world_size=1, host="node-a", step=5)
        push_frames(port, [encode(beat), encode(Event(v=1, rank=0, t=time.time(), event="exit",
                                                      exit_code=0))])  # fmt: skip
        deadline = time.monotonic() + 60
        while True:  # the exit taken in and judged, however loaded the machine
            document = fetch_status("127.0.0.1", port, 2.0)
            if document is not None and any(r.exit_code == 0 for r in document.ranks):
                break
            assert time.monotonic() < deadline and proc.poll() is None
            time.sleep(0.2)
    finally:
        proc.send_signal(signal.SIGTERM)
        _out, err = proc.communicate(timeout=60)
    assert proc.returncode == 0, err
    [run] = runs(MlflowClient(tracking_uri=store))
    assert f"logged to MLflow run {run.info.run_id}" in err
    assert run.data.tags["ddpwatch.culprits"] == "none" and run.info.status == "FINISHED"
