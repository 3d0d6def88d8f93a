"""At the end of a run, its account to the trackers the user asked for (``--mlflow``,
``--wandb``).

``ddpwatch run`` and ``serve`` call it once the final document is judged, ``report`` on the
document a recording replays to. The report's JSON and HTML go with it where the run was
recorded. One line says where the account went, or why it could not.
"""

from __future__ import annotations

import functools
import sys
from collections.abc import Callable
from dataclasses import dataclass
from typing import IO

from ddpwatch.outputs.handoff import Handoff, handoff
from ddpwatch.status.schema import StatusDocument

Files = tuple[str, str]
"""The report as JSON and as HTML."""


def report_files(recording: str) -> Files | None:
    """The report of ``recording`` as JSON and HTML; None when it cannot be made (the account
    goes without them: the end of a run never fails for its report)."""
    from ddpwatch.outputs.report import load_run, render
    from ddpwatch.server.replay import replay_to_end

    try:
        run = load_run(recording, *replay_to_end(recording))
        return render([run], "json"), render([run], "html")
    except Exception:  # a recording cut short, unreadable, or a fault of the report's own
        return None


def account(
    document: StatusDocument, recording: str | None = None, files: Files | None = None
) -> Handoff:
    """The run's account, with its report's files (``files``, else made from ``recording``)."""
    if files is None and recording is not None:
        files = report_files(recording)
    return handoff(document, *(files or (None, None)))


@dataclass(frozen=True)
class Trackers:
    """Where a run's account goes (``--mlflow``, ``--wandb``)."""

    mlflow: bool = False
    mlflow_run_id: str | None = None
    wandb: bool = False
    wandb_alert: bool = False


def hand_off(
    document: StatusDocument,
    trackers: Trackers,
    *,
    recording: str | None = None,
    files: Files | None = None,
    run_name: str = "ddpwatch",
    out: IO[str] | None = None,
    prefix: str = "ddpwatch",
) -> bool:
    """Log the run to each tracker asked for; say where in one line each (or why not) on
    ``out``. True when every one took it."""
    from ddpwatch.outputs.mlflow_handoff import TrackerError, log_to_mlflow
    from ddpwatch.outputs.wandb_handoff import log_to_wandb

    out = sys.stderr if out is None else out
    try:
        made = account(document, recording, files)
    except Exception as exc:  # never a traceback at the end of a run
        print(f"{prefix}: the run was not logged: its account could not be made: {exc!r}", file=out)
        return False
    sends: list[tuple[str, Callable[[], str]]] = []
    if trackers.mlflow:
        mlflow = functools.partial(
            log_to_mlflow, made, run_id=trackers.mlflow_run_id, run_name=run_name
        )
        sends.append(("MLflow run {} (artifacts under ddpwatch/)", mlflow))
    if trackers.wandb:
        wandb = functools.partial(log_to_wandb, made, alert=trackers.wandb_alert, run_name=run_name)
        sends.append(("W&B run {} (artifact ddpwatch-report)", wandb))
    ok = True
    for where, send in sends:
        try:
            run = send()
        except TrackerError as exc:
            print(f"{prefix}: the run was not logged: {exc}", file=out)
            ok = False
        else:
            print(f"{prefix}: logged to {where.format(run)}", file=out)
    return ok
