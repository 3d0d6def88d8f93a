"""The status document's schema (``docs/status.md``), as msgspec Structs: the server encodes
into them, the views decode into them and read typed attributes.

The JSON is a contract, byte for byte: fields encode in the order declared here, a key the
contract always writes is always written (``null`` when unknown), and the keys it writes only
sometimes are ``UNSET`` (``Stats.refused``, ``StatusDocument.job_end`` and ``replay``, the
replies' ``page`` and ``summary``, a timeline entry's ``from``, ``duration_s`` and
``closed_by``) or, in alerts, omitted while None (``omit_defaults``).
``tests/status/test_status_contract.py`` holds the bytes.

Decoding takes a document from an older server, which lacks keys added since: every always
written key but the few that name a thing (a rank's ``rank`` and ``state``, an alert's) has a
default. Unknown keys from a newer server are ignored. Every Struct here is ``gc=False``: a
document holds no cycles, and 65,536 rank entries must not weigh on the cyclic collector.
"""

from __future__ import annotations

from typing import Final

import msgspec
from msgspec import UNSET, UnsetType

SCHEMA: Final = 1
"""The document's ``schema``: fields are only ever added, so it stays 1."""

__all__ = [
    "SCHEMA",
    "UNSET",
    "AlertEntry",
    "AttemptVerdict",
    "CollectiveCounts",
    "CollectiveWait",
    "EpisodeEntry",
    "FinalCollective",
    "HistoryEntry",
    "HostRow",
    "JobEnd",
    "PageInfo",
    "PageReply",
    "PastAttemptEntry",
    "PreviousAlert",
    "RankEntry",
    "RankError",
    "Refused",
    "RelayEntry",
    "ReplayInfo",
    "Stats",
    "StatusDocument",
    "Summary",
    "SummaryPageInfo",
    "SummaryReply",
    "TimeLost",
    "UnsetType",
    "Verdict",
]


class CollectiveWait(msgspec.Struct, gc=False):
    """A rank's ``collective``: the one it waits in right now, and for how long; for a send or
    a receive, the rank it waits for (``peer``)."""

    op: str
    seq: int | None = None
    since_s: float = 0.0
    peer: int | None = None


class FinalCollective(msgspec.Struct, gc=False):
    """A rank's ``final_collective``: the one it was in when it crashed or exited."""

    op: str
    seq: int | None = None
    shape: list[int] | None = None
    dtype: str | None = None


class RankError(msgspec.Struct, gc=False):
    """A rank's ``error``: the exception it died with."""

    type: str
    message: str = ""
    traceback: str = ""


class CollectiveCounts(msgspec.Struct, gc=False):
    """A rank's ``collectives``: how many it had entered, Python-level (``py``) and by the
    flight recorder's process group (``fr``)."""

    py: int = 0
    fr: dict[str, int] | None = None


class RankEntry(msgspec.Struct, kw_only=True, gc=False):
    """One rank (docs/status.md, "A rank"): every key written, unknown values None."""

    rank: int
    local_rank: int | None = None
    world_size: int | None = None
    host: str | None = None
    pid: int | None = None
    device: str | None = None
    device_uuid: str | None = None
    device_pci_bus_id: str | None = None
    state: str
    phase: str | None = None
    step: int | None = None
    loss: float | None = None
    step_time_s: float | None = None
    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    gpu_mem_used_bytes: int | None = None
    gpu_mem_total_bytes: int | None = None
    collective: CollectiveWait | None = None
    last_seen_s: float | None = None
    stack: str | None = None
    error: RankError | None = None
    # additions beyond the contract's minimum
    local_world_size: int | None = None
    node_rank: int | None = None
    launcher: str | None = None
    device_name: str | None = None
    device_index: int | None = None
    avg_step_time_s: float | None = None
    data_wait_s: float | None = None
    collective_time_s: float | None = None
    input_wait_s: float | None = None
    compute_s: float | None = None
    grad_wait_s: float | None = None
    mem_peak_bytes: int | None = None
    gpu_pids: list[int] | None = None
    host_rss_bytes: int | None = None
    workers_rss_bytes: int | None = None
    host_mem_growth_bytes_per_s: float | None = None
    host_available_bytes: int | None = None
    host_total_bytes: int | None = None
    cgroup_limit_bytes: int | None = None
    cgroup_used_bytes: int | None = None
    exit_code: int | None = None
    exit_signal: str | None = None
    final_collective: FinalCollective | None = None
    collectives: CollectiveCounts | None = None
    nan_step: int | None = None
    nan_exact: bool | None = None
    grad_nan_step: int | None = None
    pg_timeout_s: float | None = None
    simulated: bool = False
    phase_since_s: float | None = None
    log_tail: list[str] | None = None
    checkpoints: list[str] | None = None
    attempt: int | None = None
    ended_at: float | None = None
    median_step_s: float | None = None
    job_id: str | None = None


class AlertEntry(msgspec.Struct, omit_defaults=True, gc=False):
    """One alert (docs/status.md, "An alert"); ``waited_s``, ``phase`` and ``lost_share``
    only where told, ``episode`` and ``raised`` on an alert the server has on show."""

    kind: str
    severity: str
    ranks: list[int]
    waiting: list[int]
    message: str
    hint: str
    waited_s: float | None = None
    phase: str | None = None
    episode: int | None = None
    lost_share: float | None = None
    raised: str | None = None


class PreviousAlert(msgspec.Struct, gc=False):
    """An escalation's ``from``: the alert it replaces."""

    kind: str
    severity: str


class HistoryEntry(msgspec.Struct, kw_only=True, gc=False):
    """One change on the alert timeline (docs/status.md, "The timeline"), also the JSON line
    of ``serve --headless``. ``from`` (``previous``), ``duration_s`` and ``closed_by`` only
    on the events they belong to: ``UNSET`` elsewhere."""

    event: str
    time: str = ""
    elapsed_s: float = 0.0
    alert: AlertEntry
    episode: int = 0
    attempt: int = 1
    previous: PreviousAlert | UnsetType = msgspec.field(default=UNSET, name="from")
    duration_s: float | UnsetType = UNSET
    closed_by: str | UnsetType = UNSET


class Stats(msgspec.Struct, gc=False):
    """The server's counters (docs/status.md, ``stats.*``); ``refused`` where the server
    that built the document takes connections."""

    received: int = 0
    rejected: int = 0
    shed: int = 0
    failed: int = 0
    lag_s: float = 0.0
    pace: int = 1
    refused: int | UnsetType = UNSET


class RelayEntry(msgspec.Struct, gc=False):
    """One per-node relay heard from (docs/status.md, ``relays``)."""

    relay: str
    host: str | None = None
    last_seen_s: float = 0.0
    ranks: list[int] = []
    batches: int = 0
    frames: int = 0
    dropped: int = 0
    coalesced: int = 0
    lost_batches: int = 0
    every: int = 1


class PastAttemptEntry(msgspec.Struct, gc=False):
    """An attempt the launcher restarted the job after, with its ranks as they ended."""

    attempt: int
    started: float
    ended: float
    ranks: list[RankEntry] = []


class JobEnd(msgspec.Struct, kw_only=True, gc=False):
    """``job_end``: how the job ended, as the ``ddpwatch run`` that launched it saw it (what
    no rank can say: who stopped it, why it never started). Only such a run writes it."""

    at: float
    exit_code: int | None = None
    exit_signal: str | None = None
    stopped_by: str | None = None
    stopped_at: float | None = None
    not_started: str | None = None


class ReplayInfo(msgspec.Struct, gc=False):
    """``replay``: where a replay of a recording stands (``ddpwatch replay``'s documents)."""

    file: str
    speed: float | None
    position_s: float
    finished: bool


class TimeLost(msgspec.Struct, gc=False):
    """One culprit's account of the time the others lost to it (several ranks for a
    ``slow_rank`` about several): the spells it held them up and for how long, in which
    phases, whether it stopped; how long it was only slower and what that cost them;
    ``seconds`` in all."""

    ranks: list[int]
    waiting: list[int]
    times: int
    held_s: float
    phases: list[str]
    stopped: bool
    slow_s: float
    slowed_s: float | None
    rank: int
    seconds: float
    text: str = ""


class EpisodeEntry(msgspec.Struct, gc=False):
    """One alert from its raise to its clearing (or the end of what was judged), in seconds
    of the job's elapsed time, as it last stood: its most severe ``severity`` and what it was
    raised as (``first_severity``, ``first_kind``) when it escalated, every rank it said
    waited, its last fix; ``closed_by`` ``new_attempt`` where its attempt ended first; and
    ``duration_s``, how long it was up as of the verdict."""

    kind: str
    severity: str
    ranks: list[int]
    waiting: list[int]
    message: str
    raised_s: float
    attempt: int
    first_severity: str | None
    first_kind: str | None
    escalated_s: float | None
    cleared_s: float | None
    closed_by: str | None
    waited_s: float | None
    waited_at_s: float | None
    phase: str | None
    hint: str
    lost_share: float | None
    duration_s: float = 0.0


class AttemptVerdict(msgspec.Struct, gc=False):
    """One attempt's verdict, and the ranks it blames."""

    attempt: int
    verdict: str
    named: list[int]


class Verdict(msgspec.Struct, kw_only=True, gc=False):
    """``verdict``: the run judged as of this document (``diagnosis/verdict.py``), what the
    end-of-run summary, ``ddpwatch status`` and the report say: the sentence, the ranks the
    last attempt's verdict blames, each attempt's, how long the job ran, its median step,
    the time lost per culprit, most first, each in words too (``text``), and the alert
    episodes it rests on. ``final``: judged as the watch ended (a rank still running "was
    still running when the watch ended"), else as of a document the watch goes on after.
    Every output reads these: none judges the run again."""

    text: str
    named: list[int]
    attempts: list[AttemptVerdict]
    run_s: float | None
    median_step_s: float | None
    time_lost: list[TimeLost]
    final: bool = False
    episodes: list[EpisodeEntry] = []


class StatusDocument(msgspec.Struct, kw_only=True, gc=False):
    """The whole document (``status``): every rank, sorted, ranks that never reported
    included. ``verdict`` is null in a page or summary reply (they hold not every rank);
    ``job_end`` only once a job ``ddpwatch run`` launched has ended, ``replay`` only from a
    replay."""

    schema: int = SCHEMA
    server_time: float
    world_size: int | None = None
    ranks: list[RankEntry] = []
    alerts: list[AlertEntry] = []
    stats: Stats = msgspec.field(default_factory=Stats)
    history: list[HistoryEntry] = []
    job_started: float | None = None
    relays: list[RelayEntry] = []
    attempt: int = 1
    attempts: list[PastAttemptEntry] = []
    verdict: Verdict | None = None
    job_end: JobEnd | UnsetType = UNSET
    replay: ReplayInfo | UnsetType = UNSET


class PageInfo(msgspec.Struct, gc=False):
    """A page's ``page``: where its ranks lie among the matching ones."""

    view: str
    total: int
    matched: int
    offset: int
    limit: int


class SummaryPageInfo(msgspec.Struct, gc=False):
    """A summary's ``page``."""

    view: str
    total: int
    matched: int
    worst: int


class HostRow(msgspec.Struct, gc=False):
    """One host of a summary (``summary.hosts``); each measure None when no rank told."""

    host: str | None
    ranks: int
    states: dict[str, int]
    flagged: int
    step_min: int | None = None
    step_max: int | None = None
    step_time_max_s: float | None = None
    mem_allocated_sum_bytes: int | None = None
    gpu_mem_used_max_bytes: int | None = None


class Summary(msgspec.Struct, gc=False):
    """A summary's ``summary``: counts by state and by host of the matching ranks."""

    ranks: int
    states: dict[str, int]
    hosts: list[HostRow]
    hosts_omitted: int = 0


class PageReply(StatusDocument, kw_only=True):
    """``status?view=page&...``: the document's keys, ``ranks`` the page's, and ``page``."""

    page: PageInfo


class SummaryReply(StatusDocument, kw_only=True):
    """``status?view=summary&...``: the document's keys, ``ranks`` the worst of the matching
    ones, ``summary`` and ``page``. ``scope`` is the dashboard's own, never on the wire: the
    counts of the ranks its filter names, while ``summary`` counts the whole job."""

    summary: Summary
    page: SummaryPageInfo
    scope: Summary | UnsetType = UNSET


class Refused(msgspec.Struct, gc=False):
    """The reply to a request the server cannot answer (a bad query, an unknown view): its
    reason in one line."""

    error: str
