"""serve --record and ddpwatch replay: the file format, torn tails, flushing, and replays that
raise the same alerts as the live run (a real torchrun job included)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys
import threading
import time
import zlib
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT, Recording, free_port_pair, published, replayed

from ddpwatch.cli import main
from ddpwatch.commands.replay import parse_speed
from ddpwatch.core.protocol import Batch, ErrorInfo, Event, Sample, encode
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.history import AlertChange
from ddpwatch.server.recording import (
    MAGIC,
    Record,
    Recorder,
    RecordingError,
    RecordingReader,
    encode_record,
    read_records,
)
from ddpwatch.server.replay import ReplayServer
from ddpwatch.status.schema import JobEnd, UnsetType


def sequence(changes: list[AlertChange] | list[dict[str, Any]]) -> list[tuple[str, str, list]]:
    """(event, kind, culprits) of each raised/cleared change, in order."""
    out = []
    for change in changes:
        data = change.to_dict() if isinstance(change, AlertChange) else change
        out.append((data["event"], data["alert"]["kind"], list(data["alert"]["ranks"])))
    return out


def sample(rank: int, step: int, **fields: Any) -> bytes:
    base = {"world_size": 3, "host": "node-a", "pid": 100 + rank, "local_rank": rank}
    return encode(Sample(v=1, rank=rank, t=time.time(), step=step, **{**base, **fields}))


# --------------------------------------------------------------------------- format


def test_round_trip(tmp_path: Path) -> None:
    path = tmp_path / "run.ddpw"
    frames = [sample(0, 1), sample(1, 1, loss=0.5), b"\x00" * 3, os.urandom(70_000)]
    recorder = Recorder(path, {"started": 100.0, "note": "x"})
    for i, frame in enumerate(frames):
        recorder.frame(100.0 + i, frame)
        recorder.tick(100.5 + i, None if i == 0 else 100.25 + i, 99.0 + i)
    recorder.close()
    assert path.read_bytes().startswith(MAGIC)
    records = read_records(path)
    assert records[0].kind == "session" and records[0].t == 100.0
    assert records[0].session == {"format": 1, "started": 100.0, "note": "x"}
    body = records[1:]
    assert [(r.kind, r.t, r.data) for r in body[0::2]] == [
        ("frame", 100.0 + i, f) for i, f in enumerate(frames)
    ]
    assert [(r.kind, r.t, r.horizon) for r in body[1::2]] == [
        ("tick", 100.5 + i, (None if i == 0 else 100.25 + i, 99.0 + i)) for i in range(len(frames))
    ]
    assert Record("tick", 1.0).horizon is None  # an empty payload: none recorded
    # the documented layout, byte for byte
    first = encode_record(1, 100.0, frames[0])
    assert first[8:] == struct.pack("<Bd", 1, 100.0) + frames[0]
    assert struct.unpack("<II", first[:8]) == (9 + len(frames[0]), zlib.crc32(first[8:]))
    assert first in path.read_bytes()


def test_unknown_record_kinds_are_skipped_by_consumers(tmp_path: Path) -> None:
    path = tmp_path / "future.ddpw"
    path.write_bytes(MAGIC + encode_record(7, 1.0, b"new") + encode_record(1, 2.0, b"f"))
    assert [(r.kind, r.data) for r in read_records(path)] == [(7, b"new"), ("frame", b"f")]


def test_how_the_job_ended_is_recorded_and_replayed(tmp_path: Path) -> None:
    """``ddpwatch run`` tells its server how the job ended (``job_end``): the recording keeps
    it as a ``job`` record, so a replay's document, and the report read from it, say it; a
    recording from before (no such record) replays without one."""
    path = tmp_path / "run.ddpw"
    why = "the script /x/train.py was not found: check its path"
    told = JobEnd(at=1_800_000_000.0, exit_code=2, not_started=why)
    live = Recording(path)
    try:
        live.server.end_job(told)
        live.server.tick()
        assert live.server.status().job_end == told
    finally:
        live.stop()
    records = read_records(path)
    (job,) = [r for r in records if r.kind == "job"]
    assert json.loads(job.data)["not_started"] == why
    assert replayed(path)[0].status().job_end == told
    kinds = {"session": 0, "frame": 1, "tick": 2}
    older = tmp_path / "older.ddpw"
    older.write_bytes(
        MAGIC + b"".join(encode_record(kinds[r.kind], r.t, r.data) for r in records if r != job)
    )
    assert isinstance(replayed(older)[0].status().job_end, UnsetType)


def _recording_with_tail(path: Path, n: int) -> tuple[bytes, int]:
    recorder = Recorder(path, {"started": 1.0})
    for i in range(n):
        recorder.frame(1.0 + i, sample(i % 3, i))
    recorder.close()
    data = path.read_bytes()
    last = encode_record(1, 1.0 + n - 1, b"")  # header length of the last record
    start = len(data) - (len(last) + len(read_records(path)[-1].data))
    return data, start


def test_truncated_tail_at_every_byte_of_the_last_record(tmp_path: Path) -> None:
    path = tmp_path / "torn.ddpw"
    data, start = _recording_with_tail(path, 5)
    whole = read_records(path)
    assert len(whole) == 6
    for cut in range(start, len(data)):
        path.write_bytes(data[:cut])
        reader = RecordingReader(path)
        records = list(reader)
        assert records == whole[:-1], cut
        assert reader.tail_bytes == cut - start
        assert reader.valid_bytes == start


def test_a_corrupt_last_record_is_not_read(tmp_path: Path) -> None:
    path = tmp_path / "bad.ddpw"
    data, start = _recording_with_tail(path, 4)
    for offset in (start + 2, start + 8, len(data) - 1):  # length, crc, payload
        broken = bytearray(data)
        broken[offset] ^= 0xFF
        path.write_bytes(bytes(broken))
        reader = RecordingReader(path)
        assert len(list(reader)) == 4
        assert reader.tail_bytes == len(data) - start


def test_appending_cuts_a_torn_tail_first(tmp_path: Path) -> None:
    path = tmp_path / "append.ddpw"
    data, start = _recording_with_tail(path, 3)
    path.write_bytes(data[: start + 5])  # the server died mid-write
    recorder = Recorder(path, {"started": 50.0})
    recorder.frame(51.0, b"after")
    recorder.close()
    reader = RecordingReader(path)
    records = list(reader)
    assert reader.tail_bytes == 0
    assert [r.kind for r in records] == ["session", "frame", "frame", "session", "frame"]
    assert records[-1].data == b"after"


def test_not_a_recording_is_refused_and_left_alone(tmp_path: Path) -> None:
    path = tmp_path / "notes.txt"
    path.write_text("my notes\n")
    with pytest.raises(RecordingError, match="not a ddpwatch recording"):
        Recorder(path, {})
    with pytest.raises(RecordingError, match="not a ddpwatch recording"):
        ReplayServer(path)
    assert path.read_text() == "my notes\n"
    (tmp_path / "v9").write_bytes(b"DDPWREC9")
    with pytest.raises(RecordingError, match="format"):
        RecordingReader(tmp_path / "v9")
    with pytest.raises(RecordingError, match="cannot open"):
        RecordingReader(tmp_path / "missing")


def test_parse_speed() -> None:
    assert parse_speed("max") is None and parse_speed("0") is None
    assert parse_speed("2.5") == 2.5
    for bad in ("-1", "fast"):
        with pytest.raises(Exception, match="speed"):
            parse_speed(bad)


# --------------------------------------------------------------------------- live server


def test_server_records_accepted_frames_and_flushes_within_a_second(tmp_path: Path) -> None:
    path = tmp_path / "live.ddpw"
    live = Recording(path)
    try:
        good = [sample(0, 1), sample(1, 1)]
        live.send(b"garbage", *good)
        live.wait_for(lambda s: s["stats"]["received"] == 2 and s["stats"]["rejected"] == 1, 5)
        sent = time.monotonic()
        while True:  # read the file while the server runs: flushed within ~1 s
            frames = [r.data for r in read_records(path) if r.kind == "frame"]
            if frames == good:
                break
            assert time.monotonic() - sent < 1.2, frames
            time.sleep(0.05)
        records = read_records(path)
        assert records[0].kind == "session"
        meta = records[0].session
        assert meta["thresholds"]["stall_after"] == 10.0 and meta["ticks"] is True
        assert meta["port"] == live.port
        assert any(r.kind == "tick" for r in records)
        times = [r.t for r in records[1:]]
        assert times == sorted(times)
    finally:
        live.stop()


def test_replay_raises_the_same_alerts_as_the_live_server(tmp_path: Path) -> None:
    path = tmp_path / "faulty.ddpw"
    live = Recording(path, Thresholds(silent_after=1.0, stall_after=3.0))
    try:
        for step in range(1, 6):
            live.send(*(sample(r, step) for r in range(3)))
            time.sleep(0.1)
        live.send(sample(1, 6, loss=float("nan")))
        for step in range(6, 26):  # rank 2 goes silent, rank 0 keeps going
            live.send(sample(0, step), sample(1, step))
            time.sleep(0.1)
        live.wait_for(lambda s: any(a["kind"] == "silent" for a in s["alerts"]), 5)
        for step in range(30, 45):  # rank 2 back for longer than the clear hold: silent clears
            live.send(sample(0, step), sample(1, step), sample(2, step))
            time.sleep(0.1)
        crash = Event(
            v=1, rank=0, t=time.time(), event="crash",
            error=ErrorInfo(type="RuntimeError", message="CUDA error: invalid device ordinal"),
        )  # fmt: skip
        live.send(encode(crash))
        live.wait_for(lambda s: any(a["kind"] == "crashed" for a in s["alerts"]), 5)
        time.sleep(1.5)
    finally:
        live.stop()
    expected = sequence(live.changes)
    kinds = {kind for _, kind, _ in expected}
    assert {"silent", "crashed", "nan_loss"} <= kinds, expected
    assert ("cleared", "silent", [2]) in expected
    replay, changes = replayed(path)
    assert sequence(changes) == expected
    # the final picture matches too (the live server's at its last tick)
    final = replay.status()
    assert [r.step for r in final.ranks] == [44, 44, 44]
    assert final.stats.received == live.server.state.received
    assert final.replay and final.replay.finished is True


def test_a_replay_knows_the_relays_and_their_pace_as_the_live_server_did(tmp_path: Path) -> None:
    """Rank 0 alone, ranks 1 and 2 through a relay at pace 2: the recording says which frames
    came in which batch (``route`` records), so the replay's relays and each rank's path
    (``RankRecord.relayed``: the silent allowance, a beat's weight) are the live server's."""
    path = tmp_path / "relayed.ddpw"
    live = Recording(path)
    try:
        for step in range(1, 5):
            frames = [sample(r, step) for r in (1, 2)]
            batch = Batch(
                v=1, relay="node-b:9", t=time.time(), host="node-b", seq=step - 1, every=2,
                frames=frames, ages_us=[1000, 2000], ranks=[1, 2], coalesced=1,
            )  # fmt: skip
            live.send(sample(0, step), encode(batch))
            if step == 4:
                live.send(sample(0, 5))  # alone again after the batch
            time.sleep(0.1)
        live.wait_for(lambda s: s["stats"]["received"] == 17, 5)
    finally:
        live.stop()
    routes = [r for r in read_records(path) if r.kind == "route"]
    assert [bool(r.data) for r in routes] == [True, False] * 4
    replay, _ = replayed(path)
    state, again = live.server.state, replay.engine.state
    assert {r: rec.relayed for r, rec in again.ranks.items()} == {0: 0, 1: 2, 2: 2}
    assert {r: rec.relayed for r, rec in state.ranks.items()} == {0: 0, 1: 2, 2: 2}
    ours, theirs = again.relays["node-b:9"], state.relays["node-b:9"]
    assert (ours.batches, ours.frames, ours.coalesced, ours.every, ours.ranks) == (
        theirs.batches, theirs.frames, theirs.coalesced, theirs.every, theirs.ranks
    ) == (4, 8, 4, 2, {1, 2})  # fmt: skip
    assert again.received == state.received == 17


def test_a_recording_from_before_routes_replays_every_rank_as_direct(tmp_path: Path) -> None:
    """An older recording has no ``route`` records: its frames came alone, as before."""
    path = tmp_path / "old.ddpw"
    recorder = Recorder(path, {"started": 1000.0})
    for step in range(1, 4):
        recorder.frame(1000.0 + step, sample(0, step))
    recorder.close()
    replay, _ = replayed(path)
    assert replay.engine.state.ranks[0].relayed == 0 and not replay.engine.state.relays


def test_replay_cli_headless_prints_the_live_stream(tmp_path: Path) -> None:
    path = tmp_path / "cli.ddpw"
    live = Recording(path, Thresholds(silent_after=0.6))
    try:
        live.send(sample(0, 1), sample(1, 1))
        live.wait_for(lambda s: any(a["kind"] == "silent" for a in s["alerts"]), 5)
        time.sleep(0.3)
    finally:
        live.stop()
    with path.open("ab") as file:
        file.write(b"\x10\x00\x00")  # a torn last write
    result = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "replay", str(path), "--headless", "--speed", "max"],
        capture_output=True, text=True, timeout=30, cwd=ROOT,
    )  # fmt: skip
    assert result.returncode == 0, result.stderr
    lines = [published("change", json.loads(line)) for line in result.stdout.splitlines()]
    assert lines == [c.to_dict() for c in live.changes]
    assert "partial record" in result.stderr and "3 bytes" in result.stderr


def test_replay_at_speed_follows_the_recorded_clock(tmp_path: Path) -> None:
    path = tmp_path / "timed.ddpw"
    recorder = Recorder(path, {"started": 1000.0, "ticks": True})
    for i in range(9):
        recorder.frame(1000.0 + i * 0.25, sample(0, i + 1))
        recorder.tick(1000.0 + i * 0.25)
    recorder.close()  # 2 s of recording
    for speed, low, high in ((4.0, 0.4, 1.5), (None, 0.0, 0.4)):
        replay = ReplayServer(path, speed=speed)
        started = time.monotonic()
        thread = threading.Thread(target=replay.run)
        thread.start()
        if speed:
            time.sleep(0.25)
            mid = replay.status()  # a view in the middle sees the virtual clock move
            assert 1000.0 < mid.server_time < 1002.0
            assert mid.replay and not mid.replay.finished
        thread.join(5)
        elapsed = time.monotonic() - started
        assert low <= elapsed <= high, (speed, elapsed)
        assert replay.status().server_time == 1002.0
        assert replay.status().ranks[0].step == 9


def test_replay_stops_when_asked(tmp_path: Path) -> None:
    path = tmp_path / "long.ddpw"
    recorder = Recorder(path, {"started": 0.0, "ticks": True})
    for i in range(40):
        recorder.tick(i * 0.25)
    recorder.close()  # 10 s
    replay = ReplayServer(path, speed=1.0)
    thread = threading.Thread(target=replay.run)
    thread.start()
    time.sleep(0.3)
    replay.stop()
    thread.join(2)
    assert not thread.is_alive()


def test_recording_without_ticks_gets_ticks_every_quarter_second(tmp_path: Path) -> None:
    """A recording written by another tool (no tick records): replay ticks on its own."""
    path = tmp_path / "plain.ddpw"
    t0 = 5000.0
    body = encode_record(0, t0, json.dumps({"started": t0, "thresholds": {}}).encode())
    for step in range(1, 5):
        for rank in range(2):
            body += encode_record(1, t0 + step * 0.5, sample(rank, step))
    body += encode_record(1, t0 + 10.0, sample(0, 20))  # rank 1 silent for 8 s
    path.write_bytes(MAGIC + body)
    replay, changes = replayed(path)
    assert ("raised", "silent", [1]) in sequence(changes)
    assert replay.messages == 9


def test_each_server_run_in_one_file_replays_from_a_fresh_state(tmp_path: Path) -> None:
    path = tmp_path / "two-runs.ddpw"
    for rank in (0, 1):
        live = Recording(path, Thresholds(silent_after=0.6))
        try:
            live.send(sample(rank, 1, world_size=2))
            live.wait_for(lambda s: s["alerts"], 5)
            time.sleep(0.3)
        finally:
            live.stop()
    expected = sequence(live.changes)
    replay, changes = replayed(path)
    assert replay.sessions == 2
    assert [r.rank for r in replay.status().ranks if r.state != "not_connected"] == [1]
    assert sequence(changes)[-len(expected) :] == expected


def test_replay_overrides_recorded_thresholds(tmp_path: Path) -> None:
    path = tmp_path / "override.ddpw"
    recorder = Recorder(path, {"started": 0.0, "ticks": True, "thresholds": {"silent_after": 1.0}})
    recorder.frame(0.0, sample(0, 1, world_size=1))
    for i in range(1, 13):
        recorder.tick(i * 0.25)
    recorder.close()
    _, changes = replayed(path)
    assert ("raised", "silent", [0]) in sequence(changes)
    replay, changes = replayed(path, overrides={"silent_after": 60.0})
    assert replay.thresholds.silent_after == 60.0
    assert changes == []


def test_replay_without_headless_opens_the_dashboard(tmp_path: Path, monkeypatch) -> None:
    import ddpwatch.tui.app as app

    path = tmp_path / "tui.ddpw"
    Recorder(path, {"started": 0.0}).close()
    shown: list[Any] = []

    def fake_dashboard(server: Any, **options: Any) -> int:
        server.run()
        shown.append(server.status())
        return 0

    monkeypatch.setattr(app, "run_dashboard", fake_dashboard)
    assert main(["replay", str(path)]) == 0
    assert shown and shown[0].replay and shown[0].replay.finished is True


def test_replay_without_a_dashboard_says_so(tmp_path: Path, monkeypatch, capsys) -> None:
    path = tmp_path / "tui.ddpw"
    Recorder(path, {"started": 0.0}).close()
    monkeypatch.setitem(sys.modules, "ddpwatch.tui.app", None)  # import fails
    assert main(["replay", str(path)]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "--headless" in err


def test_serve_with_an_unwritable_record_path_fails_in_one_line(tmp_path: Path) -> None:
    (tmp_path / "notes").write_text("not a recording")
    for target in (tmp_path / "no" / "such" / "dir" / "x.ddpw", tmp_path / "notes"):
        result = subprocess.run(
            [sys.executable, "-m", "ddpwatch", "serve", "--headless",
             "--port", str(free_port_pair()), "--record", str(target)],
            capture_output=True, text=True, timeout=30, cwd=ROOT,
        )  # fmt: skip
        assert result.returncode == 1
        assert result.stderr.strip().count("\n") == 0, result.stderr
    assert (tmp_path / "notes").read_text() == "not a recording"


def test_replay_of_a_missing_file_fails_in_one_line(tmp_path: Path, capsys) -> None:
    assert main(["replay", str(tmp_path / "missing"), "--headless"]) == 1
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "cannot open" in err
