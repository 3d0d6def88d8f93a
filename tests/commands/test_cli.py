"""The command line as a new user meets it: port flags, and what ``ddpwatch run`` prints."""

from __future__ import annotations

import io
import os
import re
import shlex
import socket
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import free_port_pair

from ddpwatch.cli import main
from ddpwatch.jobs.emphasis import ASCII_MARK, MARK, colour_wanted, emphasize, mark_for
from ddpwatch.jobs.launch import run_command

# ------------------------------------------------------------------------------------ port flags

RANK_PORT = "must be 1-65534 (queries use port+1)"


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["serve", "--port", "99999"], f"argument --port: {RANK_PORT}, got 99999"),
        (["serve", "--port", "0"], f"argument --port: {RANK_PORT}, got 0"),
        (["serve", "--port", "65535"], f"argument --port: {RANK_PORT}, got 65535"),
        (
            ["serve", "--prometheus-port", "99999"],
            "argument --prometheus-port: must be 1-65535, got 99999",
        ),
        (["serve", "--prometheus-port", "0"], "argument --prometheus-port: must be 1-65535, got 0"),
        (["status", "--port", "abc"], "argument --port: must be a number, got 'abc'"),
        (["top", "--port", "-1"], f"argument --port: {RANK_PORT}, got -1"),
        (["web", "--port", "70000"], f"argument --port: {RANK_PORT}, got 70000"),
        (["web", "--web-port", "99999"], "argument --web-port: must be 1-65535, got 99999"),
        (["demo", "--port", "0"], f"argument --port: {RANK_PORT}, got 0"),
        (
            ["run", "--addr", "node0:99999", "--", "true"],
            f"argument --addr: node0:99999: the port {RANK_PORT}, got 99999",
        ),
        (
            ["run", "--addr", "tcp://node0:0", "--", "true"],
            f"argument --addr: tcp://node0:0: the port {RANK_PORT}, got 0",
        ),
        (
            ["run", "--addr", "node0:x", "--", "true"],
            "argument --addr: node0:x: the port must be a number, got 'x'",
        ),
    ],
)
def test_an_impossible_port_is_a_one_line_usage_error(argv, message, capsys) -> None:
    with pytest.raises(SystemExit) as exited:
        main(argv)
    assert exited.value.code == 2
    err = capsys.readouterr().err
    assert err.splitlines()[-1] == f"ddpwatch {argv[0]}: error: {message}"
    assert "Traceback" not in err


@pytest.mark.parametrize(
    "addr", ["node0", "node0:5599", "tcp://10.0.0.1:65534", "[::1]:5599", "::1", "[fe80::1]"]
)
def test_run_accepts_every_address_form_the_ranks_read(addr: str) -> None:
    from ddpwatch.cli import build_parser

    assert build_parser().parse_args(["run", "--addr", addr, "--", "true"]).addr == addr


def test_prometheus_port_out_of_range_no_longer_crashes_serve() -> None:
    """It used to reach the HTTP server and end in an OverflowError traceback."""
    result = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(free_port_pair()), "--prometheus-port", "99999"],
        capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert result.returncode == 2
    assert result.stderr.splitlines()[-1] == (
        "ddpwatch serve: error: argument --prometheus-port: must be 1-65535, got 99999"
    )
    assert "Traceback" not in result.stderr


# ------------------------------------------------------------------------ what `run` prints

BANNER = re.compile(
    r"^ddpwatch run: watching `(?P<command>[^`]*)` on 127\.0\.0\.1:(?P<port>\d+)"
    r"(?P<busy> \(\d+ was busy\))?; alerts appear here, marked ▶$"
)
CRASH = """
import time, torch.distributed as dist
dist.init_process_group("gloo", init_method="tcp://127.0.0.1:{port}", rank=0, world_size=1)
time.sleep(2)  # seen alive first: this test is about the alert line, not a crash at birth
raise RuntimeError("boom")
"""


def _run(cwd: Path, *command: str) -> subprocess.CompletedProcess[str]:
    """``ddpwatch run -- command`` as a user types it (in ``cwd``: it may leave a recording),
    with the job's output and ddpwatch's in one stream, in the order they were written."""
    env = {k: v for k, v in os.environ.items() if k != "NO_COLOR"}
    return subprocess.run(
        [sys.executable, "-m", "ddpwatch", "run", "--", *command],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=120, cwd=cwd,
        env={**env, "PYTHONIOENCODING": "utf-8", "PYTHONUNBUFFERED": "1"},
    )  # fmt: skip


def _banner(lines: list[str]) -> tuple[int, re.Match[str]]:
    """Where the banner is among ``lines``, and its parts."""
    found = [(i, m) for i, m in enumerate(map(BANNER.match, lines)) if m]
    assert len(found) == 1, "\n".join(lines)
    return found[0]


def test_run_says_what_it_watches_and_where_before_the_job_prints(tmp_path: Path) -> None:
    command = [sys.executable, "-c", "print('healthy')"]
    result = _run(tmp_path, *command)
    assert result.returncode == 0, result.stdout
    lines = result.stdout.splitlines()
    at, found = _banner(lines)
    assert lines.index("healthy") > at
    shown, full = found["command"], shlex.join(command)  # as a shell would take it back
    assert shown == full or (shown.endswith("…") and full.startswith(shown[:-1])), shown


@pytest.mark.e2e
def test_run_marks_alert_lines_and_writes_no_colour_to_a_pipe(tmp_path: Path) -> None:
    result = _run(tmp_path, sys.executable, "-c", CRASH.format(port=free_port_pair()))
    assert result.returncode == 1, result.stdout
    lines = result.stdout.splitlines()
    _banner(lines)
    alerts = [line for line in lines if line.startswith(f"{MARK} ddpwatch:")]
    assert any("[error] crashed: rank 0 crashed" in line for line in alerts), result.stdout
    assert any(line.startswith(f"{MARK} ddpwatch:   fix: ") for line in alerts), result.stdout
    assert "\x1b[" not in result.stdout


def test_run_announces_the_port_it_moved_to_when_the_preferred_one_is_busy(
    capsys, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    command = [sys.executable, "-c", "pass"]
    with socket.socket() as holder:
        holder.bind(("127.0.0.1", 0))
        holder.listen()
        busy = holder.getsockname()[1]
        assert run_command(command, preferred_port=busy) == 0
    _, found = _banner(capsys.readouterr().err.splitlines())
    assert found["busy"] == f" ({busy} was busy)" and int(found["port"]) != busy

    free = free_port_pair()
    assert run_command(command, preferred_port=free) == 0
    _, found = _banner(capsys.readouterr().err.splitlines())
    assert found["port"] == str(free) and found["busy"] is None


def test_run_with_addr_says_where_its_ranks_report(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "run", "--addr", "127.0.0.1:9", "--", "true"],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,
    )  # fmt: skip
    assert result.returncode == 0
    assert result.stderr == "ddpwatch run: watching `true`; its ranks report to 127.0.0.1:9\n"


# ---------------------------------------------------------------------------- the emphasis


class _Terminal(io.StringIO):
    def __init__(self, tty: bool, encoding: str = "utf-8") -> None:
        super().__init__()
        self._tty, self._encoding = tty, encoding

    def isatty(self) -> bool:
        return self._tty

    @property
    def encoding(self) -> str:  # type: ignore[override]
        return self._encoding


def test_colour_only_on_a_terminal_and_never_under_no_color() -> None:
    assert colour_wanted(_Terminal(tty=True), {})
    assert colour_wanted(_Terminal(tty=True), {"NO_COLOR": ""})  # no-color.org: empty is unset
    assert not colour_wanted(_Terminal(tty=True), {"NO_COLOR": "1"})
    assert not colour_wanted(_Terminal(tty=False), {})


def test_every_alert_line_is_marked_and_coloured_by_severity() -> None:
    text = "ddpwatch: [error] crashed: rank 1 crashed\nddpwatch:   fix: read its traceback"
    assert emphasize(text, "error") == (
        "▶ ddpwatch: [error] crashed: rank 1 crashed\n▶ ddpwatch:   fix: read its traceback"
    )
    red = emphasize(text, "error", colour=True).split("\n")
    assert red == [
        "\x1b[1;31m▶ ddpwatch: [error] crashed: rank 1 crashed\x1b[0m",
        "\x1b[1;31m▶ ddpwatch:   fix: read its traceback\x1b[0m",
    ]  # each line resets: the ranks' output may land between them
    assert emphasize("x", "warning", colour=True) == "\x1b[1;33m▶ x\x1b[0m"
    assert emphasize("x", None, colour=True) == "\x1b[1m▶ x\x1b[0m"  # cleared, info: bold
    assert emphasize("x", "error", ">>") == ">> x"


def test_the_mark_falls_back_to_ascii_where_the_stream_cannot_encode_it() -> None:
    assert mark_for(_Terminal(tty=False, encoding="utf-8")) == MARK
    assert mark_for(_Terminal(tty=False, encoding="ascii")) == ASCII_MARK
