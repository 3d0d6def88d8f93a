"""``ddpwatch top``: the dashboard of a ``ddpwatch serve`` running elsewhere (read-only)."""

from __future__ import annotations

import argparse

from ddpwatch.commands._args import (
    Subparsers,
    _positive,
    add_address,
    add_bell,
    add_wait,
    refuse_without_server,
)

NAME = "top"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    top = subparsers.add_parser(
        NAME, help="open the dashboard on a running ddpwatch serve (read-only)"
    )
    add_address(top)
    top.add_argument(
        "--timeout", type=_positive, default=1.0, help="seconds to wait per poll (default 1)"
    )
    add_bell(top)
    add_wait(top)
    return top


def run(args: argparse.Namespace) -> int:
    refused = refuse_without_server(NAME, args, max(args.timeout, 2.0))
    if refused is not None:
        return refused
    from ddpwatch.tui.app import run_client

    return run_client(args.host, args.port, timeout=args.timeout, bell=not args.no_bell)
