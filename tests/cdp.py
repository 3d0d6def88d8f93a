"""A headless Chromium driven over the DevTools protocol, for screenshots of the web dashboard.

Uses aiohttp (a dependency of textual-serve) as the websocket client, so the
browser test needs nothing beyond Debian's chromium package.
"""

from __future__ import annotations

import asyncio
import base64
import json
import shutil
import subprocess
import tempfile
import time
import urllib.request
from typing import Any

BROWSER = shutil.which("chromium") or shutil.which("chromium-browser")
FLAGS = (
    "--headless", "--no-sandbox", "--disable-gpu", "--disable-quic", "--no-first-run",
    "--disable-background-networking", "--disable-component-update", "--disable-sync",
)  # fmt: skip


def screenshot(
    url: str,
    wait_s: float,
    debug_port: int,
    size: tuple[int, int] = (1400, 900),
    until_bytes: int = 0,
) -> bytes:
    """Open ``url``, wait ``wait_s`` seconds of real time, and return a PNG of the page; with
    ``until_bytes``, return as soon as a shot is larger than that (a page drawn, not a blank
    one still loading on a busy machine), trying every second up to ``wait_s``."""
    assert BROWSER is not None
    profile = tempfile.mkdtemp(prefix="ddpwatch-chromium-")
    browser = subprocess.Popen(
        [BROWSER, *FLAGS, f"--user-data-dir={profile}", f"--window-size={size[0]},{size[1]}",
         f"--remote-debugging-port={debug_port}", "about:blank"],
        stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )  # fmt: skip
    try:
        return asyncio.run(_capture(url, wait_s, _page_socket(debug_port), until_bytes))
    finally:
        browser.kill()
        browser.wait()
        shutil.rmtree(profile, ignore_errors=True)


def _page_socket(port: int, timeout: float = 20.0) -> str:
    deadline = time.monotonic() + timeout
    while True:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{port}/json/list", timeout=2) as reply:
                targets = json.load(reply)
            return next(t["webSocketDebuggerUrl"] for t in targets if t["type"] == "page")
        except (OSError, StopIteration, ValueError):
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)


async def _capture(url: str, wait_s: float, socket_url: str, until_bytes: int) -> bytes:
    import aiohttp

    async with (
        aiohttp.ClientSession() as session,
        session.ws_connect(socket_url, max_msg_size=0) as ws,
    ):
        counter = 0

        async def call(method: str, **params: Any) -> dict[str, Any]:
            nonlocal counter
            counter += 1
            await ws.send_json({"id": counter, "method": method, "params": params})
            while True:
                message = await ws.receive_json(timeout=30)
                if message.get("id") == counter:
                    return message.get("result", {})

        await call("Page.navigate", url=url)
        deadline = time.monotonic() + wait_s
        while True:
            await asyncio.sleep(1.0 if until_bytes else wait_s)
            shot = await call("Page.captureScreenshot", format="png")
            png = base64.b64decode(shot["data"])
            if len(png) > until_bytes or time.monotonic() >= deadline:
                return png
