"""At the end of a run, its account to the trackers the user asked for (``--mlflow``).

``ddpwatch run`` and ``serve`` call it once the final document is judged, ``report`` on the
document a recording replays to. The report's JSON and HTML go with it where the run was
recorded. One line says where the account went, or why it could not.
"""

from __future__ import annotations

import sys
from typing import IO

from ddpwatch.outputs.handoff import Handoff, handoff
from ddpwatch.status.schema import StatusDocument

Files = tuple[str, str]
"""The report as JSON and as HTML."""


def report_files(recording: str) -> Files | None:
    """The report of ``recording`` as JSON and HTML; None when it cannot be read."""
    from ddpwatch.outputs.report import load_run, render
    from ddpwatch.server.recording import RecordingError
    from ddpwatch.server.replay import replay_to_end

    try:
        run = load_run(recording, *replay_to_end(recording))
    except (RecordingError, OSError):
        return None
    return render([run], "json"), render([run], "html")


def account(
    document: StatusDocument, recording: str | None = None, files: Files | None = None
) -> Handoff:
    """The run's account, with its report's files (``files``, else made from ``recording``)."""
    if files is None and recording is not None:
        files = report_files(recording)
    return handoff(document, *(files or (None, None)))


def hand_off(
    document: StatusDocument,
    *,
    recording: str | None = None,
    files: Files | None = None,
    mlflow_run_id: str | None = None,
    run_name: str = "ddpwatch",
    out: IO[str] | None = None,
    prefix: str = "ddpwatch",
) -> bool:
    """Log the run to MLflow; say where in one line (or why not) on ``out``. True when
    logged."""
    from ddpwatch.outputs.mlflow_handoff import TrackerError, log_to_mlflow

    out = sys.stderr if out is None else out
    try:
        run_id = log_to_mlflow(
            account(document, recording, files), run_id=mlflow_run_id, run_name=run_name
        )
    except TrackerError as exc:
        print(f"{prefix}: the run was not logged: {exc}", file=out)
        return False
    print(f"{prefix}: logged to MLflow run {run_id} (artifacts under ddpwatch/)", file=out)
    return True
