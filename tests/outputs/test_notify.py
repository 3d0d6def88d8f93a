"""Alert notifications (``--notify-cmd``, ``--webhook``) and the dashboard's bell.

Real parts throughout: a real HTTP server on 127.0.0.1 receives the webhooks,
real shell commands read the JSON, ``ddpwatch serve`` and ``ddpwatch run`` run
as a user types them; only the rate limiter's clock is turned by hand.
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

import pytest
from conftest import ROOT
from textual.pilot import Pilot
from tui_fixtures import FixtureSource, healthy

from ddpwatch.cli import main
from ddpwatch.core.ports import free_port_pair
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.outputs.notify import Notifier, alert_text, chain, check_webhook_url
from ddpwatch.tui.app import DashboardApp

STRAGGLER = Alert(
    "straggler",
    "error",
    (1,),
    (0, 2),
    "rank 1 has not entered all_reduce #24 that ranks 0, 2 have waited in for 2.2 s",
    "see where rank 1 is (its stack in ddpwatch status --json)",
)


@dataclass(frozen=True)
class Change:
    """What ``Server`` hands ``on_change`` (``event``, ``alert``, ``to_dict``), built by hand."""

    event: str
    alert: Alert

    def to_dict(self) -> dict[str, Any]:
        return {"event": self.event, "alert": self.alert.to_dict()}


def alert(kind: str = "straggler", severity: str = "error", ranks: tuple[int, ...] = (1,)) -> Alert:
    return Alert(kind, severity, ranks, (), f"{kind} on rank {ranks}", "do something")  # type: ignore[arg-type]


@pytest.fixture(autouse=True)
def _no_proxy(monkeypatch: pytest.MonkeyPatch) -> None:
    """A proxy in the environment would take the loopback webhooks elsewhere."""
    for name in list(os.environ):
        if name.lower().endswith("_proxy"):
            monkeypatch.delenv(name)


class Hook:
    """A webhook receiver: what was POSTed, and a gate to hold requests open."""

    def __init__(self, port: int) -> None:
        self.url = f"http://127.0.0.1:{port}/services/T000/SECRET"
        self.requests: list[tuple[str, str, dict[str, Any]]] = []
        self.status = 200
        self.entered = threading.Event()
        self.release = threading.Event()
        self.release.set()

    def wait_for(self, n: int, timeout: float = 10.0) -> None:
        deadline = time.monotonic() + timeout
        while len(self.requests) < n and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(self.requests) >= n, self.requests


@pytest.fixture
def hook() -> Iterator[Hook]:
    holder: list[Hook] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self) -> None:
            receiver = holder[0]
            body = self.rfile.read(int(self.headers["Content-Length"]))
            receiver.requests.append(
                (self.path, self.headers["Content-Type"], json.loads(body.decode()))
            )
            receiver.entered.set()
            receiver.release.wait(10)
            self.send_response(receiver.status)
            self.end_headers()
            self.wfile.write(b"ok")

        def log_message(self, *args: Any) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    holder.append(Hook(server.server_address[1]))
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield holder[0]
    holder[0].release.set()
    server.shutdown()
    server.server_close()
    thread.join(5)


def notify_lines(caplog: pytest.LogCaptureFixture) -> list[str]:
    return [r.getMessage() for r in caplog.records if r.name.startswith("ddpwatch")]


# ----------------------------------------------------------------------------- delivery


def test_webhook_posts_the_alert_json_with_a_slack_text(hook: Hook) -> None:
    notifier = Notifier(webhook=hook.url)
    notifier(Change("raised", STRAGGLER))
    notifier.close()
    assert notifier.sent == 1 and notifier.failed == 0
    [(path, content_type, body)] = hook.requests
    assert path == "/services/T000/SECRET" and content_type == "application/json"
    assert body["event"] == "raised"
    assert body["alert"] == STRAGGLER.to_dict()
    assert body["text"] == (
        "[error] straggler: rank 1 has not entered all_reduce #24 that ranks 0, 2 have waited "
        "in for 2.2 s — fix: see where rank 1 is (its stack in ddpwatch status --json)"
    )


def test_command_gets_the_json_on_stdin_and_the_text_in_its_environment(tmp_path: Path) -> None:
    out, text = tmp_path / "alert.json", tmp_path / "alert.txt"
    command = f'cat > {shlex.quote(str(out))}; printf %s "$DDPWATCH_ALERT_TEXT" > {shlex.quote(str(text))}'
    notifier = Notifier(command)
    notifier(Change("raised", STRAGGLER))
    notifier.close()
    assert notifier.sent == 1 and notifier.failed == 0
    body = json.loads(out.read_text())
    assert body["event"] == "raised" and body["alert"] == STRAGGLER.to_dict()
    assert body["text"] == alert_text(Change("raised", STRAGGLER)) == text.read_text()


def test_only_raised_and_escalated_alerts_at_or_above_the_level_are_sent(hook: Hook) -> None:
    notifier = Notifier(webhook=hook.url)  # default level: warning
    notifier(Change("raised", alert("uneven_memory", "info")))
    notifier(Change("raised", alert("not_connected", "warning", (3,))))
    notifier(Change("cleared", alert("crashed", "error", (5,))))
    notifier(Change("escalated", alert("stalled", "error", (2,))))
    notifier.close()
    assert [(b["event"], b["alert"]["kind"]) for _, _, b in hook.requests] == [
        ("raised", "not_connected"),
        ("escalated", "stalled"),
    ]
    assert hook.requests[1][2]["text"].startswith("[error] stalled (escalated): ")

    hook.requests.clear()
    errors_only = Notifier(webhook=hook.url, level="error")
    errors_only(Change("raised", alert("not_connected", "warning", (3,))))
    errors_only(Change("raised", alert("crashed", "error", (5,))))
    errors_only.close()
    assert [b["alert"]["kind"] for _, _, b in hook.requests] == ["crashed"]
    with pytest.raises(ValueError, match="unknown level"):
        Notifier(webhook=hook.url, level="critical")


# ----------------------------------------------------------------------------- rate limits


def test_the_same_alert_goes_out_once_per_interval_unless_it_gets_worse(hook: Hook) -> None:
    now = [1000.0]
    notifier = Notifier(webhook=hook.url, interval=60.0, clock=lambda: now[0])
    notifier(Change("raised", alert("straggler", "warning")))
    now[0] += 30  # cleared and raised again: flapping
    notifier(Change("raised", alert("straggler", "warning")))
    notifier(Change("raised", alert("straggler", "warning", (2,))))  # other culprits: other alert
    now[0] += 10
    notifier(Change("escalated", alert("straggler", "error")))  # worse: told at once
    now[0] += 5
    notifier(Change("raised", alert("straggler", "error")))
    now[0] += 61
    notifier(Change("raised", alert("straggler", "error")))  # the interval has passed
    notifier.close()
    sent = [(b["event"], b["alert"]["severity"], b["alert"]["ranks"]) for _, _, b in hook.requests]
    assert sent == [
        ("raised", "warning", [1]),
        ("raised", "warning", [2]),
        ("escalated", "error", [1]),
        ("raised", "error", [1]),
    ]
    assert notifier.suppressed == 2 and notifier.dropped == 0


def test_a_global_cap_drops_the_excess_with_one_line(
    hook: Hook, caplog: pytest.LogCaptureFixture
) -> None:
    now = [0.0]
    notifier = Notifier(webhook=hook.url, per_minute=3, clock=lambda: now[0])
    with caplog.at_level(logging.INFO):
        for rank in range(6):
            notifier(Change("raised", alert("silent", "error", (rank,))))
        hook.wait_for(3)
        capped = notify_lines(caplog)
        now[0] += 60  # a minute later there is room again
        notifier(Change("raised", alert("silent", "error", (9,))))
        notifier.close()
    assert [b["alert"]["ranks"] for _, _, b in hook.requests] == [[0], [1], [2], [9]]
    assert notifier.dropped == 3 and notifier.sent == 4
    assert len(capped) == 1 and "more than 3 a minute" in capped[0]


def test_a_full_queue_counts_what_it_drops(hook: Hook) -> None:
    hook.release.clear()  # the receiver holds the first POST open
    notifier = Notifier(webhook=hook.url, queue_size=1)
    notifier(Change("raised", alert("crashed", "error", (0,))))
    assert hook.entered.wait(10)  # the worker is busy with it
    started = time.monotonic()
    notifier(Change("raised", alert("crashed", "error", (1,))))  # queued
    notifier(Change("raised", alert("crashed", "error", (2,))))  # no room
    assert time.monotonic() - started < 0.5  # the caller (the server) never waits
    assert notifier.dropped == 1
    hook.release.set()
    notifier.close()
    assert [b["alert"]["ranks"] for _, _, b in hook.requests] == [[0], [1]]
    assert notifier.sent == 2


# ----------------------------------------------------------------------------- failures


def test_a_failing_command_is_counted_and_logged_in_one_line(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    with caplog.at_level(logging.INFO):
        notifier = Notifier("echo 'no route to pager' >&2; exit 3")
        notifier(Change("raised", STRAGGLER))
        notifier.close()
    assert (notifier.sent, notifier.failed) == (0, 1)
    lines = notify_lines(caplog)
    assert lines[0] == "notify command exited 3: no route to pager"
    assert all("\n" not in line and "Traceback" not in line for line in lines)

    caplog.clear()
    with caplog.at_level(logging.INFO):
        missing = Notifier("ddpwatch-no-such-command-here --now")
        missing(Change("raised", STRAGGLER))
        missing.close()
    assert missing.failed == 1
    assert "exited 127" in notify_lines(caplog)[0] and "not found" in notify_lines(caplog)[0]


def test_a_hung_command_times_out(caplog: pytest.LogCaptureFixture) -> None:
    with caplog.at_level(logging.INFO):
        notifier = Notifier("sleep 30", timeout=0.5)
        started = time.monotonic()
        notifier(Change("raised", STRAGGLER))
        notifier.close()
    assert time.monotonic() - started < 5
    assert notifier.failed == 1
    assert notify_lines(caplog)[0] == "notify command timed out after 0.5 s: sleep 30"


def test_an_unreachable_or_failing_webhook_is_counted_and_logged_without_its_secret(
    hook: Hook, caplog: pytest.LogCaptureFixture
) -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        closed = sock.getsockname()[1]  # nothing listens here once the socket closes
    with caplog.at_level(logging.INFO):
        notifier = Notifier(webhook=f"http://127.0.0.1:{closed}/hooks/SECRET", timeout=2.0)
        notifier(Change("raised", STRAGGLER))
        notifier.close()
    assert (notifier.sent, notifier.failed) == (0, 1)
    [line, summary] = notify_lines(caplog)
    assert line == f"webhook http://127.0.0.1:{closed} unreachable: Connection refused"
    assert "1 failed" in summary

    caplog.clear()
    hook.status = 500
    with caplog.at_level(logging.INFO):
        failing = Notifier(webhook=hook.url)
        failing(Change("raised", STRAGGLER))
        failing.close()
    assert failing.failed == 1
    line = notify_lines(caplog)[0]
    assert (
        line
        == f"webhook http://127.0.0.1:{hook.url.split(':')[2].split('/')[0]} answered HTTP 500 Internal Server Error"
    )
    assert "SECRET" not in " ".join(notify_lines(caplog))


def test_close_gives_up_on_a_stuck_delivery_within_its_drain_time() -> None:
    notifier = Notifier("sleep 30", timeout=20)
    notifier(Change("raised", alert("crashed", "error", (0,))))
    notifier(Change("raised", alert("crashed", "error", (1,))))
    started = time.monotonic()
    notifier.close(drain_s=0.5)
    assert time.monotonic() - started < 2
    assert notifier.dropped == 1  # the second never started
    assert notifier._thread is not None and not notifier._thread.is_alive()  # sleep 30 killed
    notifier(Change("raised", alert("crashed", "error", (2,))))  # closed: ignored
    assert notifier.dropped == 1


def test_webhook_urls_are_checked() -> None:
    assert check_webhook_url("https://hooks.slack.com/services/T/B/x") == (
        "https://hooks.slack.com/services/T/B/x"
    )
    for bad in ("ftp://host/x", "hooks.slack.com/x", "http://", "http://host:port/"):
        with pytest.raises(ValueError, match="not an http:// or https:// URL"):
            check_webhook_url(bad)


def test_chain_calls_each_subscriber() -> None:
    seen: list[str] = []
    assert chain(None, None) is None
    only = seen.append
    assert chain(None, only) is only
    both = chain(lambda c: seen.append(f"a{c}"), None, lambda c: seen.append(f"b{c}"))
    assert both is not None
    both(1)
    assert seen == ["a1", "b1"]


# ----------------------------------------------------------------------------- the CLI


def test_cli_rejects_a_webhook_that_is_not_http_in_one_line(capsys) -> None:
    for command in ("serve", "run"):
        with pytest.raises(SystemExit) as exited:
            main([command, "--webhook", "ftp://example.com/hook", "--", "true"])
        assert exited.value.code == 2
        err = capsys.readouterr().err
        assert err.strip().splitlines()[-1] == (
            f"ddpwatch {command}: error: argument --webhook: "
            "not an http:// or https:// URL: ftp://example.com/hook"
        )


def test_run_with_addr_leaves_notifications_to_that_serve(capsys) -> None:
    assert main(["run", "--addr", "127.0.0.1:5599", "--notify-cmd", "true", "--", "true"]) == 2
    assert "give it --notify-cmd/--webhook" in capsys.readouterr().err


# Two ranks step, then rank 1 crashes and the job exits: a ``crashed`` error about rank 1.
CRASHING_JOB = """\
import os, sys, time

import zmq

from ddpwatch.core.protocol import ErrorInfo, Event, Sample, encode

now = time.time()
frames = [
    encode(Sample(v=1, rank=r, t=now, world_size=2, step=1, pid=100 + r, host="node-a"))
    for r in (0, 1)
]
error = ErrorInfo(type="RuntimeError", message="boom")
frames.append(encode(Event(v=1, rank=1, t=now, event="crash", error=error)))
sock = zmq.Context.instance().socket(zmq.PUSH)
sock.setsockopt(zmq.LINGER, 20000)
sock.connect("tcp://" + os.environ["DDPWATCH_ADDR"])
for frame in frames:
    sock.send(frame)
sock.close()
zmq.Context.instance().term()  # delivers what is queued (the server may not be up yet)
sys.exit(1)
"""


def wait_for_lines(path: Path, predicate: Callable[[list[dict[str, Any]]], bool]) -> list[Any]:
    deadline = time.monotonic() + 20
    bodies: list[dict[str, Any]] = []
    while time.monotonic() < deadline:
        if path.exists():
            bodies = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
            if predicate(bodies):
                return bodies
        time.sleep(0.1)
    raise AssertionError(f"no matching notification in {path}: {bodies}")


def append_command(path: Path) -> str:
    """Append each alert's JSON to ``path``, one per line."""
    quoted = shlex.quote(str(path))
    return f"cat >> {quoted} && echo >> {quoted}"


def test_serve_headless_runs_the_notify_command_for_a_real_alert(tmp_path: Path) -> None:
    port = free_port_pair()
    out = tmp_path / "alerts.jsonl"
    proc = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "serve", "--headless", "--port", str(port),
         "--notify-cmd", append_command(out), "--notify-level", "error"],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd=ROOT,
    )  # fmt: skip
    job = tmp_path / "job.py"
    job.write_text(CRASHING_JOB)
    try:
        env = {**os.environ, "DDPWATCH_ADDR": f"127.0.0.1:{port}"}  # connects before the bind
        assert subprocess.run([sys.executable, str(job)], env=env, timeout=30).returncode == 1
        bodies = wait_for_lines(out, lambda b: any(x["alert"]["kind"] == "crashed" for x in b))
    finally:
        proc.send_signal(signal.SIGTERM)
        stdout, err = proc.communicate(timeout=15)
    assert proc.returncode == 0, err
    crashed = next(b for b in bodies if b["alert"]["kind"] == "crashed")
    assert crashed["event"] == "raised" and crashed["alert"]["ranks"] == [1]
    assert "RuntimeError: boom" in crashed["alert"]["message"]
    assert crashed["text"].startswith("[error] crashed: rank 1 crashed")
    assert all(b["alert"]["severity"] == "error" for b in bodies)
    # the alert stream on stdout is untouched by the command (its output goes nowhere)
    printed = [json.loads(line) for line in stdout.splitlines()]
    assert any(c["alert"]["kind"] == "crashed" for c in printed)
    assert "notifying of each raised alert" in err


def test_run_sends_the_alert_raised_as_the_job_ends(tmp_path: Path, hook: Hook) -> None:
    """A job that crashes and exits at once: its alert comes from the final diagnosis, and the
    notifier's close lets it out before ``ddpwatch run`` returns."""
    out = tmp_path / "alerts.jsonl"
    job = tmp_path / "job.py"
    job.write_text(CRASHING_JOB)
    result = subprocess.run(
        [sys.executable, "-m", "ddpwatch", "run", "--notify-cmd", append_command(out),
         "--webhook", hook.url, "--", sys.executable, str(job)],
        capture_output=True, text=True, timeout=60, cwd=tmp_path,  # any recording lands there
    )  # fmt: skip
    assert result.returncode == 1, result.stderr
    assert "[error] crashed" in result.stderr
    bodies = [json.loads(line) for line in out.read_text().splitlines() if line.strip()]
    assert [b["alert"]["kind"] for b in bodies] == ["crashed"]
    assert [b["alert"]["kind"] for _, _, b in hook.requests] == ["crashed"]
    assert hook.requests[0][2] == bodies[0]


# ----------------------------------------------------------------------------- the bell

SLOW = 3600.0  # poll by hand only


def with_alerts(*alerts: Alert) -> dict[str, Any]:
    doc = healthy(8)
    doc["alerts"] = [a.to_dict() for a in alerts]
    return doc


async def poll(pilot: Pilot[Any], source: FixtureSource, doc: dict[str, Any]) -> None:
    source.push(doc)
    app = pilot.app
    assert isinstance(app, DashboardApp)
    app.dashboard.poll_now()
    await app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.pause()


async def rings_for(docs: list[dict[str, Any]], **options: Any) -> list[int]:
    """Bells rung so far after each document, the first one included."""
    source = FixtureSource([docs[0]])
    app = DashboardApp(source, interval=SLOW, **options)
    rung: list[int] = []
    app.bell = lambda: rung.append(1)  # type: ignore[method-assign]
    counts = []
    async with app.run_test(size=(120, 40)) as pilot:
        await app.workers.wait_for_complete()
        await pilot.pause()
        counts.append(len(rung))
        for doc in docs[1:]:
            await poll(pilot, source, doc)
            counts.append(len(rung))
    return counts


WARNING = alert("straggler", "warning", (1,))
CRASH = alert("crashed", "error", (5,))
SILENT = alert("silent", "error", (6,))


async def test_the_bell_rings_once_per_new_error_and_never_for_warnings() -> None:
    counts = await rings_for(
        [
            healthy(8),
            with_alerts(WARNING),  # a warning: quiet
            with_alerts(WARNING, CRASH),  # a new error: ring
            with_alerts(WARNING, CRASH),  # the same error again: quiet
            with_alerts(CRASH, SILENT),  # another error: ring
            with_alerts(CRASH),
            with_alerts(alert("straggler", "error", (1,)), CRASH),  # the warning became an error
        ]
    )
    assert counts == [0, 0, 1, 1, 2, 2, 3]


async def test_errors_already_there_when_the_dashboard_opens_do_not_ring() -> None:
    assert await rings_for([with_alerts(CRASH), with_alerts(CRASH)]) == [0, 0]


async def test_no_bell() -> None:
    assert await rings_for([healthy(8), with_alerts(CRASH, SILENT)], bell=False) == [0, 0]
