"""The pure parts of benchmarks/gpu/devices.py (checks 4-7 of the GPU check, issue #27): what
it reads from nvidia-smi, the ranks' reports and the status document. The checks themselves
run in ``benchmarks/gpu_check.py --cpu`` and on a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
from conftest import BENCHMARKS

sys.path.insert(0, str(BENCHMARKS))

from gpu import devices
from gpu.common import Context

MIB = 1 << 20


def test_json_lines_skip_what_a_killed_writer_leaves(tmp_path: Path) -> None:
    path = tmp_path / "r.jsonl"
    path.write_text('{"a": 1}\n[1, 2]\nnot json\n{"b": 2}\n{"c": ')
    assert devices.read_json_lines(path) == [{"a": 1}, {"b": 2}]
    assert devices.read_json_lines(tmp_path / "missing.jsonl") == []


def test_nvidia_smi_memory_in_bytes_by_uuid() -> None:
    text = (
        "GPU-8f3c1e2a-0000-1111-2222-333344445555, 4613\n"
        "GPU-aaaaaaaa-0000-1111-2222-333344445555, [N/A]\n"
        "\n"
        "MIG-12345678-0000-1111-2222-333344445555, 12\n"
    )
    rows = devices.parse_smi_memory(text)
    assert rows == [
        ("GPU-8f3c1e2a-0000-1111-2222-333344445555", 4613 * MIB),
        ("MIG-12345678-0000-1111-2222-333344445555", 12 * MIB),
    ]
    assert devices.smi_used_for(rows, "gpu-8F3C1E2A-0000-1111-2222-333344445555") == 4613 * MIB
    assert devices.smi_used_for(rows, "GPU-other") is None  # two GPUs: no guess
    assert devices.parse_smi_memory("81559\n") == [(None, 81559 * MIB)]  # memory.used alone
    assert devices.smi_used_for(devices.parse_smi_memory("81559\n"), "GPU-x") == 81559 * MIB
    assert devices.smi_used_for([], None) is None


def test_relative_difference_and_formats() -> None:
    assert devices.rel_diff(103, 100) == pytest.approx(0.03)
    assert devices.rel_diff(None, 100) is None
    assert devices.rel_diff(1, 0) is None
    assert devices.gib(3 << 29) == "1.50 GiB"
    assert devices.gib(None) == "?"
    assert devices.pct(0.0123) == "1.2 %"
    assert devices.clip("a\n  b", 10) == "a b"
    assert devices.clip("x" * 30, 10) == "x" * 9 + "…"
    assert devices.clip(None) == ""


def test_flight_recorder_counts_from_a_status_rank() -> None:
    rank = {"rank": 0, "collectives": {"py": 3, "fr": {"0": 42, "1": 7}}}
    assert devices.fr_count(rank) == 42
    assert devices.fr_count(rank, "1") == 7
    assert devices.fr_count(rank, "2") is None
    assert devices.fr_count({"collectives": None}) is None
    assert devices.fr_count({"collectives": {"fr": {"0": True}}}) is None
    assert devices.fr_count(None) is None


def test_rising_means_counts_that_go_up_while_steps_run() -> None:
    assert devices.rising([None, 4, 4, 40, 90])
    assert not devices.rising([4, 4, 4, 4])  # never moved
    assert not devices.rising([None, 4, 90])  # one late jump is not "rising while it runs"
    assert not devices.rising([4, 40, 30, 90])  # a count never goes back
    assert not devices.rising([])


def test_pg_status_summary_as_dumped() -> None:
    gloo = {
        "0": {
            "last_completed_collective": "45",
            "last_enqueued_collective": "45",
            "last_started_collective": "-1",
        }
    }  # torch 2.13, gloo, as dev_train.py's report holds it
    assert devices.pg_summary(gloo) == "completed 45, enqueued 45, started -1"
    assert devices.pg_summary(None) == "no pg_status (this torch dumps none)"
    assert devices.pg_summary({"error": "x: boom"}) == "pg_status unreadable: x: boom"
    assert devices.pg_summary({"1": {}}) == "pg_status has no group 0 (groups: ['1'])"


def test_alerts_naming_ranks_and_when_they_were_first_raised() -> None:
    dup = {"kind": "duplicate_device", "ranks": [0, 1]}
    assert devices.names(dup, [1])
    assert devices.names(dup, [0, 1])
    assert not devices.names(dup, [2])
    assert not devices.names(None, [0])
    other = {"kind": "duplicate_device", "ranks": [1]}
    assert devices.first_naming([other, dup], [0, 1]) is dup
    assert devices.first_naming([other], [0, 1]) is None
    doc = {
        "history": [
            {"event": "raised", "elapsed_s": 1.5, "alert": {"kind": "crashed"}},
            {"event": "escalated", "elapsed_s": 1.7, "alert": dup},
            {"event": "raised", "elapsed_s": 2.25, "alert": dup},
            {"event": "raised", "elapsed_s": 9.0, "alert": dup},
        ]
    }
    assert devices.first_raised(doc, "duplicate_device") == 2.25
    assert devices.first_raised(doc, "crashed") == 1.5
    assert devices.first_raised(doc, "nan_loss") is None
    assert devices.first_raised({}, "crashed") is None


def test_the_log_keeps_sections_in_order_and_the_budget(tmp_path: Path) -> None:
    log = devices.Log(None, 100.0)
    log.add("one", "a\n\n")
    log.add("two", "b")
    assert log.text() == "===== one\na\n\n===== two\nb\n"
    assert 100.0 - devices.RESERVE_S - 1 < log.left() <= 100.0 - devices.RESERVE_S
    assert log.cap(5.0) == 5.0
    assert log.cap(500.0) == pytest.approx(log.left(), abs=0.5)
    assert devices.Log(None, 0.0).cap(30.0) == 1.0  # spent: one short look, no more
    ctx = Context(python=sys.executable, out=tmp_path, cpu=True)
    devices.Log(ctx, 10.0).add("three", "c")
    assert (tmp_path / "devices.log").read_text() == "===== three\nc\n\n"


def test_a_part_without_time_left_is_skipped_not_started() -> None:
    def part(ctx: Context, log: devices.Log) -> devices.Result:
        raise AssertionError("started")

    ctx = Context(python=sys.executable, out=Path("/nonexistent"), cpu=True)
    result = devices._guarded("4b x", part, ctx, devices.Log(None, 5.0), "y")
    assert result.ok is None
    assert "no time left" in result.figure


def test_a_part_that_raises_is_a_fail() -> None:
    def part(ctx: Context, log: devices.Log) -> devices.Result:
        raise KeyError("boom")

    ctx = Context(python=sys.executable, out=Path("/nonexistent"), cpu=True)
    result = devices._guarded("4b x", part, ctx, devices.Log(None, 100.0), "y")
    assert result.ok is False
    assert "KeyError" in result.figure


def test_budgets_fit_the_drivers_limits() -> None:
    import gpu_check

    limits = {name: limit for name, (_, _, limit) in gpu_check.CHECKS.items()}
    for name, budget in devices.BUDGET_S.items():
        assert budget + 5 <= limits[name], name


def test_gpu_only_checks_skip_on_cpu_without_starting_anything(tmp_path: Path) -> None:
    ctx = Context(python=sys.executable, out=tmp_path, cpu=True)
    for check in (devices.check_duplicate_device, devices.check_device_ordinal):
        (result,) = check(ctx)
        assert result.ok is None
        assert "no GPU" in result.figure
    assert list(tmp_path.iterdir()) == []


def test_job_scripts_exist() -> None:
    assert devices.TRAIN.is_file()
    assert devices.HOG.is_file()
