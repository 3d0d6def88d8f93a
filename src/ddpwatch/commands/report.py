"""``ddpwatch report FILE [FILE2]``: a post-mortem of a recording, or two side by side
(``outputs/report.py`` renders them)."""

from __future__ import annotations

import argparse
import logging
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ddpwatch.commands._args import Subparsers, add_trackers, trackers, trackers_refused

if TYPE_CHECKING:
    from ddpwatch.outputs.postmortem import RunReport

NAME = "report"

log = logging.getLogger("ddpwatch")


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    report = subparsers.add_parser(
        NAME, help="a post-mortem of a serve --record file; two files: compare them"
    )
    report.add_argument("file", help="a recording made by ddpwatch serve --record")
    report.add_argument(
        "other", nargs="?", default=None, help="a second recording: the two runs side by side"
    )
    report.add_argument(
        "--format", choices=("md", "html", "json"), default="md", help="output format (default md)"
    )
    report.add_argument(
        "-o", "--output", metavar="PATH", default=None, help="write here (default: stdout)"
    )
    add_trackers(report)
    return report


def run(args: argparse.Namespace) -> int:
    """``ddpwatch report FILE [FILE2] [--format md|html|json] [-o PATH]``."""
    from ddpwatch.outputs.report import load_run, render
    from ddpwatch.server.recording import RecordingError
    from ddpwatch.server.replay import replay_to_end

    paths = [args.file] + ([args.other] if args.other else [])
    refused = trackers_refused(args)
    if refused is None and (args.mlflow or args.wandb) and args.other:
        refused = "--mlflow and --wandb log one run: give one recording"
    if refused is not None:
        print(f"ddpwatch report: {refused}", file=sys.stderr)
        return 2
    try:
        runs = [load_run(path, *replay_to_end(path)) for path in paths]
    except RecordingError as exc:
        print(f"ddpwatch report: {exc}", file=sys.stderr)
        return 1
    for one in runs:
        if one.tail_bytes:
            log.warning(
                "%s ends in a partial record: its last %d bytes were not read",
                one.path,
                one.tail_bytes,
            )
    text = render(runs, args.format)
    if (args.mlflow or args.wandb) and not _hand_off(runs[0], args):
        return 1
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


def _hand_off(run: RunReport, args: argparse.Namespace) -> bool:
    """The recorded run's account to the trackers asked for, with the report as JSON and
    HTML."""
    from ddpwatch.jobs.handoff import hand_off
    from ddpwatch.outputs.report import render

    files = (render([run], "json"), render([run], "html"))
    asked = trackers(args)
    assert asked is not None
    name = Path(run.path).stem
    return hand_off(run.document, asked, files=files, run_name=name, prefix="ddpwatch report")
