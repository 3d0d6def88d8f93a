"""``ddpwatch relay --to HOST:PORT``: one per node, batching its ranks' frames (``relay.py``)."""

from __future__ import annotations

import argparse
import signal
import sys
import threading

from ddpwatch.commands._args import Subparsers, _addr

NAME = "relay"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        NAME,
        help="forward this node's ranks to a server, one frame per beat (very large jobs)",
        description="Run one per node (SLURM: one task per node, started before the ranks). "
        "The node's ranks find it on a local socket and send to the server directly when it is "
        "not there. ddpwatch run --addr starts one by itself.",
    )
    parser.add_argument(
        "--to", dest="to", type=_addr, required=True, metavar="HOST:PORT", help="the server"
    )
    parser.add_argument(
        "--listen",
        metavar="ENDPOINT",
        default=None,
        help="where the ranks connect (default: a per-user ipc:// socket the agent finds by "
        "itself; where there is no ipc://, Windows, a free port on 127.0.0.1, printed; set "
        "DDPWATCH_RELAY in the ranks' environment to anything but the ipc:// default)",
    )
    return parser


def run(args: argparse.Namespace) -> int:
    from ddpwatch.core.ports import resolve_endpoint
    from ddpwatch.relay import Relay, RelayError

    upstream = resolve_endpoint(args.to)
    try:
        relay = Relay(upstream, args.listen)
    except RelayError as exc:
        print(f"ddpwatch relay: {exc}", file=sys.stderr)
        return 1
    stop = threading.Event()
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: stop.set())
    print(f"ddpwatch relay: {relay.listen} → {upstream}", file=sys.stderr, flush=True)
    try:
        relay.run(stop)
    finally:
        relay.close()
    s = relay.stats
    print(
        f"ddpwatch relay: {s.forwarded} frames forwarded in {s.batches} batches, "
        f"{s.coalesced} heartbeats coalesced while the server took none, "
        f"{s.rejected} rejected, {s.dropped} dropped",
        file=sys.stderr,
    )
    return 0
