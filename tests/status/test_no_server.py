"""Asking for a server that is not there: ``status``, ``top`` and ``web`` name the port they
tried, say it is ``ddpwatch serve``'s query port, and how to start one — the same line, from
``client.no_server``, through the real CLI against a port nothing listens on."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
from conftest import LiveServer, free_port_pair

from ddpwatch.cli import main
from ddpwatch.core.protocol import DEFAULT_PORT
from ddpwatch.core.security import generate_keys
from ddpwatch.status.client import no_server, unanswered


def refusal(port: int, timeout: str, curve: str = "") -> str:
    return (
        f"no server answered on 127.0.0.1:{port + 1} within {timeout} s: that is the query port "
        f"of ddpwatch serve (its rank port {port} + 1); start one with `ddpwatch serve --port "
        f"{port}` (or `ddpwatch run -- COMMAND`), or point at a running one with --host/--port"
        + curve
    )


def test_status_names_the_query_port_and_how_to_start_serve(
    capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch, tmp_path
) -> None:
    monkeypatch.setenv("DDPWATCH_RECORD_DIR", str(tmp_path))  # no ddpwatch run recorded here
    port = free_port_pair()
    assert main(["status", "--port", str(port), "--timeout", "0.3"]) == 1
    out, err = capsys.readouterr()
    assert (out, err) == ("", f"ddpwatch: {refusal(port, '0.3')}\n")


def test_the_default_port_reads_as_the_readme_names_it() -> None:
    assert no_server("127.0.0.1", DEFAULT_PORT, 2.0) == (
        "no server answered on 127.0.0.1:5600 within 2 s: that is the query port of ddpwatch "
        "serve (its rank port 5599 + 1); start one with `ddpwatch serve` (or `ddpwatch run -- "
        "COMMAND`), or point at a running one with --host/--port"
    )


def run_cli(*argv: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """``ddpwatch ARGV`` in a child without a terminal: a dashboard that opened instead of
    refusing would run until the timeout."""
    return subprocess.run(
        [sys.executable, "-m", "ddpwatch", *argv],
        capture_output=True,
        text=True,
        timeout=60,
        stdin=subprocess.DEVNULL,
        env={**os.environ, **(env or {})},
    )


@pytest.mark.parametrize("command", [["top", "--timeout", "0.3"], ["web"]])
def test_top_and_web_refuse_with_the_same_line(command: list[str]) -> None:
    port = free_port_pair()
    result = run_cli(*command, "--port", str(port))
    assert (result.returncode, result.stdout) == (1, "")
    assert result.stderr == f"ddpwatch {command[0]}: {refusal(port, '2')}\n"


def test_with_a_server_key_the_line_asks_whether_it_is_the_right_one(tmp_path) -> None:
    _, _, public = generate_keys(tmp_path / "keys")
    port = free_port_pair()
    key = {"DDPWATCH_SERVER_KEY": public, "DDPWATCH_RECORD_DIR": str(tmp_path / "runs")}
    hint = (
        " (with DDPWATCH_SERVER_KEY set: is it the key of a server started with "
        "--curve-secret-file?)"
    )
    result = run_cli("status", "--port", str(port), "--timeout", "0.3", env=key)
    assert result.stderr == f"ddpwatch: {refusal(port, '0.3', hint)}\n"
    result = run_cli("top", "--port", str(port), env=key)
    assert result.stderr == f"ddpwatch top: {refusal(port, '2', hint)}\n"


def test_a_running_server_answers_the_probe(live_server: LiveServer) -> None:
    """``top`` and ``web`` ask for a page of one rank before they open: any server answers."""
    assert unanswered("127.0.0.1", live_server.port, 2.0) is None
    port = free_port_pair()
    assert unanswered("127.0.0.1", port, 0.2) == refusal(port, "0.2")
