"""The run's account in W&B, offline: read back from the run's own files (``run-ID.wandb``)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from test_report import SLOW_VERDICT, record_run
from wandb.proto import wandb_internal_pb2

pytestmark = pytest.mark.xdist_group("report")  # beside test_report: its recordings' pace

BLOCK = 32768
HEADER = 7  # ":W&B", a 2-byte magic and a version byte; each record: crc32, length, type


def records(path: Path) -> Iterator[Any]:
    """The protobuf records of a W&B transaction log (LevelDB's log format, 32 KiB blocks;
    a record is whole (1) or in first (2), middle (3) and last (4) pieces)."""
    data = path.read_bytes()
    assert data[:4] == b":W&B"
    pos, pieces = HEADER, b""
    while pos + HEADER <= len(data):
        left = BLOCK - pos % BLOCK
        if left < HEADER:
            pos += left
            continue
        _crc, length, kind = struct.unpack("<IHB", data[pos : pos + HEADER])
        if length == 0 and kind == 0:  # the block's padding
            pos += left
            continue
        chunk = data[pos + HEADER : pos + HEADER + length]
        pos += HEADER + length
        pieces = chunk if kind in (1, 2) else pieces + chunk
        if kind in (1, 4):
            record = wandb_internal_pb2.Record()
            record.ParseFromString(pieces)
            yield record


def read_run(folder: Path) -> dict[str, Any]:
    """The one offline run under ``folder``: its id, summary, artifacts, alerts, exit code."""
    [log] = list(folder.glob("wandb/offline-run-*/run-*.wandb"))
    run: dict[str, Any] = {"summary": {}, "artifacts": {}, "alerts": [], "history": []}
    for record in records(log):
        kind = record.WhichOneof("record_type")
        if kind == "run":
            run["id"], run["name"] = record.run.run_id, record.run.display_name
            run["project"], run["job_type"] = record.run.project, record.run.job_type
        elif kind == "summary":
            for item in record.summary.update:
                if item.key:
                    run["summary"][item.key] = json.loads(item.value_json)
        elif kind == "artifact":
            names = {entry.path for entry in record.artifact.manifest.contents}
            run["artifacts"][record.artifact.type] = names
        elif kind == "alert":
            run["alerts"].append((record.alert.title, record.alert.text, record.alert.level))
        elif kind == "history":
            run["history"].extend("/".join(i.nested_key) or i.key for i in record.history.item)
        elif kind == "exit":
            run["exit_code"] = record.exit.exit_code
    return run


@pytest.fixture(scope="module")
def slow_run(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A real server's recording of 3 ranks, rank 1 slow and then crashing."""
    return record_run(tmp_path_factory.mktemp("runs") / "slow.ddpw", True)


def offline(tmp_path: Path, **more: str) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("WANDB_")}
    env.update(WANDB_MODE="offline", WANDB_DIR=str(tmp_path), WANDB_PROJECT="train-watch", **more)
    return env


def report(*args: str, env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpwatch", "report", *args],
        capture_output=True, text=True, timeout=180, env=env, cwd=cwd,
    )  # fmt: skip


def test_report_logs_the_summary_table_artifact_and_alert_offline(
    slow_run: Path, tmp_path: Path
) -> None:
    done = report(str(slow_run), "--wandb", "--wandb-alert", "-o", os.devnull,
                  env=offline(tmp_path), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = read_run(tmp_path)
    assert f"ddpwatch report: logged to W&B run {run['id']}" in done.stderr
    assert (run["project"], run["name"], run["job_type"]) == ("train-watch", "slow", "ddpwatch")
    summary = run["summary"]
    assert summary["ddpwatch/verdict"] == SLOW_VERDICT
    assert summary["ddpwatch/culprits"] == "1" and summary["ddpwatch/ranks"] == 3
    assert "ddpwatch/time_lost_s" in summary
    assert any(key.startswith("ddpwatch/ranks/") for key in run["history"])  # the rank table
    assert run["artifacts"]["ddpwatch-report"] == {
        "status.json", "timeline.json", "ranks.json", "report.json", "report.html"
    }  # fmt: skip
    assert run["alerts"] == [("ddpwatch: rank 1", SLOW_VERDICT, "ERROR")]
    assert run["exit_code"] == 1  # the job failed


def test_the_scripts_own_run_is_resumed(slow_run: Path, tmp_path: Path) -> None:
    done = report(str(slow_run), "--wandb", "-o", os.devnull,
                  env=offline(tmp_path, WANDB_RUN_ID="script0run"), cwd=tmp_path)  # fmt: skip
    assert done.returncode == 0, done.stderr
    run = read_run(tmp_path)
    assert run["id"] == "script0run" and run["alerts"] == []  # no alert unless asked
    assert run["summary"]["ddpwatch/culprits"] == "1"


def test_the_options_need_their_flag(slow_run: Path, tmp_path: Path) -> None:
    done = report(str(slow_run), "--wandb-alert", env=offline(tmp_path), cwd=tmp_path)
    assert done.returncode == 2 and "--wandb-alert needs --wandb" in done.stderr
