"""The report's JSON (``ddpwatch report --format json``) as msgspec Structs: what
``outputs/report_text.py`` fills in, and what its published JSON Schema is generated from
(``status/contract.py``).

A contract like the status document: keys are only ever added, each is always written
(``null`` when unknown), and the status document it ends with is the one of
``status/schema.py``. The keys are written sorted, two-space indented, NaN and infinity as
null. Its episodes and accounts of time lost are the status document's verdict's
(``EpisodeEntry``, ``TimeLost``): the report words the run the replay judged.
"""

from __future__ import annotations

from typing import Final

import msgspec

from ddpwatch.status.schema import EpisodeEntry, RankError, StatusDocument, TimeLost

REPORT_SCHEMA: Final = 1
"""The report's ``report`` (and a comparison's ``comparison``): fields are only added."""


class ReportRank(msgspec.Struct, gc=False):
    """One rank's numbers: its last state, steps, median step, peak memory, and the kinds of
    the alerts that named it, in the order they were raised."""

    rank: int
    host: str | None
    state: str | None
    steps: int | None
    median_step_time_s: float | None
    peak_mem_bytes: int | None
    alerts: list[str]


class ReportAlert(msgspec.Struct, gc=False):
    """An alert that named a culprit, as it last stood."""

    kind: str
    severity: str
    message: str
    hint: str


class ReportCulprit(msgspec.Struct, gc=False):
    """A rank an alert named: where it ended, what was said of it, its stack and last output."""

    rank: int
    state: str | None
    step: int | None
    alerts: list[ReportAlert]
    error: RankError | None
    stack: str | None
    log_tail: list[str]


class ReportHint(msgspec.Struct, gc=False):
    """A fix, once per alert kind and text, as the live alert last gave it."""

    kind: str
    hint: str


class ReportAttempt(msgspec.Struct, gc=False):
    """The verdict of one attempt of a restarted job."""

    attempt: int
    verdict: str


class ReportDocument(msgspec.Struct, kw_only=True, gc=False):
    """The whole report: the verdict and the summary's lines, the file read, the run's and
    each rank's numbers, the culprits, the fixes, the episodes and time lost, each attempt's
    verdict, each rank's series (``samples``, then per metric ``[[t, value], ...]`` with ``t``
    in seconds from ``t0``), and the status document as the recording left it."""

    report: int = REPORT_SCHEMA
    file: str
    verdict: str
    summary: list[str]
    notes: list[str]
    duration_s: float | None
    t0: float | None
    frames: int
    undecodable_frames: int
    tail_bytes: int
    sessions: int
    median_step_time_s: float | None
    slowest_step_time_s: float | None
    peak_mem_bytes: int | None
    ranks: list[ReportRank]
    culprits: list[ReportCulprit]
    hints: list[ReportHint]
    episodes: list[EpisodeEntry]
    time_lost: list[TimeLost]
    attempts: list[ReportAttempt]
    series: dict[str, dict[str, int | list[list[float]]]]
    status: StatusDocument
