"""``ddpwatch run -- COMMAND``: a launch command, ddpwatch in every rank (``jobs/launch.py``)."""

from __future__ import annotations

import argparse
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from ddpwatch.commands._args import (
    Subparsers,
    _addr,
    add_bell,
    add_notify,
    add_otlp,
    add_trackers,
    notifier,
    otlp_exporter,
    trackers,
    trackers_refused,
)

if TYPE_CHECKING:
    from ddpwatch.jobs.launch import Tracker
    from ddpwatch.status.schema import StatusDocument

NAME = "run"


def add_parser(subparsers: Subparsers) -> argparse.ArgumentParser:
    parser = subparsers.add_parser(
        NAME,
        help="run a launch command with ddpwatch in every rank, no code change",
        usage="ddpwatch run [-h] [--addr HOST:PORT] [--tui] [--record FILE | --no-record] "
        "[--no-relay] [--otlp URL] [--otlp-max-ranks N] [--mlflow] [--mlflow-run-id ID] "
        "[--wandb] [--wandb-alert] [--notify-cmd CMD] [--webhook URL] "
        "[--notify-level LEVEL] [--notify-interval S] [--no-bell] -- COMMAND ...",
    )
    parser.add_argument(
        "--addr",
        type=_addr,
        default=None,
        help="a running ddpwatch serve (default: collect here and print alerts)",
    )
    parser.add_argument(
        "--tui",
        action="store_true",
        help="show the dashboard here; the job's output goes to a file",
    )
    recording = parser.add_mutually_exclusive_group()
    recording.add_argument(
        "--record",
        metavar="FILE",
        default=None,
        help="record the run here (default: ddpwatch-<script>-<time>.ddpw in "
        "$DDPWATCH_RECORD_DIR or ./ddpwatch-runs, the last 20 kept; ddpwatch report FILE "
        "reads it)",
    )
    recording.add_argument("--no-record", action="store_true", help="do not record the run")
    parser.add_argument(
        "--no-relay",
        action="store_true",
        help="with --addr: ranks send to the server directly, not through a relay on this node",
    )
    add_otlp(parser)
    add_trackers(parser)
    add_notify(parser)
    add_bell(parser)
    parser.add_argument("job", nargs=argparse.REMAINDER, help="the launch command, after --")
    return parser


def run(args: argparse.Namespace) -> int:
    from ddpwatch.jobs.launch import default_recording, prune_recordings, run_command

    job = args.job[1:] if args.job[:1] == ["--"] else args.job
    if args.addr is not None:
        for asked, what, flags in (
            (args.notify_cmd or args.webhook, "the alerts are", "--notify-cmd/--webhook"),
            (args.mlflow or args.wandb, "the run's account is", "--mlflow/--wandb"),
            (args.otlp, "the export is", "--otlp"),
            (args.record, "the run is", "--record"),
        ):
            if asked:
                print(f"ddpwatch run: with --addr {what} that serve's: give it {flags}",
                      file=sys.stderr)  # fmt: skip
                return 2
    refused = trackers_refused(args)
    if refused is not None:
        print(f"ddpwatch run: {refused}", file=sys.stderr)
        return 2
    otlp = None
    if args.addr is None:
        try:
            otlp = otlp_exporter(args)
        except ValueError as exc:
            print(f"ddpwatch run: {exc}", file=sys.stderr)
            return 2
    record = None
    if args.addr is None and not args.no_record:
        record = args.record or default_recording(job)
        if not args.record:
            prune_recordings(Path(record).parent)
    return run_command(
        job,
        args.addr,
        args.tui,
        notify=notifier(args),
        otlp=otlp,
        tracker=_tracker(args, job),
        bell=not args.no_bell,
        record=record,
        relay=not args.no_relay,
    )


def _tracker(args: argparse.Namespace, job: list[str]) -> Tracker | None:
    """The hand-off ``run_command`` calls at the end of the run (``jobs/handoff.py``)."""
    asked = trackers(args)
    if asked is None:
        return None
    from ddpwatch.jobs.handoff import hand_off

    def track(document: StatusDocument, recording: str | None) -> None:
        name = Path(recording).stem if recording else "ddpwatch-" + Path(job[0]).name
        hand_off(document, asked, recording=recording, run_name=name, prefix="ddpwatch run")

    return track
