"""How ``ddpwatch doctor`` prints its checks: a header, one line per check with its fix unless
it passed, and a summary; in words instead of marks where the stream cannot encode them."""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import IO

from ddpwatch.doctor.checks import Check, plural
from ddpwatch.doctor.gather import Setup

MARKS: dict[str, str] = {"ok": "✔", "fail": "✖", "warn": "⚠", "skip": "\u2013"}  # en dash
ASCII_MARKS: dict[str, str] = {"ok": "[ok]", "fail": "[FAIL]", "warn": "[warn]", "skip": "[skip]"}


def header(setup: Setup) -> str:
    if setup.nproc is not None:
        ranks = f"{plural(setup.nproc, 'rank')} per node ({setup.nproc_source})"
    else:
        ranks = "ranks per node unknown"
    return (
        f"ddpwatch doctor on {setup.hostname}: {ranks}, "
        f"backend {setup.backend} ({setup.backend_source})"
    )


def summary(checks: Sequence[Check]) -> str:
    counts = {status: sum(1 for c in checks if c.status == status) for status in MARKS}
    return (
        f"{counts['ok']} ok, {counts['fail']} failed, "
        f"{plural(counts['warn'], 'warning')}, {counts['skip']} skipped"
    )


def report(setup: Setup, checks: Sequence[Check], marks: Mapping[str, str] = MARKS) -> list[str]:
    """The lines doctor prints: a header, each check (and its fix unless it passed), a summary."""
    lines = [header(setup)]
    for check in checks:
        lines.append(f"{marks[check.status]} {check.name}: {check.what}")
        if check.fix and check.status != "ok":
            lines.append(f"    fix: {check.fix}")
    lines.append(summary(checks))
    return lines


def marks_for(stream: IO[str]) -> dict[str, str]:
    """The marks where the stream can encode them (a job log in an ASCII locale cannot)."""
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        "".join(MARKS.values()).encode(encoding)
    except (UnicodeError, LookupError):
        return ASCII_MARKS
    return MARKS


def write(lines: Sequence[str], stream: IO[str]) -> None:
    """``lines`` to ``stream``, what it cannot encode replaced by ``?``."""
    text = "\n".join(lines) + "\n"
    encoding = getattr(stream, "encoding", None) or "utf-8"
    try:
        text.encode(encoding)
    except (UnicodeError, LookupError):
        text = text.encode("ascii", "replace").decode("ascii")
    stream.write(text)
    stream.flush()
