"""``ddpwatch web``: the read-only dashboard in a real headless browser."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest
from cdp import BROWSER, screenshot
from conftest import LiveServer, free_port_pair

from ddpwatch.commands.web import top_command
from ddpwatch.demo.runner import stop_job
from ddpwatch.demo.simulate import SimulatedCluster

pytest.importorskip("textual_serve")
pytestmark = [
    pytest.mark.browser,
    pytest.mark.skipif(BROWSER is None, reason="needs Debian's chromium package"),
]

PNG = b"\x89PNG\r\n\x1a\n"


def test_web_dashboard_renders_the_clusters_state(live_server: LiveServer, tmp_path) -> None:
    cluster = SimulatedCluster(f"tcp://127.0.0.1:{live_server.port}", 16)
    cluster.start()
    answered: list[float] = []
    status_json = live_server.server.collector._snapshot

    def counting() -> bytes:
        answered.append(time.monotonic())
        return status_json()

    live_server.server.collector._snapshot = counting
    web_port = free_port_pair()
    web = subprocess.Popen(
        [sys.executable, "-m", "ddpwatch", "web", "--port", str(live_server.port), "--web-port", str(web_port)],
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
    )  # fmt: skip
    try:
        live_server.wait_for(lambda s: len(s["ranks"]) == 16, timeout=10)
        time.sleep(1.5)  # the web server starts
        png = screenshot(
            f"http://127.0.0.1:{web_port}/",
            wait_s=40.0,  # 8 s idle; a loaded CI machine drew a blank page at 8 s
            debug_port=free_port_pair(),
            until_bytes=60_000,
        )
    finally:
        stop_job(web, grace=3.0)
        cluster.stop()
    (tmp_path / "web.png").write_bytes(png)
    if os.environ.get("DDPWATCH_SAVE_WEB_SCREENSHOT"):
        (tmp_path / "web.png").rename(os.environ["DDPWATCH_SAVE_WEB_SCREENSHOT"])
    assert png.startswith(PNG)
    assert answered, "the browser tab's dashboard never asked the collector for its status"
    assert len(png) > 60_000  # the dashboard, not textual-serve's splash screen (about 15 kB)


def test_each_tab_runs_a_thin_client_not_a_collector() -> None:
    command = top_command("node 1", 5599)
    assert " -m ddpwatch top " in command and "'node 1'" in command and "--port 5599" in command
