"""``ddpwatch status``: one snapshot from a running server, as a table or ``--json``."""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from typing import Any

from ddpwatch.commands._args import Subparsers, _positive, add_address
from ddpwatch.vocabulary import RankState

NAME = "status"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    status = subparsers.add_parser(NAME, help="print one snapshot from a running server")
    add_address(status)
    status.add_argument("--json", action="store_true", help="the status JSON document")
    status.add_argument(
        "--timeout", type=_positive, default=2.0, help="seconds to wait for an answer (default 2)"
    )
    return status


def run(args: argparse.Namespace) -> int:
    from ddpwatch.client import fetch_status
    from ddpwatch.security import SERVER_KEY_ENV, CurveKeyError, client_curve_keys

    try:
        curve = client_curve_keys() is not None
    except CurveKeyError as exc:
        print(f"ddpwatch: {exc}", file=sys.stderr)
        return 1
    document = fetch_status(args.host, args.port, args.timeout)
    if document is None:
        hint = (
            f" (with {SERVER_KEY_ENV} set: is it the key of a server started with "
            "--curve-secret-file?)"
            if curve
            else ""
        )
        print(
            f"ddpwatch: no server answered on {args.host}:{args.port + 1} "
            f"within {args.timeout:g} s{hint}",
            file=sys.stderr,
        )
        return 1
    if args.json:
        print(json.dumps(document, indent=2))
    else:
        print(format_status(document))
    return 0


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def _collective(rank: dict[str, Any]) -> str:
    coll = rank["collective"]
    return f"{coll['op']} #{_fmt(coll['seq'])} {coll['since_s']:.1f}s" if coll else "-"


# (title, width, right-aligned, cell)
COLUMNS: tuple[tuple[str, int, bool, Callable[[dict[str, Any]], str]], ...] = (
    ("rank", 5, True, lambda r: _fmt(r["rank"])),
    ("host", 16, False, lambda r: _fmt(r["host"])),
    ("pid", 7, True, lambda r: _fmt(r["pid"])),
    ("device", 8, False, lambda r: _fmt(r["device"])),
    ("state", 13, False, lambda r: r["state"]),
    ("phase", 11, False, lambda r: _fmt(r["phase"])),
    ("step", 7, True, lambda r: _fmt(r["step"])),
    ("loss", 9, True, lambda r: _fmt(r["loss"], ".4g")),
    ("step s", 7, True, lambda r: _fmt(r["step_time_s"], ".3f")),
    ("collective", 22, False, _collective),
    ("seen", 5, True, lambda r: _fmt(r["last_seen_s"], ".1f")),
)


def _row(cells: list[str]) -> str:
    parts = []
    for (_, width, right, _cell), text in zip(COLUMNS, cells, strict=True):
        text = text[:width]
        parts.append(text.rjust(width) if right else text.ljust(width))
    return " ".join(parts).rstrip()


def format_status(document: dict[str, Any]) -> str:
    """A plain-text table of the status document, for people."""
    lines = [_row([title for title, *_ in COLUMNS])]
    lines += [_row([cell(rank) for *_, cell in COLUMNS]) for rank in document["ranks"]]
    connected = sum(1 for r in document["ranks"] if r["state"] != RankState.NOT_CONNECTED)
    stats = document["stats"]
    lines.append(
        f"\n{connected}/{_fmt(document['world_size'])} ranks, "
        f"{stats['received']} messages, {stats['rejected']} rejected"
        + (f", {stats['refused']} refused" if stats.get("refused") else "")
    )
    for alert in document["alerts"]:
        lines.append(f"[{alert['severity']}] {alert['kind']}: {alert['message']}")
        lines.append(f"    fix: {alert['hint']}")
    if not document["alerts"]:
        lines.append("no alerts")
    return "\n".join(lines)
