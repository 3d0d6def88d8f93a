"""``ddpwatch demo``: the first command a new user runs."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import pytest

from ddpwatch.demo import runner
from ddpwatch.demo.runner import DemoOptions, descendants, run_demo


def _read_changes(proc: subprocess.Popen[str], until: float, want: set[str]) -> dict[str, float]:
    """Alert kinds raised and when (seconds since start), until ``want`` are all seen."""
    seen: dict[str, float] = {}
    started = time.monotonic()
    assert proc.stdout is not None
    while time.monotonic() - started < until and not want <= set(seen):
        line = proc.stdout.readline()
        if not line:
            break
        change = json.loads(line)
        if change["event"] != "cleared":  # raised, or escalated from a warning
            seen.setdefault(change["alert"]["kind"], time.monotonic() - started)
    return seen


@pytest.mark.e2e
def test_demo_headless_raises_a_straggler_within_30_s_and_leaves_no_child() -> None:
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "demo", "--headless", "--ranks", "3", "--duration", "90"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        seen = _read_changes(proc, until=60, want={"straggler"})
        assert "straggler" in seen, seen
        assert seen["straggler"] < 30
        children = descendants(proc.pid)
        assert children  # the real job is running under the demo
    finally:
        proc.send_signal(signal.SIGINT)
        proc.communicate(timeout=30)
    assert proc.returncode == 0
    time.sleep(0.5)
    assert not [pid for pid in children if os.path.exists(f"/proc/{pid}")], (
        "demo left processes behind"
    )


def test_demo_simulated_gpus_show_what_a_cpu_cannot() -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "demo", "--headless", "--ranks", "0", "--simulate", "16", "--duration", "4"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    kinds = {json.loads(line)["alert"]["kind"] for line in result.stdout.splitlines()}
    assert {"duplicate_device", "device_ordinal", "uneven_memory", "foreign_memory"} <= kinds


def test_demo_without_torch_says_how_to_install_it(monkeypatch, capsys) -> None:
    monkeypatch.setattr(runner, "torch_installed", lambda: False)
    assert run_demo(DemoOptions(ranks=4, headless=True)) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "pip install" in err and "--simulate" in err


def test_demo_rejects_a_single_rank(capsys) -> None:
    from ddpwatch.cli import main

    assert main(["demo", "--ranks", "1"]) == 2
    assert "at least 2" in capsys.readouterr().err
