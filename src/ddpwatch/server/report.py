"""``ddpwatch report FILE [FILE2]``: a recording as a post-mortem (Markdown, HTML or JSON),
or two recordings side by side, to answer "did my fix help?". No server is needed.

The pieces: ``postmortem`` loads a recording into a ``RunReport``; ``report_text`` and
``report_html`` render it; ``report_svg`` draws the charts. This module is their front door.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path

from ddpwatch.server.postmortem import RunReport, load_run
from ddpwatch.server.recording import RecordingError
from ddpwatch.server.report_html import compare_html, to_html
from ddpwatch.server.report_text import compare_json, compare_markdown, to_json, to_markdown

__all__ = [
    "FORMATS",
    "RunReport",
    "compare_html",
    "compare_json",
    "compare_markdown",
    "load_run",
    "render",
    "report_main",
    "to_html",
    "to_json",
    "to_markdown",
]

log = logging.getLogger("ddpwatch")

FORMATS = ("md", "html", "json")
_ONE: dict[str, Callable[[RunReport], str]] = {
    "md": to_markdown,
    "html": to_html,
    "json": to_json,
}
_TWO: dict[str, Callable[[list[RunReport]], str]] = {
    "md": compare_markdown,
    "html": compare_html,
    "json": compare_json,
}


def render(runs: list[RunReport], fmt: str = "md") -> str:
    """One run's report, or the comparison of two, in ``fmt`` (md, html or json)."""
    if len(runs) == 1:
        return _ONE[fmt](runs[0])
    return _TWO[fmt](runs)


def report_main(args: argparse.Namespace) -> int:
    """``ddpwatch report FILE [FILE2] [--format md|html|json] [-o PATH]``."""
    paths = [args.file] + ([args.other] if args.other else [])
    try:
        runs = [load_run(path) for path in paths]
    except RecordingError as exc:
        print(f"ddpwatch report: {exc}", file=sys.stderr)
        return 1
    for run in runs:
        if run.tail_bytes:
            log.warning(
                "%s ends in a partial record: its last %d bytes were not read",
                run.path,
                run.tail_bytes,
            )
    text = render(runs, args.format)
    if args.output is None:
        sys.stdout.write(text)
        sys.stdout.flush()
        return 0
    output = Path(args.output)
    try:
        output.write_text(text, encoding="utf-8")
    except OSError as exc:
        print(f"ddpwatch report: cannot write {output}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    print(output)
    return 0
