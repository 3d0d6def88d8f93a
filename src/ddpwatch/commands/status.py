"""``ddpwatch status``: one snapshot from a running server, as a table or ``--json``.

With ``--summary`` or a filter (``--ranks``, ``--state``, ``--on-host``, ``--limit``,
``--offset``) it asks for a summary or a page of ranks (docs/status.md, "Summary and pages"):
at 65,536 ranks the whole document is tens of megabytes.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import sys
from collections.abc import Callable
from typing import Any

from ddpwatch.commands._args import (
    Subparsers,
    _positive,
    _positive_int,
    add_address,
    whole_number,
)
from ddpwatch.core.vocabulary import RANK_STATES, RankState
from ddpwatch.status.query import DEFAULT_LIMIT, DEFAULT_WORST, Query
from ddpwatch.status.schema import (
    AlertEntry,
    HostRow,
    PageReply,
    RankEntry,
    Stats,
    StatusDocument,
    SummaryReply,
)

NAME = "status"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    status = subparsers.add_parser(NAME, help="print one snapshot from a running server")
    add_address(status)
    status.add_argument(
        "--json", action="store_true", help="the status JSON document (or the summary, the page)"
    )
    status.add_argument(
        "--timeout", type=_positive, default=2.0, help="seconds to wait for an answer (default 2)"
    )
    pages = status.add_argument_group(
        "summary and pages", "for large jobs: ask for part of the document (docs/status.md)"
    )
    pages.add_argument(
        "--summary",
        action="store_true",
        help="counts by state and by host, and the worst ranks",
    )
    pages.add_argument("--ranks", type=_rank_list, help="only these ranks, like 0-63,70")
    pages.add_argument(
        "--state", type=_state_list, help=f"only ranks in these states ({', '.join(RANK_STATES)})"
    )
    pages.add_argument(  # --host is the server's address
        "--on-host", metavar="HOSTS", help="only ranks on these hosts, like node3,node4"
    )
    pages.add_argument(
        "--limit",
        type=_positive_int,
        help="ranks in a page (default 500, at most 5000); with --summary: worst ranks (20)",
    )
    pages.add_argument("--offset", type=whole_number(0), help="skip this many matching ranks")
    return status


def _rank_list(text: str) -> str:
    """``--ranks``: checked here, so a typo is a usage error, not a server's refusal."""
    from ddpwatch.core.ranges import parse_rank_ranges

    try:
        parse_rank_ranges(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None
    return text


def _state_list(text: str) -> str:
    unknown = [s for s in (part.strip() for part in text.split(",")) if s not in RANK_STATES]
    if unknown:
        raise argparse.ArgumentTypeError(
            f"unknown state {unknown[0]!r}; known: {', '.join(RANK_STATES)}"
        )
    return text


def query_of(args: argparse.Namespace) -> Query | None:
    """The ``status?`` query the flags ask for; None for the whole document (no such flag)."""
    from ddpwatch.core.ranges import parse_rank_ranges

    given = (args.ranks, args.state, args.on_host, args.limit, args.offset)
    if not args.summary and all(v is None for v in given):
        return None
    filters = Query(
        ranks=None if args.ranks is None else parse_rank_ranges(args.ranks),
        states=_names(args.state),
        hosts=_names(args.on_host),
    )
    if args.summary:
        worst = DEFAULT_WORST if args.limit is None else args.limit
        return dataclasses.replace(filters, view="summary", worst=worst)
    limit = DEFAULT_LIMIT if args.limit is None else args.limit
    return dataclasses.replace(filters, offset=args.offset or 0, limit=limit)


def _names(text: str | None) -> frozenset[str] | None:
    """``--state`` and ``--on-host``: a comma-separated list."""
    return None if text is None else frozenset(name.strip() for name in text.split(","))


def run(args: argparse.Namespace) -> int:
    from ddpwatch.core.security import CurveKeyError, client_curve_keys
    from ddpwatch.status.client import StatusQueryError, fetch_reply, no_server

    try:
        curve = client_curve_keys() is not None
    except CurveKeyError as exc:
        print(f"ddpwatch: {exc}", file=sys.stderr)
        return 1
    if args.summary and args.offset is not None:
        print("ddpwatch: --offset pages through ranks; --summary has none", file=sys.stderr)
        return 2
    query = query_of(args)
    try:
        reply = fetch_reply(args.host, args.port, args.timeout, query=query)
        document = None if reply is None else _document(reply, query)
    except StatusQueryError as exc:
        print(f"ddpwatch: the server refused the query: {exc}", file=sys.stderr)
        return 1
    if reply is None or document is None:
        print(
            f"ddpwatch: {no_server(args.host, args.port, args.timeout, curve=curve)}",
            file=sys.stderr,
        )
        recorded = _last_recorded()
        if recorded is not None:
            print(f"ddpwatch: {recorded}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(json.loads(reply), indent=2))  # as the server sent it, every key
    elif isinstance(document, SummaryReply):
        print(format_summary(document))
    elif isinstance(document, PageReply):
        print(format_page(document))
    else:
        print(format_status(document))
    return 0


def _last_recorded() -> str | None:
    """Where the last ``ddpwatch run`` here left its story, once its server is gone: its
    recording, and the command that reads it."""
    import shlex
    import time

    from ddpwatch.jobs.launch import latest_recording
    from ddpwatch.status.fmt import duration

    path = latest_recording()
    if path is None:
        return None
    try:
        ago = duration(time.time() - path.stat().st_mtime)
    except OSError:
        return None
    return (
        f"the last ddpwatch run here ended {ago} ago (its server ended with it); what it "
        f"said is in its recording: ddpwatch report {shlex.quote(str(path))}"
    )


def _document(reply: bytes, query: Query | None) -> StatusDocument | None:
    """The reply decoded; None for a whole document that is none (as if no server answered),
    ``StatusQueryError`` for a refused query."""
    from ddpwatch.status.client import StatusQueryError, decode_reply

    try:
        return decode_reply(reply, query)
    except StatusQueryError:
        if query is not None:
            raise
        return None


def _fmt(value: Any, spec: str = "") -> str:
    if value is None:
        return "-"
    return format(value, spec) if spec else str(value)


def _collective(rank: RankEntry) -> str:
    coll = rank.collective
    return f"{coll.op} #{_fmt(coll.seq)} {coll.since_s:.1f}s" if coll else "-"


# (title, width, right-aligned, cell)
COLUMNS: tuple[tuple[str, int, bool, Callable[[RankEntry], str]], ...] = (
    ("rank", 5, True, lambda r: _fmt(r.rank)),
    ("host", 16, False, lambda r: _fmt(r.host)),
    ("pid", 7, True, lambda r: _fmt(r.pid)),
    ("device", 8, False, lambda r: _fmt(r.device)),
    ("state", 13, False, lambda r: r.state),
    ("phase", 11, False, lambda r: _fmt(r.phase)),
    ("step", 7, True, lambda r: _fmt(r.step)),
    ("loss", 9, True, lambda r: _fmt(r.loss, ".4g")),
    ("step s", 7, True, lambda r: _fmt(r.step_time_s, ".3f")),
    ("collective", 22, False, _collective),
    ("seen", 5, True, lambda r: _fmt(r.last_seen_s, ".1f")),
)


def _row(cells: list[str]) -> str:
    parts = []
    for (_, width, right, _cell), text in zip(COLUMNS, cells, strict=True):
        text = text[:width]
        parts.append(text.rjust(width) if right else text.ljust(width))
    return " ".join(parts).rstrip()


def _table(ranks: list[RankEntry]) -> list[str]:
    """The rank table: a header, then a row per rank entry."""
    lines = [_row([title for title, *_ in COLUMNS])]
    lines += [_row([cell(rank) for *_, cell in COLUMNS]) for rank in ranks]
    return lines


def _messages(stats: Stats) -> str:
    return (
        f"{stats.received} messages, {stats.rejected} rejected"
        + (f", {stats.failed} failed" if stats.failed else "")
        + (f", {stats.refused} refused" if stats.refused else "")
    )


def _alerts(alerts: list[AlertEntry]) -> list[str]:
    lines = []
    for alert in alerts:
        lines.append(f"[{alert.severity}] {alert.kind}: {alert.message}")
        lines.append(f"    fix: {alert.hint}")
    return lines or ["no alerts"]


def format_status(document: StatusDocument) -> str:
    """A plain-text table of the status document, for people, and the run's figures as the
    end-of-run summary words them (``outputs.summary.figures_lines``: the same duration,
    median step and time lost, figure for figure); once the job has ended, what its run said
    (``_ended``: the whole summary, those figures in it)."""
    from ddpwatch.outputs.summary import figures_lines

    lines = _table(document.ranks)
    connected = sum(1 for r in document.ranks if r.state != RankState.NOT_CONNECTED)
    lines.append(f"\n{connected}/{_fmt(document.world_size)} ranks, {_messages(document.stats)}")
    ended = _ended(document)
    if connected and not ended:
        lines += figures_lines(document)
    return "\n".join(lines + _alerts(document.alerts) + ended)


def _ended(document: StatusDocument) -> list[str]:
    """Once the job has ended (every rank seen has, or the ``ddpwatch run`` that launched it
    said so), the end-of-run summary: its alerts in order, with those that cleared, how each
    rank ended and the verdict, as ``ddpwatch run`` printed it. ``serve`` serves on after the
    job, and "no alerts" alone would drop what it said while the job ran."""
    from ddpwatch.diagnosis.job_end import job_end_of
    from ddpwatch.outputs.summary import summary_lines
    from ddpwatch.tui.data.story import ranks_finished

    if not ranks_finished(document) and job_end_of(document) is None:
        return []
    return ["", "the job has ended:", *("  " + line for line in summary_lines(document))]


def format_page(document: PageReply) -> str:
    """A page of ranks (``status?view=page``): the table, and where it lies among the matches."""
    page = document.page
    shown, start = len(document.ranks), page.offset
    if shown:
        where = f"ranks {start + 1}-{start + shown} of {page.matched} matching"
    else:
        where = f"no ranks here of {page.matched} matching"
    more = start + shown < page.matched
    lines = _table(document.ranks) if shown else []
    lines.append(
        f"\n{where} ({page.total} in all)"
        + (f"; --offset {start + shown} for more" if more else "")
    )
    lines.append(_messages(document.stats))
    return "\n".join(lines + _alerts(document.alerts))


def format_summary(document: SummaryReply) -> str:
    """The summary (``status?view=summary``): counts by state, a row per host, the worst
    ranks in the status table's format, then the alerts."""
    summary, page = document.summary, document.page
    counted = f"{summary.ranks} ranks" + (f" of {page.total}" if page.matched != page.total else "")
    lines = [f"{counted}: {_state_counts(summary.states) or 'none'}", "", _host_header()]
    lines += [_host_line(row) for row in summary.hosts]
    if summary.hosts_omitted:
        lines.append(f"(+{summary.hosts_omitted} more hosts)")
    if document.ranks:
        lines += ["", f"worst {len(document.ranks)} ranks:", *_table(document.ranks)]
    lines.append(f"\n{_messages(document.stats)}")
    return "\n".join(lines + _alerts(document.alerts))


def _state_counts(states: dict[str, int]) -> str:
    """``"1 crashed, 3 running"``: the states with ranks, worst first."""
    return ", ".join(f"{states[s]} {s}" for s in RANK_STATES if states.get(s))


def _host_header() -> str:
    return f"{'host':<16} {'ranks':>6}  {'states':<36} steps"


def _host_line(row: HostRow) -> str:
    low, high = row.step_min, row.step_max
    steps = "-" if low is None else str(low) if low == high else f"{low}-{high}"
    host = _fmt(row.host)[:16]
    return f"{host:<16} {row.ranks:>6}  {_state_counts(row.states):<36} {steps}".rstrip()
