"""A job that never started: ``ddpwatch run`` says so and why (``launch_failure.py``), from the
job's stderr, which still reaches the terminal byte for byte (``job_output.py``)."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest
from conftest import SCRIPTS, LiveServer, as_json, ddpwatch_run, free_port_pair
from terminal import Terminal

from ddpwatch.jobs.output import OutputTail, StderrTee, tail_of_file


def test_the_tail_keeps_the_first_and_last_lines_as_the_terminal_shows_them() -> None:
    tail = OutputTail(head=2, keep=3)
    tail.feed(b"one\ntw")
    tail.feed(b"o\nthree\n 10%\r 50%\r100%\r\n")
    tail.feed(b"".join(b"line %d\n" % i for i in range(10)) + b"unfinished \xff")
    assert tail.lines() == ["one", "two", "line 7", "line 8", "line 9", "unfinished \ufffd"]
    endless = OutputTail()
    endless.feed(b"\r".join(b"step %d" % i for i in range(100_000)))  # no \n for hours
    assert endless.lines() == ["step 99999"]


def test_the_tail_of_a_log_file(tmp_path: Path) -> None:
    log = tmp_path / "job.log"
    log.write_bytes(b"".join(b"line %d\n" % i for i in range(100_000)))
    lines = tail_of_file(str(log), head=2, keep=3)
    assert lines == ["line 0", "line 1", "line 99997", "line 99998", "line 99999"]
    log.write_bytes(b"a\nb\r\nc")
    assert tail_of_file(str(log)) == ["a", "b", "c"]
    assert tail_of_file(str(tmp_path / "none.log")) == []


# ------------------------------------------------------------------ stderr, passed through


def test_stderr_through_a_pipe_is_byte_for_byte(tmp_path: Path) -> None:
    out = tmp_path / "stderr.bin"
    payload = b"\rtrain 1/2 \x1b[32m#\x1b[0m\rtrain 2/2 \x1b[32m##\x1b[0m\n\xff\xfe no newline"
    with out.open("wb") as target:
        tee = StderrTee(target_fd=target.fileno())
        assert not tee.is_pty  # a file is no terminal: the job gets a pipe
        job = subprocess.Popen(
            [sys.executable, "-c", "import sys; sys.stderr.buffer.write(sys.stdin.buffer.read())"],
            stdin=subprocess.PIPE, stderr=tee.child_fd,
        )  # fmt: skip
        tee.started()
        job.communicate(payload)
        lines = tee.finish(timeout=30)
    assert out.read_bytes() == payload
    assert lines == ["train 2/2 \x1b[32m##\x1b[0m", "\ufffd\ufffd no newline"]


def test_a_reader_gone_never_blocks_the_job() -> None:
    """ddpwatch's own stderr closed (``ddpwatch run ... 2>&1 | head -1``): the tee stops
    writing and goes on reading, so the job writes on as if nothing happened."""
    read_end, write_end = os.pipe()
    os.close(read_end)
    try:
        tee = StderrTee(target_fd=write_end)
        job = subprocess.Popen(
            [sys.executable, "-c", "import sys; [sys.stderr.write('x' * 99 + '\\n') "
             "for _ in range(20_000)]; sys.stderr.write('last\\n')"],
            stderr=tee.child_fd,
        )  # fmt: skip
        tee.started()
        assert job.wait(30) == 0
        assert tee.finish(timeout=30)[-1] == "last"
    finally:
        os.close(write_end)


def _raw_terminal_run(command: list[str]) -> tuple[int, bytes]:
    terminal = Terminal(command, dict(os.environ), columns=97, lines=31)
    try:
        code = terminal.wait_exit(timeout=90)
        return code, bytes(terminal.raw)
    finally:
        terminal.close()


def test_on_a_terminal_the_job_still_has_one_and_its_bytes_arrive_unchanged() -> None:
    """Without torch: the job's stderr is a pty as wide as the terminal, raw on output (the
    real terminal turns \\n into \\r\\n once, as before), and a job that ended well without
    ranks is not called one that did not start."""
    script = (
        "import os, sys; e = sys.stderr; "
        "e.write(f'isatty={e.isatty()} size={tuple(os.get_terminal_size(2))}\\n'); "
        "e.write('\\r 10%\\r 50%\\x1b[1m\\r100%\\x1b[0m\\n'); e.flush()"
    )
    code, raw = _raw_terminal_run(
        [sys.executable, "-m", "ddpwatch", "run", "--no-record", "--", sys.executable, "-c", script]
    )
    assert code == 0, raw
    assert b"isatty=True size=(97, 31)\r\n\r 10%\r 50%\x1b[1m\r100%\x1b[0m\r\n" in raw, raw
    assert b"verdict: " in raw and b"did not start" not in raw


def test_a_launcher_failing_without_a_known_reason_says_its_code_and_last_line() -> None:
    script = "import sys; print('loading', flush=True); sys.exit('no such dataset: /data/x')"
    result = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "run", "--no-record", "--", sys.executable, "-c",
         script],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 1
    assert result.stdout == "loading\n"  # stdout is the job's own, untouched
    assert "no such dataset: /data/x\n" in result.stderr
    assert result.stderr.rstrip().endswith(
        "verdict: the job did not start: the launcher exited with code 1; its last line: "
        "no such dataset: /data/x"
    ), result.stderr


def test_the_dashboard_run_reads_the_reason_from_its_log(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    from ddpwatch.diagnosis.alerts import Thresholds
    from ddpwatch.jobs.launch import _with_dashboard
    from ddpwatch.server.service import Server

    log = tmp_path / "job.log"
    line = "/usr/bin/python3: can't open file '/x/train.py': [Errno 2] No such file or directory"
    with log.open("wb") as output:
        job = subprocess.Popen(
            [sys.executable, "-c", f"import sys; print({line!r}); sys.exit(2)"],
            stdout=output, stderr=subprocess.STDOUT,
        )  # fmt: skip

    def dashboard(source: Any, **kwargs: Any) -> None:
        job.wait()  # the user watches until the job has ended, then quits

    monkeypatch.setattr("ddpwatch.tui.app.show_dashboard", dashboard)
    server = Server("127.0.0.1", free_port_pair(), Thresholds())
    assert _with_dashboard(server, job, str(log)) == 2
    err = capsys.readouterr().err
    assert "verdict: the job did not start: the script /x/train.py was not found" in err, err


# ------------------------------------------------------------------ real torchrun failures


def _torchrun(*args: str) -> list[str]:
    return [sys.executable, "-m", "torch.distributed.run", *args]


def _run(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "ddpwatch", "run", "--no-record", "--", *command],
        capture_output=True, text=True, timeout=90,
    )  # fmt: skip


def _verdict(stderr: str) -> str:
    verdicts = [line for line in stderr.splitlines() if line.startswith("ddpwatch: verdict: ")]
    assert len(verdicts) == 1, stderr
    return verdicts[0].removeprefix("ddpwatch: verdict: ")


@pytest.mark.e2e
def test_real_torchrun_with_a_missing_script(tmp_path: Path) -> None:
    script = tmp_path / "missing.py"
    result = _run(*_torchrun("--nproc-per-node=2", "--master-addr=127.0.0.1",
                             f"--master-port={free_port_pair()}", str(script)))  # fmt: skip
    assert result.returncode != 0
    assert f"can't open file '{script}'" in result.stderr  # the launcher's own words, shown
    assert _verdict(result.stderr) == (
        f"the job did not start: the script {script} was not found: check its path"
    )
    assert "0 ranks seen" in result.stderr


@pytest.mark.e2e
def test_real_torchrun_whose_master_port_is_held(tmp_path: Path) -> None:
    port = free_port_pair()
    holder = subprocess.Popen(
        [sys.executable, "-c", "import socket, sys, time; s = socket.socket(); "
         f"s.bind(('127.0.0.1', {port})); s.listen(); print('held', flush=True); time.sleep(60)"],
        stdout=subprocess.PIPE, text=True,
    )  # fmt: skip
    try:
        assert holder.stdout is not None and holder.stdout.readline() == "held\n"
        result = _run(*_torchrun("--nproc-per-node=2", "--master-addr=127.0.0.1",
                                 f"--master-port={port}", str(SCRIPTS / "progress_bar.py")))  # fmt: skip
    finally:
        holder.kill()
        holder.wait(10)
    assert result.returncode != 0
    assert "EADDRINUSE" in result.stderr
    verdict = _verdict(result.stderr)
    assert verdict.startswith(
        f"the job did not start: port {port} is already in use on this node by pid {holder.pid} "
        f"(python"
    ), verdict


@pytest.mark.e2e
def test_real_healthy_run_on_a_terminal_is_unchanged_and_started() -> None:
    code, raw = _raw_terminal_run(
        [sys.executable, "-m", "ddpwatch", "run", "--no-record", "--",
         *_torchrun("--nproc-per-node=2", "--master-addr=127.0.0.1",
                    f"--master-port={free_port_pair()}", str(SCRIPTS / "progress_bar.py"))]
    )  # fmt: skip
    assert code == 0, raw
    bars = "".join(f"\rtrain {step}/5 \x1b[32m{'#' * step}\x1b[0m" for step in range(1, 6))
    expected = f"stderr isatty=True size=(97, 31)\n{bars}\n".replace("\n", "\r\n")
    assert expected.encode() in raw, raw
    assert b"verdict: " in raw and b"did not start" not in raw, raw


@pytest.mark.e2e
def test_real_remote_run_says_this_node_did_not_start(
    live_server: LiveServer, tmp_path: Path
) -> None:
    script = tmp_path / "missing.py"
    result = ddpwatch_run(
        live_server, *_torchrun("--nproc-per-node=1", "--master-addr=127.0.0.1",
                                f"--master-port={free_port_pair()}", str(script)),
    )  # fmt: skip
    assert result.returncode != 0
    lines = result.stderr.strip().splitlines()
    assert lines[-1] == (
        f"ddpwatch run: the job did not start on this node: the script {script} was not found: "
        "check its path"
    ), result.stderr
    time.sleep(0.2)
    assert as_json(live_server.server.status())["ranks"] == []
