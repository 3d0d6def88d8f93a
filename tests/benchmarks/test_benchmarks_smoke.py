"""Every benchmark script runs in a tiny configuration and prints its RATIO line.

A smoke test only: it checks that the scripts work end to end, never how fast anything is
(timings on shared machines are noise at this size). See benchmarks/README.md.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import ROOT

pytestmark = pytest.mark.e2e

BENCHMARKS = ROOT / "benchmarks"


def run_benchmark(script: str, *args: str, timeout: float = 120) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    proc = subprocess.run(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
    )
    output = proc.stdout + proc.stderr
    assert proc.returncode == 0, output[-4000:]
    assert "RATIO " in proc.stdout, output[-4000:]
    return proc.stdout


def test_agent_overhead_tiny() -> None:
    out = run_benchmark(
        "agent_overhead.py",
        "--trials",
        "2",
        "--block-s",
        "0.05",
        "--sizes",
        "tiny",
        "--peer",
        "off",
    )
    assert "RATIO ddpwatch/bare tiny" in out
    assert "RATIO A/A ddpwatch job/bare tiny" in out
    assert "peer TraceML: skipped" in out


def test_hot_path_tiny() -> None:
    out = run_benchmark("hot_path.py", "--calls", "2000", "--rounds", "1", "--sync-steps", "30")
    assert "RATIO hot path per step" in out
    assert "RATIO training-thread syncs by ddpwatch = 0 (ok)" in out
    assert "CUDA sync check" in out


def test_ingest_tiny() -> None:
    out = run_benchmark("ingest.py", "--messages", "2000", "--rounds", "1", "--ranks", "64")
    assert "RATIO collector/raw live" in out
    assert "RATIO collector/raw drain" in out


def test_ingest_cpu_tiny() -> None:
    out = run_benchmark("ingest_cpu.py", "--quick")
    assert "RATIO apply/collector direct 1024" in out
    assert "RATIO apply/collector relay 1024" in out


def test_queue_horizon_tiny() -> None:
    out = run_benchmark(
        "queue_horizon.py", "--frames", "2000", "--trials", "1", "--hwms", "8,100000"
    )
    assert "RATIO queue_horizon rcvhwm=8:" in out
    assert "RATIO queue_horizon rcvhwm=100000:" in out


def test_alert_latency_tiny() -> None:
    out = run_benchmark("alert_latency.py", "--reps", "1")
    for kind in ("stalled", "silent", "straggler"):
        assert f"RATIO {kind} latency beyond threshold" in out


def test_diagnosis_tiny() -> None:
    out = run_benchmark("diagnosis.py", "--reps", "1", "--modes", "raise")
    assert "RATIO diagnosis right_culprit=" in out
    assert "raise" in out


def test_scale_tiny() -> None:
    out = run_benchmark("scale.py", "--quick", "--modes", "relay,direct,nodes")
    assert "RATIO scale 512 relay" in out
    assert "RATIO scale 512 direct" in out
    assert "RATIO scale 512 nodes" in out
