"""The run's account in MLflow (``--mlflow`` on ``run``, ``serve`` and ``report``).

Through ``MlflowClient`` (not MLflow's fluent API, whose active run belongs to the process
that opened it): the tracking URI is MLflow's own (``MLFLOW_TRACKING_URI``). The training
script's run is used when its id is known (``MLFLOW_RUN_ID``, which ``ddpwatch run`` and the
ranks share, or ``--mlflow-run-id``), and left open for the script; otherwise a new run is made
in ``MLFLOW_EXPERIMENT_NAME`` (or ``MLFLOW_EXPERIMENT_ID``, else MLflow's default experiment)
and ended FINISHED or FAILED as the job did. Tags, metrics and the files of ``handoff.py`` under
``ddpwatch/``. Needs ``mlflow-skinny`` (``pip install 'ddpwatch[mlflow]'``); a tracker that
cannot be reached is one line, never a failure of the run.
"""

from __future__ import annotations

import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpwatch.outputs.handoff import Handoff

ARTIFACT_DIR = "ddpwatch"
HTTP_DEFAULTS = {"MLFLOW_HTTP_REQUEST_MAX_RETRIES": "2", "MLFLOW_HTTP_REQUEST_TIMEOUT": "20"}
"""MLflow's HTTP retries, bounded unless the user set them: its own defaults (7 retries,
backoff doubling) would hold the end of a run for minutes on a tracker that is down."""


class TrackerError(Exception):
    """The tracker could not take the run's account: its one-line reason."""


def available() -> str | None:
    """None when MLflow can be imported, else how to get it."""
    try:
        import mlflow  # noqa: F401
    except ImportError:
        return "--mlflow needs MLflow: pip install 'ddpwatch[mlflow]'"
    return None


def _experiment_id(client: Any, env: Mapping[str, str]) -> str:
    named = env.get("MLFLOW_EXPERIMENT_NAME")
    if named:
        found = client.get_experiment_by_name(named)
        return str(found.experiment_id if found is not None else client.create_experiment(named))
    return env.get("MLFLOW_EXPERIMENT_ID") or "0"


def log_to_mlflow(
    account: Handoff,
    *,
    run_id: str | None = None,
    run_name: str = "ddpwatch",
    env: Mapping[str, str] | None = None,
) -> str:
    """Log ``account`` to the run ``run_id`` (else ``MLFLOW_RUN_ID``, else a new run); the
    run's id. Raises ``TrackerError``."""
    env = os.environ if env is None else env
    for name, value in HTTP_DEFAULTS.items():
        os.environ.setdefault(name, value)  # MLflow reads them from the process's environment
    try:
        from mlflow.entities import Metric, RunTag
        from mlflow.tracking import MlflowClient

        client = MlflowClient(tracking_uri=env.get("MLFLOW_TRACKING_URI") or None)
        run_id = run_id or env.get("MLFLOW_RUN_ID") or None
        ours = run_id is None
        if run_id is None:
            run = client.create_run(_experiment_id(client, env), run_name=run_name)
            run_id = run.info.run_id
        import time

        now_ms = int(time.time() * 1000)
        client.log_batch(
            run_id,
            metrics=[Metric(k, v, now_ms, 0) for k, v in account.metrics.items()],
            tags=[RunTag(k, v) for k, v in account.tags.items()],
        )
        with tempfile.TemporaryDirectory(prefix="ddpwatch-mlflow-") as folder:
            for name, data in account.files.items():
                (Path(folder) / name).write_bytes(data)
            client.log_artifacts(run_id, folder, ARTIFACT_DIR)
        if ours:
            client.set_terminated(run_id, "FAILED" if account.failed else "FINISHED")
    except Exception as exc:  # the tracker's own exceptions, its HTTP errors, a bad URI
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrackerError(f"MLflow: {reason[:300]}") from None
    return run_id
