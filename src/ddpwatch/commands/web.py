"""``ddpwatch web``: the read-only dashboard served to browsers (textual-serve)."""

from __future__ import annotations

import argparse

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
    from ddpwatch.web import run_web

    return run_web(args.host, args.port, args.web_host, args.web_port)
