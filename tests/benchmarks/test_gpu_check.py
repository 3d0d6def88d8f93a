"""The GPU check (issue #27): its driver, its result lines and the pure parts of checks 1-3, 8
and 9 (``benchmarks/gpu/basics.py``), on this machine without a GPU. The ``--cpu`` dry run
starts real servers and torchrun jobs (e2e); the rest is plain Python."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import BENCHMARKS, ROOT

sys.path.insert(0, str(BENCHMARKS))

import gpu_check
from gpu import basics
from gpu.common import Context, Result, alerts_of

UUID = "GPU-8f3c1e2a-0000-1111-2222-333344445555"


def run_check(*args: str, timeout: float = 120) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    env.pop("OUT", None)
    return subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "gpu_check.py"), *args],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout, check=False,
    )  # fmt: skip


def test_result_lines() -> None:
    assert Result("1 identity", True, "'cuda:0'", "'cuda:0'").line() == (
        "PASS 1 identity: 'cuda:0' (expected 'cuda:0')"
    )
    assert Result("x", False, "1.3", "<= 1.02").line() == "FAIL x: 1.3 (expected <= 1.02)"
    assert Result("y", None, "no GPU", "a GPU").line() == "SKIP y: no GPU (expected a GPU)"


def test_without_cuda_one_line_and_nothing_claimed() -> None:
    proc = run_check()
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert proc.stdout.splitlines() == [gpu_check.NO_CUDA]


def test_unknown_check_is_refused() -> None:
    proc = run_check("--cpu", "--only", "identity,nope")
    assert proc.returncode == 2
    assert "unknown check(s) ['nope']" in proc.stdout


def test_budget_spent_skips_the_rest(tmp_path: Path) -> None:
    proc = run_check("--cpu", "--only", "identity,nan", "--budget-s", "5", "--out", str(tmp_path))
    assert proc.returncode == 0, proc.stderr[-2000:]
    lines = proc.stdout.splitlines()
    assert lines[0].startswith("gpu_check: python ") and "--cpu dry run" in lines[0]
    assert "SKIP identity: budget spent (5 s) (expected time left)" in lines
    assert lines[-1] == "SUMMARY pass=0 fail=0 skip=2"


def test_a_missing_check_is_skipped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(gpu_check.CHECKS, "gone", ("gpu.not_there", "check_gone", 1))
    monkeypatch.setitem(gpu_check.CHECKS, "absent", ("gpu.basics", "check_absent", 1))
    assert isinstance(gpu_check.load("gone"), str)
    assert gpu_check.load("absent") == "gpu.basics.check_absent missing"
    assert callable(gpu_check.load("identity"))
    gpu_check.run_one("gone", Context(sys.executable, tmp_path, cpu=True))
    (result,) = gpu_check.results_of(capsys.readouterr().out)
    assert result.ok is None and result.line().startswith("SKIP gone: gpu.not_there")


def test_the_other_checks_exist() -> None:
    for name in gpu_check.CHECKS:
        assert callable(gpu_check.load(name)), name


def test_scripts_parse() -> None:
    for script in ("run_on_device.sh", "fetch_wheels.sh"):
        path = ROOT / "benchmarks" / "gpu" / script
        assert subprocess.run(["bash", "-n", str(path)], check=False).returncode == 0, script


@pytest.mark.e2e
def test_a_check_past_its_limit_is_stopped(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(gpu_check.CHECKS, "identity", ("gpu.basics", "check_identity", 3))
    assert gpu_check.main(["--cpu", "--only", "identity", "--out", str(tmp_path)]) == 1
    out = capsys.readouterr().out
    assert "FAIL identity: timed out after 3 s (expected to finish)" in out.splitlines()
    assert out.splitlines()[-1] == "SUMMARY pass=0 fail=1 skip=0"


# the pure parts of the GPU-only checks ---------------------------------------------------------
def test_identity_compares_rank_nvml_and_smi() -> None:
    rows = basics.smi_rows(f"NVIDIA H100 80GB HBM3, {UUID}, 00000000:3B:00.0\n")
    assert rows == [
        {"name": "NVIDIA H100 80GB HBM3", "uuid": UUID, "pci_bus_id": "00000000:3B:00.0"}
    ]
    nvml = {"name": "NVIDIA H100 80GB HBM3", "uuid": UUID, "pci_bus_id": "00000000:3b:00.0"}
    rank = {"device_name": "NVIDIA H100 80GB HBM3", "device_uuid": UUID}
    rank["device_pci_bus_id"] = "0000:3B:00.0"
    results = basics.compare_identity(rank, nvml, rows[0])
    assert [r.ok for r in results] == [True, True, True], [r.line() for r in results]
    wrong = basics.compare_identity({**rank, "device_uuid": "GPU-other"}, nvml, rows[0])
    assert [r.ok for r in wrong] == [True, False, True]
    del rank["device_pci_bus_id"]  # a status document that does not publish it
    missing = basics.compare_identity(rank, nvml, rows[0])[2]
    assert missing.ok is False and "no 'device_pci_bus_id'" in missing.figure


def test_pci_bus_ids_normalised() -> None:
    assert basics._norm_pci("00000000:3b:00.0") == "00000000:3B:00.0"
    assert basics._norm_pci("0000:3B:00.0") == "00000000:3B:00.0"
    assert basics._norm_pci("3B:00.0") == "00000000:3B:00.0"
    assert basics._norm_pci(None) is None


def test_nan_judged_by_alert_and_rank() -> None:
    alert = {"kind": "nan_loss", "ranks": [0], "message": "rank 0 loss is nan since step 37"}
    rank = {"rank": 0, "nan_step": 37, "nan_exact": True}
    assert basics.judge_nan({"alerts": [alert], "ranks": [rank]}, 37)[0]
    cleared = {"alerts": [], "history": [{"event": "raised", "alert": alert}], "ranks": [rank]}
    assert alerts_of(cleared, "nan_loss") == [alert]
    assert basics.judge_nan(cleared, 37)[0]  # raised, then cleared as the job ended
    late = {**alert, "message": "rank 0 loss is nan since step 40"}
    assert not basics.judge_nan({"alerts": [late], "ranks": [rank]}, 37)[0]
    inexact = {**rank, "nan_exact": False}
    assert not basics.judge_nan({"alerts": [alert], "ranks": [inexact]}, 37)[0]
    ok, figure = basics.judge_nan({"alerts": [], "ranks": [rank]}, 37)
    assert not ok and figure.startswith("no nan_loss alert")


def test_overhead_judged_leniently_but_printed() -> None:
    data = {
        "batch": 8, "steps": 250, "trials": 12, "target_ms": 2.0, "bare_ms": 2.1,
        "ddpwatch": {"median": 1.04, "q1": 1.02, "q3": 1.05},
        "bare-again": {"median": 1.0, "q1": 0.99, "q3": 1.01},
    }  # fmt: skip
    result = basics.judge_overhead("small", data, 1.02)
    assert result.ok is True  # beyond the goal, not far beyond it: a measurement, shown
    assert "median 1.040" in result.figure and "<= 1.02" in result.expected
    far = {**data, "ddpwatch": {"median": 1.2, "q1": 1.1, "q3": 1.3}}
    assert basics.judge_overhead("small", far, 1.02).ok is False
    assert basics.judge_overhead("small", {"trials": 1}, 1.02).ok is False


def test_job_lines_read_the_last_tagged_json() -> None:
    text = 'noise\nRESULT {"a": 1}\nRESULT {"a": 2}\nRESULT not json'
    assert basics._job_line(text, "RESULT") is None
    assert basics._job_line(text.rsplit("\n", 1)[0], "RESULT") == {"a": 2}
    assert basics._job_line("", "SYNCWARN") is None


# the dry run: real servers and torchrun jobs -------------------------------------------------
@pytest.mark.e2e
@pytest.mark.timeout(400)
def test_cpu_dry_run(tmp_path: Path) -> None:
    # three real jobs: 140 s on a loaded machine, past a 170 s limit once
    proc = run_check("--cpu", "--only", "identity,nan,split", "--out", str(tmp_path), timeout=380)
    out = proc.stdout
    assert proc.returncode == 0, out + proc.stderr[-3000:]
    lines = [line for line in out.splitlines() if line.startswith(("PASS", "FAIL", "SKIP"))]
    assert [line.split(":")[0] for line in lines] == [
        "PASS 1 identity (cpu dry run)",
        "SKIP 1 identity vs NVML and nvidia-smi",
        "PASS 3 nan_loss (cpu dry run)",
        "SKIP 3 nan_loss on CUDA (async loss read)",
        "PASS 9 step split (cpu dry run)",
        "SKIP 9 step split on CUDA (CudaClock)",
    ], out
    assert "since step 37" in out
    assert out.splitlines()[-1] == "SUMMARY pass=3 fail=0 skip=3"
    log = (tmp_path / "basics.log").read_text()
    assert "DONE " in log and "listening for ranks" in log
    assert sorted(p.name for p in tmp_path.iterdir()) == ["basics.log", "gpu_check-children.log"]
    assert json.loads(log.split("IDENTITY ", 1)[1].splitlines()[0]) == {"device": "cpu"}


def test_sync_warnings_counted_by_thread() -> None:
    """The job's ``warn`` mode: torch's sync warnings, from the agent's thread or the training
    thread, counted apart; other warnings still shown."""
    import importlib.util
    import threading
    import warnings

    spec = importlib.util.spec_from_file_location("gpu_train_job", basics.TRAIN)
    assert spec is not None and spec.loader is not None
    job = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(job)
    with warnings.catch_warnings(record=True) as shown:
        counter = job.SyncWarnings()
        counter.install()
        warnings.warn("called a synchronizing CUDA operation", UserWarning, stacklevel=1)
        worker = threading.Thread(
            target=lambda: warnings.warn("called a synchronizing CUDA operation", stacklevel=1),
            name="ddpwatch-agent",
        )
        worker.start()
        worker.join()
        warnings.warn("something else", UserWarning, stacklevel=1)
        report = json.loads(counter.report())
    assert report["main"] == 1 and report["other"] == 1
    assert report["threads"]["ddpwatch-agent"] == 1
    assert [str(w.message) for w in shown] == ["something else"]
