"""The server reads the black box of a late rank on its own host (``core/boxreader.py``): a rank a
fatal signal ended is taken as exited by it, inside the collective it was in; a box without a
dump, another host's rank, or a name the agent never makes says nothing."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import msgspec
import pytest
from conftest import aborted_box

from ddpwatch.agent.blackbox import BlackBox
from ddpwatch.agent.calls import CallDigests
from ddpwatch.agent.progress import Progress
from ddpwatch.core.boxreader import BackendAbort, BoxReader
from ddpwatch.core.protocol import Event, Hello, Sample
from ddpwatch.core.vocabulary import CollectiveSource
from ddpwatch.state.state import ServerState


@pytest.fixture(scope="module")
def aborted(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, str, int]:
    """A folder holding the box of a process that aborted in all_reduce #20, its name and
    the process's pid (made once: the tests copy it)."""
    folder = tmp_path_factory.mktemp("boxes")
    name, pid = aborted_box(folder)
    return folder, name, pid


def known_rank(state: ServerState, box: str, pid: int, host: str, at: float) -> None:
    state.apply(Hello(v=1, rank=1, t=at, host=host, pid=pid, box=box), at)
    state.apply(Sample(v=1, rank=1, t=at, step=17, phase="forward"), at)


def copy_of(aborted: tuple[Path, str, int], into: Path) -> tuple[str, int]:
    folder, name, pid = aborted
    shutil.copy(folder / name, into / name)
    return name, pid


def watching(
    folder: Path, name: str, pid: int, host: str, reader_host: str = "node-a"
) -> tuple[ServerState, BoxReader]:
    """A server's state that knows rank 1 (box ``name``, process ``pid``, on ``host``) last
    heard at 10.0, and a reader of ``folder`` on ``reader_host``."""
    state = ServerState(started=0.0)
    known_rank(state, name, pid, host, 10.0)
    return state, BoxReader(str(folder), host=reader_host)


def test_a_late_rank_killed_by_a_signal_exits_inside_its_collective(
    aborted: tuple[Path, str, int], tmp_path: Path
) -> None:
    name, pid = copy_of(aborted, tmp_path)
    state, reader = watching(tmp_path, name, pid, "node-a")
    assert reader.due(state.ranks.values(), 10.5, late_s=1.0) == []  # not late yet
    (event, died), = reader.due(state.ranks.values(), 12.0, late_s=1.0)
    assert 10.0 <= died <= 12.0
    assert (event.event, event.signal, event.step, event.phase) == ("exit", "SIGABRT", 19, "started")
    c = event.collective
    assert c is not None
    assert (c.op, c.seq, c.dtype, c.shape) == ("all_reduce", 20, "float32", [1])
    assert c.source == CollectiveSource.PY
    assert event.stack is not None and "time.sleep" not in event.stack
    assert not (tmp_path / name).exists()  # read once: gone
    state.apply(event, died)
    record = state.ranks[1]
    assert record.exit_signal == "SIGABRT" and record.exit_time == died
    assert record.final_collective is not None and record.final_collective.seq == 20
    assert record.stack == event.stack
    assert reader.due(state.ranks.values(), 14.0, late_s=1.0) == []  # said once


def test_a_box_named_in_a_later_hello_is_read_as_soon_as_its_rank_is_late(
    aborted: tuple[Path, str, int], tmp_path: Path
) -> None:
    """The boot hook's early hello names no box (the agent opens it later): the same rank
    count then, and no rescan due, but the box is read once the next hello names it."""
    name, pid = copy_of(aborted, tmp_path)
    state = ServerState(started=0.0)
    state.apply(Hello(v=1, rank=1, t=1.0, host="node-a", pid=pid), 1.0)
    reader = BoxReader(str(tmp_path), host="node-a")
    assert reader.due(state.ranks.values(), 1.5, late_s=1.0) == []  # scanned: no box yet
    known_rank(state, name, pid, "node-a", 2.0)
    (event, _), = reader.due(state.ranks.values(), 3.5, late_s=1.0)  # well within RESCAN_S
    assert (event.rank, event.signal) == (1, "SIGABRT")


def test_once_the_job_has_ended_every_box_is_read_however_recently_its_rank_spoke(
    aborted: tuple[Path, str, int], tmp_path: Path
) -> None:
    """``ddpwatch run``'s last tick comes as the launcher exits, a fraction of a second after
    gloo aborted a rank: not late yet, and maybe inside its retry; the box is read all the same."""
    name, pid = copy_of(aborted, tmp_path)
    state, reader = watching(tmp_path, name, pid, "node-a")
    assert reader.due(state.ranks.values(), 10.2, late_s=1.0) == []
    (event, died), = reader.due(state.ranks.values(), 10.3, late_s=1.0, ended=True)
    assert event.signal == "SIGABRT" and 10.0 <= died <= 10.3


def test_a_box_says_nothing_of_a_rank_on_another_host(
    aborted: tuple[Path, str, int], tmp_path: Path
) -> None:
    name, pid = copy_of(aborted, tmp_path)
    state, reader = watching(tmp_path, name, pid, "node-b")
    assert reader.due(state.ranks.values(), 20.0, late_s=1.0) == []
    assert (tmp_path / name).exists()  # not ours to take


def test_a_box_of_another_process_or_a_name_not_made_by_the_agent_is_not_read(
    aborted: tuple[Path, str, int], tmp_path: Path
) -> None:
    name, pid = copy_of(aborted, tmp_path)
    state, reader = watching(tmp_path, name, pid + 1, "node-a")  # another process's box
    assert reader.due(state.ranks.values(), 20.0, late_s=1.0) == []
    os.rename(tmp_path / name, tmp_path / "passwd")
    state, reader = watching(tmp_path, "../passwd", pid, "node-a")
    assert reader.due(state.ranks.values(), 20.0, late_s=1.0) == []


def test_a_box_without_a_dump_is_read_again_until_the_rank_says_how_it_ended(
    tmp_path: Path,
) -> None:
    box = BlackBox.open(1, CallDigests(Progress()).exact, str(tmp_path))
    assert box is not None
    try:
        state, reader = watching(tmp_path, box.name, os.getpid(), "node-a")
        assert reader.due(state.ranks.values(), 12.0, late_s=1.0) == []  # slow, not dead
        assert reader.due(state.ranks.values(), 12.5, late_s=1.0) == []  # read once a second
        state.apply(Event(v=1, rank=1, t=13.0, event="exit", exit_code=0), 13.0)
        assert reader.due(state.ranks.values(), 20.0, late_s=1.0) == []
    finally:
        box.close()


def two_aborted(
    aborted: tuple[Path, str, int], into: Path
) -> tuple[ServerState, BoxReader]:
    """Ranks 1 and 3 on this host, both dead of SIGABRT (one box copied under two names)."""
    folder, name, pid = aborted
    state = ServerState(started=0.0)
    for rank in (1, 3):
        copied = f"{rank}-{pid}-{'0' * 16}.box"
        data = bytearray((folder / name).read_bytes())
        header = len(b"DDPWBOX1")  # the header's rank: rewritten for rank 3
        said = msgspec.msgpack.encode([pid, rank, 0])
        data[header] = len(said)
        data[header + 1 : header + 1 + len(said)] = said
        (into / copied).write_bytes(bytes(data))
        state.apply(Hello(v=1, rank=rank, t=10.0, host="node-a", pid=pid, box=copied), 10.0)
    return state, BoxReader(str(into), host="node-a")


def test_the_backends_words_go_to_the_rank_that_aborted_when_they_can_be_told_apart(
    aborted: tuple[Path, str, int], tmp_path: Path
) -> None:
    name, pid = copy_of(aborted, tmp_path)
    state = ServerState(started=0.0)
    known_rank(state, name, pid, "node-a", 10.0)
    reader = BoxReader(str(tmp_path), host="node-a")
    gloo = BackendAbort(11.0, "gloo::EnforceNotMet", "Received data size doesn't match")
    reader.note_abort(BackendAbort(-100.0, "std::bad_alloc", "long before"))  # not this death
    reader.note_abort(gloo)
    (crash, died), (exit_, _) = reader.due(state.ranks.values(), 12.0, late_s=1.0)
    assert crash.event == "crash" and exit_.event == "exit"
    assert crash.error is not None
    assert (crash.error.type, crash.error.message) == (gloo.type, gloo.message)
    # the crash says where, as the rank's own would: what a mismatch compares, whatever
    # tick takes the exit after it (``ddpwatch run``'s last one, under load)
    assert crash.collective is not None and (crash.collective.seq, crash.collective.dtype) == (
        20,
        "float32",
    )
    state.apply(crash, died)
    state.apply(exit_, died)
    record = state.ranks[1]
    assert record.error is not None and record.error.type == "gloo::EnforceNotMet"
    assert record.exit_signal == "SIGABRT"


def test_two_ranks_aborted_at_once_get_a_message_only_where_it_says_whose(
    aborted: tuple[Path, str, int], tmp_path: Path
) -> None:
    state, reader = two_aborted(aborted, tmp_path)
    reader.note_abort(BackendAbort(11.0, "gloo::EnforceNotMet", "8 vs 4"))
    reader.note_abort(BackendAbort(11.0, "gloo::EnforceNotMet", "16 vs 4"))
    events = reader.due(state.ranks.values(), 12.0, late_s=1.0)
    assert sorted(e.event for e, _ in events) == ["exit", "exit"]  # which is whose: not told

    state, reader = two_aborted(aborted, tmp_path)
    reader.note_abort(BackendAbort(11.0, "c10::DistBackendError", "[Rank 3] watchdog", rank=3))
    reader.note_abort(BackendAbort(11.0, "gloo::EnforceNotMet", "8 vs 4"))
    events = reader.due(state.ranks.values(), 12.0, late_s=1.0)
    crashes = {e.rank: e.error.type for e, _ in events if e.error is not None}
    assert crashes == {3: "c10::DistBackendError", 1: "gloo::EnforceNotMet"}

    state, reader = two_aborted(aborted, tmp_path)
    same = BackendAbort(11.0, "gloo::EnforceNotMet", "8 vs 4")
    reader.note_abort(same)
    reader.note_abort(same)  # word for word the same: each one's
    events = reader.due(state.ranks.values(), 12.0, late_s=1.0)
    assert sorted(e.rank for e, _ in events if e.error is not None) == [1, 3]


def test_once_the_job_has_ended_the_boxes_of_ranks_that_said_how_they_ended_are_removed(
    aborted: tuple[Path, str, int], tmp_path: Path
) -> None:
    """A rank removes its box once it has said how it ended; one killed while it flushed
    that word leaves it (seen once, loaded). At the job's end the reader removes it if its
    process is gone, and tells nothing from it; a live process's stays, for its agent."""
    name, pid = copy_of(aborted, tmp_path)  # a process long gone
    state, reader = watching(tmp_path, name, pid, "node-a")
    state.apply(Event(v=1, rank=1, t=11.0, event="exit", signal="SIGTERM"), 11.0)
    assert reader.due(state.ranks.values(), 11.5, late_s=1.0) == []  # not over: kept
    assert (tmp_path / name).exists()
    assert reader.due(state.ranks.values(), 12.0, late_s=1.0, ended=True) == []
    assert not (tmp_path / name).exists()
    box = BlackBox.open(1, CallDigests(Progress()).exact, str(tmp_path))  # this process
    assert box is not None
    try:
        state, reader = watching(tmp_path, box.name, os.getpid(), "node-a")
        state.apply(Event(v=1, rank=1, t=11.0, event="exit", exit_code=0), 11.0)
        assert reader.due(state.ranks.values(), 12.0, late_s=1.0, ended=True) == []
        assert (tmp_path / box.name).exists()
    finally:
        box.close()
