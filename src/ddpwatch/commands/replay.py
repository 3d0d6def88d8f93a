"""``ddpwatch replay FILE``: a ``serve --record`` file fed through diagnosis and the views
again (``server/replay.py`` has the ``ReplayServer``)."""

from __future__ import annotations

import argparse
import logging
import sys
from typing import TYPE_CHECKING

from ddpwatch.commands._args import Subparsers, add_bell, add_thresholds, threshold_values

if TYPE_CHECKING:
    from ddpwatch.server.replay import ReplayServer

NAME = "replay"

log = logging.getLogger("ddpwatch")


def parse_speed(text: str) -> float | None:
    """``--speed``: a factor > 0, or ``0``/``max`` for as fast as possible (None)."""
    if text.strip().lower() in ("max", "0", "0.0", "inf"):
        return None
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a speed: {text!r} (a number, or max)") from None
    if not value > 0:
        raise argparse.ArgumentTypeError(f"speed must be > 0 or max, got {text}")
    return value


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    replay = subparsers.add_parser(
        NAME, help="feed a serve --record file through diagnosis and the views again"
    )
    replay.add_argument("file", help="a recording made by ddpwatch serve --record")
    replay.add_argument(
        "--speed",
        type=parse_speed,
        default=1.0,
        help="times real time (default 1; 0 or max: as fast as possible)",
    )
    replay.add_argument(
        "--headless", action="store_true", help="print the alert stream instead of the dashboard"
    )
    add_thresholds(replay, recorded=True)
    add_bell(replay)
    return replay


def run(args: argparse.Namespace) -> int:
    """``ddpwatch replay FILE [--speed X] [--headless]``."""
    from ddpwatch.commands._signals import stop_on_signals
    from ddpwatch.diagnosis.history import print_json_line
    from ddpwatch.server.recording import RecordingError
    from ddpwatch.server.replay import ReplayServer

    try:
        server = ReplayServer(
            args.file,
            speed=args.speed,
            on_change=print_json_line if args.headless else None,
            overrides=threshold_values(args),
        )
    except RecordingError as exc:
        print(f"ddpwatch replay: {exc}", file=sys.stderr)
        return 1
    if not args.headless:
        try:
            from ddpwatch.tui.app import run_dashboard
        except ImportError:
            print(
                "ddpwatch replay: the dashboard is unavailable in this install; "
                "use --headless for the alert stream",
                file=sys.stderr,
            )
            return 1
        code = run_dashboard(server, bell=not getattr(args, "no_bell", False))
        _report_tail(server)
        return code
    stop_on_signals(server)
    server.run()
    log.info(
        "replayed %d messages from %s: %d alerts raised, %d cleared",
        server.messages,
        server.path,
        server.raised,
        server.cleared,
    )
    _report_tail(server)
    return 0


def _report_tail(server: ReplayServer) -> None:
    if server.tail_bytes:
        log.warning(
            "%s ends in a partial record: its last %d bytes were not read "
            "(the server stopped mid-write)",
            server.path,
            server.tail_bytes,
        )
