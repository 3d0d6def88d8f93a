"""A user's own job under ``ddpwatch run``: its end-of-run summary and the report of its
recording quote one set of figures (#33 item 4).

A real torchrun job (3 CPU ranks, gloo) where rank 2 waits ~160 ms per batch for its input
from step 20 (``examples/failures.py --mode slow-input``, TraceML #252): the others wait for
it in DDP's all-reduce every step. What the newcomer met on such a run: the report said the
run lasted longer than it did, a median step of no step's, a time lost without the slow
rank's waits, and a fix the live alert never gave. Here the summary ``ddpwatch run`` prints,
and ``ddpwatch report`` on its recording, must agree figure for figure.
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

from conftest import BENCHMARKS, run_watched

sys.path.insert(0, str(BENCHMARKS))
from diagnosis import MODES, job_command, job_environment

from ddpwatch.core.ports import free_port_pair

PREFIX = "ddpwatch: "


def test_a_slow_data_jobs_summary_and_report_agree_figure_for_figure(tmp_path: Path) -> None:
    job = job_command(MODES["slow-input"], free_port_pair(), ("--no-metric", "--steps", "120"))
    returncode, err = run_watched(job, tmp_path, job_environment(None), 150)
    assert returncode == 0, err[-4000:]
    lines = err.splitlines()
    start = next(i for i, line in enumerate(lines) if "── summary" in line)
    summary = [line.removeprefix(PREFIX) for line in lines[start + 1 :] if line.startswith(PREFIX)]
    overview = summary[0]
    lost = next((line for line in summary if line.startswith("time lost: ")), None)
    verdict = summary[-1].removeprefix("verdict: ")
    account = "\n".join(lines[-40:])
    # the slow rank's waits are time lost, with how much, and the verdict says the same
    assert lost is not None and "rank 2 was slower than ranks 0, 1" in lost, account
    assert re.search(r"every step, [\d.]+ s in all \(\d+ % of a ", lost), account
    assert lost.removeprefix("time lost: ") in verdict, account
    (recording,) = tmp_path.glob("ddpwatch-runs/*.ddpw")
    report = _report(recording)
    data = json.loads(_report(recording, "--format", "json"))
    # the same run length, the same median step, the same time lost and verdict
    ran = overview.split(",")[0]
    assert f", {ran}, " in report.splitlines()[2], report[:600]
    median = re.search(r"median step ([\d.]+ s)", overview)
    assert median is not None, overview
    assert all(f" {median[1]} |" in row for row in report.splitlines() if row.startswith("| 2 |"))
    assert f"\n{overview}\n" in report and f"\n{lost}\n" in report, report[:3000]
    assert data["verdict"] == verdict
    # the fix is the one the live alert gave: the slow rank's input, not a generic one
    hints = [h["hint"] for h in data["hints"] if h["kind"] == "slow_rank"]
    assert hints and all("DataLoader" in h for h in hints), hints
    assert not any("compare its GPU" in h for h in hints), hints


def _report(recording: Path, *flags: str) -> str:
    """``ddpwatch report`` on the recording, as a user types it."""
    command = [sys.executable, "-m", "ddpwatch", "report", str(recording), *flags]
    return subprocess.run(command, capture_output=True, text=True, timeout=120, check=True).stdout
