"""``ddpwatch demo``: watch a real CPU DDP job that misbehaves on cue (``demo/runner.py``)."""

from __future__ import annotations

import argparse
import sys

from ddpwatch.commands._args import Subparsers, _positive, _rank_port, add_bell

NAME = "demo"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    demo = subparsers.add_parser(NAME, help="watch a real CPU DDP job that misbehaves on cue")
    demo.add_argument(
        "--ranks", type=int, default=4, help="ranks of the real job (default 4; 0: none)"
    )
    demo.add_argument("--no-faults", action="store_true", help="run the job healthy")
    demo.add_argument(
        "--simulate",
        type=int,
        default=0,
        metavar="N",
        help="add N simulated GPU ranks (no torch needed)",
    )
    demo.add_argument(
        "--headless", action="store_true", help="print the alert stream instead of the dashboard"
    )
    demo.add_argument(
        "--duration", type=_positive, default=None, help="headless: stop after this many seconds"
    )
    demo.add_argument(
        "--port", type=_rank_port, default=None, help="collector port (default 5599 if free)"
    )
    add_bell(demo)
    return demo


def run(args: argparse.Namespace) -> int:
    from ddpwatch.demo.runner import DemoOptions, run_demo

    if args.ranks == 1 or args.ranks < 0:
        print("ddpwatch demo: --ranks must be 0 or at least 2", file=sys.stderr)
        return 2
    if args.ranks == 0 and not args.simulate:
        print("ddpwatch demo: with --ranks 0, give --simulate N", file=sys.stderr)
        return 2
    options = DemoOptions(
        ranks=args.ranks,
        faults=not args.no_faults,
        simulate=args.simulate,
        headless=args.headless,
        duration=args.duration,
        port=args.port,
        bell=not args.no_bell,
    )
    return run_demo(options)
