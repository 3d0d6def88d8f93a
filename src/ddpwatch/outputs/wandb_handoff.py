"""The run's account in Weights & Biases (``--wandb`` on ``run``, ``serve`` and ``report``).

W&B's own settings apply (``WANDB_API_KEY``, ``WANDB_PROJECT``, ``WANDB_ENTITY``,
``WANDB_MODE=offline``...). The training script's run is resumed when its id is known
(``WANDB_RUN_ID``, which ``ddpwatch run`` and the ranks share); otherwise a new run is made in
``WANDB_PROJECT`` (default ``ddpwatch``), job type ``ddpwatch``. The run's summary gets the
tags and metrics of ``handoff.py`` (as ``ddpwatch/...`` keys), a table holds the per-rank rows,
an artifact of type ``ddpwatch-report`` holds the files, and with ``alert`` a W&B alert says
the verdict when it names a culprit. Needs ``wandb`` (``pip install 'ddpwatch[wandb]'``).
"""

from __future__ import annotations

import importlib
import os
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

from ddpwatch.outputs.handoff import RANK_FIELDS, Handoff
from ddpwatch.outputs.mlflow_handoff import TrackerError

DEFAULT_PROJECT = "ddpwatch"


def available() -> str | None:
    """None when W&B can be imported, else how to get it."""
    try:
        import wandb  # noqa: F401
    except ImportError:
        return "--wandb needs W&B: pip install 'ddpwatch[wandb]'"
    return None


def _key(name: str) -> str:
    """``ddpwatch.time_lost_s`` as W&B's panels group it: ``ddpwatch/time_lost_s``."""
    return name.replace("ddpwatch.", "ddpwatch/", 1)


def log_to_wandb(
    account: Handoff,
    *,
    alert: bool = False,
    run_name: str = "ddpwatch",
    env: Mapping[str, str] | None = None,
) -> str:
    """Log ``account`` to the script's run (``WANDB_RUN_ID``) or a new one; the run's path
    (``entity/project/id``, or the id offline). Raises ``TrackerError``."""
    env = os.environ if env is None else env
    try:
        wandb: Any = importlib.import_module("wandb")  # loosely typed: its API moves
        run_id = env.get("WANDB_RUN_ID") or None
        run = wandb.init(
            project=env.get("WANDB_PROJECT") or DEFAULT_PROJECT,
            id=run_id,
            resume="allow" if run_id else None,
            name=None if run_id else run_name,
            job_type=None if run_id else "ddpwatch",
            settings=wandb.Settings(silent=True, console="off"),
        )
        try:
            summary: dict[str, str | float] = {_key(k): v for k, v in account.tags.items()}
            summary.update({_key(k): v for k, v in account.metrics.items()})
            run.summary.update(summary)
            columns = [*RANK_FIELDS, "lost_s"]
            rows = [[row.get(c) for c in columns] for row in account.ranks]
            run.log({"ddpwatch/ranks": wandb.Table(columns=columns, data=rows)})
            artifact = wandb.Artifact(f"ddpwatch-report-{run.id}", type="ddpwatch-report")
            with tempfile.TemporaryDirectory(prefix="ddpwatch-wandb-") as folder:
                for name, data in account.files.items():
                    file = Path(folder) / name
                    file.write_bytes(data)
                    artifact.add_file(str(file), name=name)
                run.log_artifact(artifact)  # uploaded by ``finish``, before it returns
            culprits = account.tags.get("ddpwatch.culprits", "none")
            if alert and culprits != "none":
                ranks = "ranks" if "," in culprits else "rank"
                run.alert(
                    title=f"ddpwatch: {ranks} {culprits}",
                    text=account.tags.get("ddpwatch.verdict", ""),
                    level=wandb.AlertLevel.ERROR if account.failed else wandb.AlertLevel.WARN,
                )
            where = str(run.id if run.settings.mode == "offline" else run.path)
        finally:
            run.finish(exit_code=1 if account.failed else 0)
    except Exception as exc:  # W&B's own errors, its network errors, a bad key
        reason = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise TrackerError(f"W&B: {reason[:300]}") from None
    return where
