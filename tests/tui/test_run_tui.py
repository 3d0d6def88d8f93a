"""``ddpwatch run --tui``: one command runs the job and the dashboard in a real terminal."""

from __future__ import annotations

import os
import re
import sys
from pathlib import Path

import pytest
from conftest import EXAMPLES, SCRIPTS, free_port_pair
from terminal import Terminal


@pytest.mark.e2e
def test_run_tui_shows_the_ranks_their_output_and_the_job_output() -> None:
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    command = [
        sys.executable, "-m", "ddpwatch", "run", "--tui", "--",
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=2",
        "--master-addr=127.0.0.1", f"--master-port={free_port_pair()}", str(SCRIPTS / "unmodified.py"),
    ]  # fmt: skip
    terminal = Terminal(command, env)
    try:
        screen = terminal.wait_for("job exited 0", "ranks 2/2", timeout=90)
        rows = [line for line in screen.splitlines() if re.match(r"^[ >]\s+[01]\s+[01]\s", line)]
        assert len(rows) == 2 and all(" exited " in row and " 48 " in row for row in rows), screen

        terminal.press("\r")  # the detail pane of the cursor rank: its own last output lines
        terminal.wait_for("output (last lines)", "loading data")

        terminal.press("o")  # the whole job's output, the launcher's messages included
        screen = terminal.wait_for("job output", "OMP_NUM_THREADS")
        assert screen.count("loading data") >= 2, screen
        terminal.press("o")
        terminal.wait_gone("job output")

        terminal.press("q")
        assert terminal.wait_exit() == 0  # the job's exit code
        match = re.search(rb"the job's output is in (\S+\.log)", bytes(terminal.raw))
        assert match, bytes(terminal.raw[-2000:])
        output = Path(match.group(1).decode()).read_text()
        assert output.count("loading data") == 2, output
        Path(match.group(1).decode()).unlink()
    finally:
        terminal.close()


@pytest.mark.e2e
def test_run_tui_says_when_the_job_fails_to_start() -> None:
    """A job that dies before any rank reports: the header says so and ``o`` shows why."""
    command = [
        sys.executable, "-m", "ddpwatch", "run", "--tui", "--",
        sys.executable, "-c", "raise SystemExit('no such dataset: /data/imagenet')",
    ]  # fmt: skip
    terminal = Terminal(command, dict(os.environ))
    try:
        terminal.wait_for("job exited 1", timeout=30)
        terminal.press("o")
        terminal.wait_for("no such dataset: /data/imagenet")
        terminal.press("\x1b")  # esc closes it
        terminal.wait_gone("job output")
        terminal.press("q")
        assert terminal.wait_exit() == 1
    finally:
        terminal.close()


@pytest.mark.e2e
def test_run_tui_tells_a_gloo_abort_in_the_backends_own_words(tmp_path: Path) -> None:
    """Issue #34: under ``run --tui`` the job's output goes to a log, not through ddpwatch;
    the log is followed, so a rank gloo aborts from C++ (pytorch/pytorch#150248's dtype
    mismatch) is told as crashed with gloo's exception and SIGABRT, from its black box."""
    env = {k: v for k, v in os.environ.items() if k != "OMP_NUM_THREADS"}
    env.update(TMPDIR=str(tmp_path), DDPWATCH_BOX_DIR=str(tmp_path), OMP_NUM_THREADS="1")
    command = [
        sys.executable, "-m", "ddpwatch", "run", "--tui", "--no-record", "--",
        sys.executable, "-m", "torch.distributed.run", "--nproc-per-node=3",
        "--master-addr=127.0.0.1", f"--master-port={free_port_pair()}",
        str(EXAMPLES / "failures.py"), "--mode", "metric-dtype",
    ]  # fmt: skip
    terminal = Terminal(command, env)
    try:
        terminal.wait_for("job exited 1", timeout=120)
        terminal.press("q")
        assert terminal.wait_exit(timeout=60) == 1
        err = bytes(terminal.raw).decode(errors="replace").replace("\r\n", "\n")
    finally:
        terminal.close()
    summary = err[err.index("── summary") :]
    ranks = next(line for line in summary.splitlines() if "ranks:" in line)
    assert "crashed (gloo::EnforceNotMet), SIGABRT" in ranks, summary
    assert "rank 1 made collective calls that did not match the others'" in summary, summary


def test_the_output_screen_follows_a_file_in_whole_lines(tmp_path: Path) -> None:
    from ddpwatch.tui.screens.output import FileFollower

    path = tmp_path / "job.log"
    follower = FileFollower(str(path), first_read=16)
    assert follower.read_new_lines() == []  # no file yet
    path.write_bytes(b"old line one\nold line two\nlast\n")
    assert follower.read_new_lines() == ["last"]  # from its end, whole lines only
    with path.open("ab") as f:
        f.write(b"step 1\r\nhalf a li")
    assert follower.read_new_lines() == ["step 1"]
    with path.open("ab") as f:
        f.write(b"ne\n\xff\n")
    assert follower.read_new_lines() == ["half a line", "\ufffd"]
    path.write_bytes(b"restarted\n")  # truncated: start again from its end
    assert follower.read_new_lines() == ["restarted"]


def test_the_header_says_how_the_job_ended() -> None:
    from ddpwatch.tui.data.sources import exit_description

    assert exit_description(None) == "running"
    assert exit_description(0) == "exited 0"
    assert exit_description(2) == "exited 2"
    assert exit_description(-9) == "killed by SIGKILL"
    assert exit_description(-200) == "killed by signal 200"
