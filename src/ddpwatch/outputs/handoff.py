"""What a run leaves in an experiment tracker (MLflow, W&B), from the run's final status document.

One payload for every tracker, read from the published contract (``status/schema.py``): the
document's ``verdict`` (judged by the server, the same sentence the summary, ``status`` and the
report print), its time lost per culprit, the alert timeline (``history``) and a row per rank.
Tags are short strings a run list can filter on (``ddpwatch.culprits = 3``); metrics are the
figures a run list can sort on; the files are the JSON documents themselves.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import msgspec

from ddpwatch.status.schema import RankEntry, StatusDocument

CULPRITS_KEPT = 100
"""Culprits with a metric of their own (``ddpwatch.time_lost_s.rank_N``), the most time lost
first: a batch of metrics stays within what trackers take (MLflow: 1000 a batch) at any job
size; every rank's share is in ``ranks.json`` all the same."""
TAG_LIMIT = 5000
"""Characters a tag value keeps (MLflow's limit on older servers; 8000 on newer ones)."""
RANK_FIELDS = (
    "rank", "local_rank", "host", "device", "state", "step", "median_step_s", "loss",
    "mem_peak_bytes", "host_rss_bytes", "exit_code", "exit_signal", "attempt",
)  # fmt: skip
"""The columns of the per-rank summary: who each rank was, how far it got, how it ended."""


@dataclass(frozen=True)
class Handoff:
    """A run's account for a tracker."""

    tags: dict[str, str]
    metrics: dict[str, float]
    ranks: list[dict[str, Any]]
    """A row per rank (``RANK_FIELDS``), with ``lost_s``: the time the others lost to it."""
    files: dict[str, bytes] = field(default_factory=dict)
    """Artifact path (under ``ddpwatch/``) → its bytes: the status document, the timeline,
    the per-rank summary, and the report's JSON and HTML where the run was recorded."""
    failed: bool = False
    """The job ended by a failure (a rank crashed, exited non-zero or was killed)."""


def _row(rank: RankEntry, lost: dict[int, float]) -> dict[str, Any]:
    row = {name: getattr(rank, name) for name in RANK_FIELDS}
    row["lost_s"] = round(lost.get(rank.rank, 0.0), 3)
    return row


def _failed(document: StatusDocument) -> bool:
    end = document.job_end
    if not isinstance(end, msgspec.UnsetType) and end.stopped_by is None:
        if end.not_started is not None:
            return True
        if end.exit_code is not None or end.exit_signal is not None:
            return end.exit_code != 0
    return any(
        rank.error is not None or (rank.exit_code not in (None, 0)) or rank.exit_signal
        for rank in document.ranks
    )


def handoff(
    document: StatusDocument, report_json: str | None = None, report_html: str | None = None
) -> Handoff:
    """The account of the run ``document`` ends, with the report's files when given."""
    verdict = document.verdict
    lost: dict[int, float] = {}
    tags = {"ddpwatch.ranks": str(len(document.ranks)), "ddpwatch.attempts": str(document.attempt)}
    metrics: dict[str, float] = {
        "ddpwatch.ranks": float(len(document.ranks)),
        "ddpwatch.alerts_raised": float(sum(e.event == "raised" for e in document.history)),
    }
    if verdict is not None:
        tags["ddpwatch.verdict"] = verdict.text[:TAG_LIMIT]
        tags["ddpwatch.culprits"] = ",".join(map(str, verdict.named)) or "none"
        for entry in verdict.time_lost:
            lost[entry.rank] = lost.get(entry.rank, 0.0) + entry.seconds
        metrics["ddpwatch.time_lost_s"] = round(sum(lost.values()), 3)
        most = sorted(lost.items(), key=lambda item: (-item[1], item[0]))[:CULPRITS_KEPT]
        for rank, seconds in sorted(most):
            metrics[f"ddpwatch.time_lost_s.rank_{rank}"] = round(seconds, 3)
        if verdict.run_s is not None:
            metrics["ddpwatch.run_s"] = verdict.run_s
        if verdict.median_step_s is not None:
            metrics["ddpwatch.median_step_s"] = verdict.median_step_s
    jobs = {rank.job_id for rank in document.ranks if rank.job_id}
    if len(jobs) == 1:
        tags["ddpwatch.job_id"] = jobs.pop()
    rows = [_row(rank, lost) for rank in document.ranks]
    files = {
        "status.json": msgspec.json.format(msgspec.json.encode(document)),
        "timeline.json": msgspec.json.format(msgspec.json.encode(document.history)),
        "ranks.json": msgspec.json.format(msgspec.json.encode(rows)),
    }
    if report_json is not None:
        files["report.json"] = report_json.encode()
    if report_html is not None:
        files["report.html"] = report_html.encode()
    return Handoff(tags=tags, metrics=metrics, ranks=rows, files=files, failed=_failed(document))
