"""The black box (``agent/blackbox.py``, ``core/blackbox.py``): what a rank that a fatal signal
ends leaves behind, written by real processes that really abort."""

from __future__ import annotations

import faulthandler
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import torch

from ddpwatch.agent.blackbox import ORPHAN_AFTER_S, BlackBox
from ddpwatch.agent.calls import CallDigests
from ddpwatch.agent.progress import Progress
from ddpwatch.core.blackbox import NAME, read_box

ABORTING = textwrap.dedent(
    """
    import os, sys, threading, time
    import torch
    from ddpwatch.agent.blackbox import BlackBox
    from ddpwatch.agent.calls import CallDigests
    from ddpwatch.agent.progress import Progress

    progress = Progress()
    progress.box = BlackBox.open(2, CallDigests(progress).exact, sys.argv[1])
    print(progress.box.name, flush=True)
    progress.enter_collective("broadcast", torch.ones(3, dtype=torch.float64), root=1)
    progress.exit_collective()
    progress.end_step()
    progress.set_phase("forward")
    progress.enter_collective("all_reduce", torch.ones(2))

    def gloo_thread():  # the backend's own thread aborts, as gloo's does
        time.sleep(0.2)
        os.abort()

    def in_the_collective():  # the training thread waits in C++ meanwhile
        time.sleep(10)

    threading.Thread(target=gloo_thread).start()
    in_the_collective()
    """
)


def run_aborting(folder: Path) -> tuple[subprocess.CompletedProcess[str], Path]:
    done = subprocess.run(
        [sys.executable, "-c", ABORTING, str(folder)],
        capture_output=True,
        text=True,
        timeout=60,
    )
    return done, folder / done.stdout.split()[0]


def test_a_rank_that_aborts_inside_a_collective_leaves_the_call_and_its_stack(
    tmp_path: Path,
) -> None:
    done, path = run_aborting(tmp_path)
    assert done.returncode == -6, done.stderr  # the same death: SIGABRT, not an exit code
    assert "Fatal Python error" not in done.stderr  # the dump went to the box, not stderr
    assert NAME.match(path.name)
    reading = read_box(str(path))
    assert reading is not None
    assert (reading.rank, reading.seq, reading.in_call) == (2, 2, True)
    assert reading.call == ("all_reduce", "float32", 2, "sum", None)
    assert (reading.step, reading.phase) == (1, "forward")
    assert reading.signal == "SIGABRT"
    # the main thread's stack, in traceback's order, not the aborting thread's
    assert reading.stack is not None
    lines = reading.stack.splitlines()
    assert lines[-1].endswith("in in_the_collective"), reading.stack
    assert "gloo_thread" not in reading.stack
    assert reading.dump is not None and "gloo_thread" in reading.dump


def test_the_box_says_when_the_rank_left_the_collective(tmp_path: Path) -> None:
    progress = Progress()
    box = BlackBox.open(0, CallDigests(progress).words, str(tmp_path))
    assert box is not None
    progress.box = box
    try:
        progress.enter_collective("all_gather", torch.ones(4), counted=False)
        reading = read_box(box.path)
        assert reading is not None and reading.in_call and reading.seq == 0
        assert reading.call is not None and reading.call[0] == "all_gather"
        progress.exit_collective()
        reading = read_box(box.path)
        assert reading is not None and not reading.in_call
        assert reading.signal is None and reading.dump is None  # alive: no dump
        progress.enter_collective("barrier")
    finally:
        box.close()
    assert not os.path.exists(box.path)  # a clean end leaves nothing to read
    progress.exit_collective()  # a call still in flight at the end: no error in training
    progress.enter_collective("all_reduce", torch.ones(1))
    progress.exit_collective()


def test_a_process_with_faulthandler_of_its_own_keeps_it(tmp_path: Path) -> None:
    was = faulthandler.is_enabled()
    faulthandler.enable()
    try:
        box = BlackBox.open(0, CallDigests(Progress()).words, str(tmp_path))
        assert box is not None and not box.dumps
        box.close()
        assert faulthandler.is_enabled()  # the user's, untouched
    finally:
        if not was:
            faulthandler.disable()


def test_boxes_of_processes_gone_are_removed_by_the_next_agent(tmp_path: Path) -> None:
    _, path = run_aborting(tmp_path)  # its process is gone, its box left
    assert path.exists()
    (tmp_path / "notes.txt").write_text("not a box")
    old = path.stat().st_mtime - ORPHAN_AFTER_S
    os.utime(path, (old, old))
    box = BlackBox.open(1, CallDigests(Progress()).words, str(tmp_path))
    assert box is not None
    try:
        assert not path.exists()
        assert (tmp_path / "notes.txt").exists()  # only box names are touched
        assert os.path.exists(box.path)
    finally:
        box.close()


def test_a_box_its_reader_has_not_read_yet_is_kept_by_the_next_agent(tmp_path: Path) -> None:
    """A rank gloo aborted a second ago, while another job's (or the next attempt's) ranks
    start on the same host: the reader, a second later, still finds the box (the CI run of
    cd5a582 lost a victim's box, and with it how it called the collective, this way)."""
    _, path = run_aborting(tmp_path)
    box = BlackBox.open(1, CallDigests(Progress()).words, str(tmp_path))
    assert box is not None
    try:
        assert path.exists()
        reading = read_box(str(path))
        assert reading is not None and reading.signal == "SIGABRT"
    finally:
        box.close()


def test_files_that_are_not_boxes_read_as_none(tmp_path: Path) -> None:
    assert read_box(str(tmp_path / "missing.box")) is None
    junk = tmp_path / "junk.box"
    junk.write_bytes(b"\x00" * 5000)
    assert read_box(str(junk)) is None
    truncated = tmp_path / "short.box"
    truncated.write_bytes(b"DDPWBOX1")
    assert read_box(str(truncated)) is None
