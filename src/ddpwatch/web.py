"""``ddpwatch web``: the read-only dashboard in a browser, through textual-serve.

textual-serve starts one app process per browser tab, which is why the browser
gets ``ddpwatch top`` (a thin client of the collector's query port), never a
second collector.
"""

from __future__ import annotations

import shlex
import sys


def top_command(host: str, port: int) -> str:
    """The shell command textual-serve runs for every tab: ``--wait``, as a page stays open
    while the server restarts."""
    python = shlex.quote(sys.executable)
    return f"{python} -m ddpwatch top --host {shlex.quote(host)} --port {port} --wait"


def run_web(host: str, port: int, web_host: str = "127.0.0.1", web_port: int = 8000) -> int:
    try:
        from textual_serve.server import Server
    except ImportError:
        print("ddpwatch web: needs textual-serve: pip install 'ddpwatch[web]'", file=sys.stderr)
        return 1
    print(
        f"ddpwatch web: open http://{web_host}:{web_port} (collector {host}:{port})",
        file=sys.stderr,
    )
    Server(top_command(host, port), host=web_host, port=web_port, title="ddpwatch").serve()
    return 0
