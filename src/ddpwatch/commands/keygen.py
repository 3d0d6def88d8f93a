"""``ddpwatch keygen``: create a CurveZMQ key pair (``core/security.py``, docs/security.md)."""

from __future__ import annotations

import argparse

from ddpwatch.commands._args import Subparsers

NAME = "keygen"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    keygen = subparsers.add_parser(NAME, help="create a CurveZMQ key pair (docs/security.md)")
    keygen.add_argument("dir", nargs="?", default=".", help="where to write (default .)")
    keygen.add_argument(
        "--name", default="ddpwatch", help="file name stem (default ddpwatch; e.g. a client name)"
    )
    keygen.add_argument("--force", action="store_true", help="replace existing key files")
    return keygen


def run(args: argparse.Namespace) -> int:
    from ddpwatch.core.security import keygen_main

    return keygen_main(args)
