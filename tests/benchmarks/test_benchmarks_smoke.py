"""Every benchmark script runs in a tiny configuration and prints its RATIO line.

A smoke test only: it checks that the scripts work end to end, never how fast anything is
(timings on shared machines are noise at this size). See benchmarks/README.md.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import BENCHMARKS, ROOT

pytestmark = pytest.mark.e2e


def start_benchmark(script: str, *args: str) -> subprocess.Popen[str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    return subprocess.Popen(
        [sys.executable, str(BENCHMARKS / script), *args],
        cwd=ROOT,
        env=env,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )


def finished(proc: subprocess.Popen[str], timeout: float = 120) -> str:
    """The benchmark's output once it has ended well and printed its RATIO lines."""
    try:
        stdout, stderr = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        proc.kill()
        stdout, stderr = proc.communicate()
        raise AssertionError(f"no end in {timeout} s\n{(stdout + stderr)[-4000:]}") from None
    output = stdout + stderr
    assert proc.returncode == 0, output[-4000:]
    assert "RATIO " in stdout, output[-4000:]
    return stdout


def run_benchmark(script: str, *args: str, timeout: float = 120) -> str:
    return finished(start_benchmark(script, *args), timeout)


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


def test_agent_instructions_arms_run(tmp_path) -> None:
    """Each counting arm runs natively (callgrind's client requests are no-ops outside
    valgrind; a valgrind run is minutes, too slow for a smoke test)."""
    sys.path.insert(0, str(BENCHMARKS))
    import agent_instructions

    missing = agent_instructions.missing_tools()
    if missing is not None:
        pytest.skip(missing)
    library = agent_instructions.build_control(tmp_path)
    for arm in ("bare", "ddpwatch-none", "ddpwatch"):
        proc = start_benchmark(
            "agent_instructions.py", "--worker", "--arm", arm, "--steps", "5", "--warmup", "12",
            "--size", "tiny", "--lib", str(library),
        )  # fmt: skip
        stdout, stderr = proc.communicate(timeout=120)
        assert proc.returncode == 0, (stdout + stderr)[-4000:]


def test_agent_instructions_report_reads_per_step_and_parts(capsys) -> None:
    sys.path.insert(0, str(BENCHMARKS))
    import agent_instructions

    args = agent_instructions.argparse.Namespace(steps=10, size="small")
    totals = {"bare": 10_000_000, "ddpwatch": 10_640_000, "ddpwatch-grads": 10_300_000}
    agent_instructions.report(totals, args)
    out = capsys.readouterr().out
    assert "RATIO agent_instructions small ddpwatch/bare 1.0640" in out
    assert "part grads" in out and "+34,000 a step" in out


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
    out = run_benchmark("alert_latency.py", "--reps", "1", "--ranks", "2")
    for kind in ("stalled", "silent", "straggler"):
        assert f"RATIO {kind} latency beyond threshold" in out


def test_diagnosis_tiny() -> None:
    """The benchmark end to end on one mode, which is also that mode's test: Lightning #8130,
    one DDP process raises and the others hang or die of it
    (https://github.com/Lightning-AI/pytorch-lightning/issues/8130): rank 1 is named first,
    with an allowed kind, no alert names another rank, and the verdict blames it."""
    out = run_benchmark("diagnosis.py", "--reps", "1", "--modes", "raise", "--show")
    assert "RATIO diagnosis right_culprit=1/1 wrong_blames=0 right_verdict=1/1 " in out, out


def test_false_alarms_quick() -> None:
    """The real-job slice of the healthy corpus: two short jobs, tight thresholds, idle;
    a correct monitor names no rank (the default tests replay recordings of the same)."""
    out = run_benchmark("false_alarms.py", "--quick", timeout=300)
    assert "RATIO false_alarms total=0 " in out, out
    assert "failed_jobs=0 " in out, out


def test_scale_tiny() -> None:
    """Each mode in a run of its own, the three at once: a run is mostly waiting (6 s of
    heartbeats, then the queue's drain), each process well under a tenth of a core."""
    runs = {
        mode: start_benchmark("scale.py", "--quick", "--modes", mode, *more)
        for mode, more in [
            ("relay", ()),
            ("direct", ("--no-offline",)),
            ("nodes", ("--no-offline",)),
        ]
    }
    out = {mode: finished(proc) for mode, proc in runs.items()}
    for mode in runs:
        assert f"RATIO scale 512 {mode}" in out[mode]
    assert "RATIO scale 512 in memory" in out["relay"]
