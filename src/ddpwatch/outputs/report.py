"""``ddpwatch report FILE [FILE2]``: a recording as a post-mortem (Markdown, HTML or JSON),
or two recordings side by side, to answer "did my fix help?". No server is needed.

The pieces: ``postmortem`` loads a recording into a ``RunReport``; ``report_text`` and
``report_html`` render it; ``report_svg`` draws the charts. This module is their front
door; the command line is ``commands/report.py``.
"""

from __future__ import annotations

from collections.abc import Callable

from ddpwatch.outputs.postmortem import RunReport, load_run
from ddpwatch.outputs.report_html import compare_html, to_html
from ddpwatch.outputs.report_text import compare_json, compare_markdown, to_json, to_markdown

__all__ = [
    "FORMATS",
    "RunReport",
    "compare_html",
    "compare_json",
    "compare_markdown",
    "load_run",
    "render",
    "to_html",
    "to_json",
    "to_markdown",
]

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
