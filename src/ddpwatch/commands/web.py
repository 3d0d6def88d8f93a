"""``ddpwatch web``: the read-only dashboard in a browser, through textual-serve.

textual-serve starts one app process per browser tab, which is why the browser gets
``ddpwatch top`` (a thin client of the collector's query port), never a second collector.
"""

from __future__ import annotations

import argparse
import shlex
import sys

from ddpwatch.commands._args import Subparsers, _port, add_address, add_wait, refuse_without_server

NAME = "web"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    web = subparsers.add_parser(
        NAME, help="serve the read-only dashboard to browsers (textual-serve)"
    )
    add_address(web)
    web.add_argument(
        "--web-host", default="127.0.0.1", help="address to serve the page on (default 127.0.0.1)"
    )
    web.add_argument("--web-port", type=_port, default=8000, help="port of the page (default 8000)")
    add_wait(web)
    return web


def run(args: argparse.Namespace) -> int:
    refused = refuse_without_server(NAME, args)
    if refused is not None:
        return refused
    return run_web(args.host, args.port, args.web_host, args.web_port)


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
