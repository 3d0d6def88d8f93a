"""Command line: ``ddpwatch serve``, ``ddpwatch status``, ...

Each subcommand is a module of ``ddpwatch/commands/`` with ``add_parser(subparsers)``
and ``run(args)``; this module puts them together and dispatches.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Sequence
from typing import Protocol

from ddpwatch import __version__
from ddpwatch.commands import (
    demo,
    doctor,
    keygen,
    relay,
    replay,
    report,
    run,
    schema,
    serve,
    status,
    top,
    web,
)
from ddpwatch.commands._args import Subparsers
from ddpwatch.commands.status import format_status
from ddpwatch.status.client import fetch_status

__all__ = ["COMMANDS", "build_parser", "fetch_status", "format_status", "main"]


class Command(Protocol):
    """What each module of ``ddpwatch/commands/`` provides."""

    NAME: str

    def add_parser(self, subparsers: Subparsers) -> argparse.ArgumentParser: ...

    def run(self, args: argparse.Namespace) -> int: ...


# in the order ``ddpwatch --help`` lists them
COMMANDS: tuple[Command, ...] = (
    serve,
    status,
    top,
    web,
    run,
    relay,
    demo,
    keygen,
    replay,
    report,
    doctor,
    schema,
)


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ddpwatch", description="Live monitor for distributed PyTorch training."
    )
    parser.add_argument("--version", action="version", version=f"ddpwatch {__version__}")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for command in COMMANDS:
        command.add_parser(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="ddpwatch: %(message)s", stream=sys.stderr)
    for command in COMMANDS:
        if args.command == command.NAME:
            return command.run(args)
    return 2


if __name__ == "__main__":
    sys.exit(main())
