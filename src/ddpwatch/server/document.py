"""The status JSON document (a contract: see docs/status.md), built from state and alerts into
the schema of ``status/schema.py``."""

from __future__ import annotations

import math

from ddpwatch.core.protocol import Collective
from ddpwatch.core.vocabulary import RankState
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.facts.census import effective_stall_after
from ddpwatch.diagnosis.facts.ranks import rank_state
from ddpwatch.diagnosis.verdict import judged
from ddpwatch.state.host_memory import growth
from ddpwatch.state.records import RankRecord
from ddpwatch.state.relays import relay_entry
from ddpwatch.state.state import PastAttempt, ServerState
from ddpwatch.status.schema import (
    SCHEMA,
    UNSET,
    CollectiveCounts,
    CollectiveWait,
    FinalCollective,
    HistoryEntry,
    PastAttemptEntry,
    RankEntry,
    RankError,
    Stats,
    StatusDocument,
)

LOG_TAIL_IN_STATUS = 20


def rank_entry(
    record: RankRecord,
    now: float,
    th: Thresholds,
    stall_after: float,
    *,
    as_of: float | None = None,
    since: float = -math.inf,
    stepping: bool = False,
) -> RankEntry:
    """One rank as the status JSON shows it; unknown values are None, never omitted. Its
    ``state`` is judged as of ``as_of`` (``ServerState.as_of``), silence counted from
    ``since`` (``ServerState.listening_since``), with no start-up grace once a rank is
    ``stepping`` (``ServerState.stepping_since``), like diagnosis does."""
    age = record.collective_age(now)
    c = record.collective
    collective = CollectiveWait(c.op, c.seq, round(age or 0.0, 3), c.peer) if c else None
    error = (
        RankError(record.error.type, record.error.message, record.error.traceback)
        if record.error is not None
        else None
    )
    loss = record.loss if record.loss is None or math.isfinite(record.loss) else None
    counts = record.collectives
    return RankEntry(
        rank=record.rank,
        local_rank=record.local_rank,
        world_size=record.world_size,
        host=record.host,
        pid=record.pid,
        device=record.device,
        device_uuid=record.device_uuid,
        device_pci_bus_id=record.device_pci_bus_id,
        state=rank_state(record, now if as_of is None else as_of, th, stall_after, since, stepping),
        phase=record.phase,
        step=record.step,
        loss=loss,
        step_time_s=record.step_time_s,
        mem_allocated_bytes=record.mem_allocated_bytes,
        mem_reserved_bytes=record.mem_reserved_bytes,
        gpu_mem_used_bytes=record.gpu_mem_used_bytes,
        gpu_mem_total_bytes=record.gpu_mem_total_bytes,
        collective=collective,
        last_seen_s=round(max(0.0, now - record.last_seen), 3),
        stack=record.stack,
        error=error,
        # additions beyond the contract's minimum
        local_world_size=record.local_world_size,
        node_rank=record.node_rank,
        launcher=record.launcher,
        device_name=record.device_name,
        device_index=record.device_index,
        avg_step_time_s=record.avg_step_time_s,
        data_wait_s=record.data_wait_s,
        collective_time_s=record.collective_time_s,
        input_wait_s=record.input_wait_s,
        compute_s=record.compute_s,
        grad_wait_s=record.grad_wait_s,
        mem_peak_bytes=record.mem_peak_bytes,
        gpu_pids=record.gpu_pids,
        host_rss_bytes=record.host_rss_bytes,
        workers_rss_bytes=record.workers_rss_bytes,
        host_mem_growth_bytes_per_s=_host_growth(record),
        host_available_bytes=record.host_available_bytes,
        host_total_bytes=record.host_total_bytes,
        cgroup_limit_bytes=record.cgroup_limit_bytes,
        cgroup_used_bytes=record.cgroup_used_bytes,
        exit_code=record.exit_code,
        exit_signal=record.exit_signal,
        final_collective=_collective(record.final_collective),
        collectives=None if counts is None else CollectiveCounts(counts.py, counts.fr),
        nan_step=record.nan_step,
        nan_exact=record.nan_exact,
        grad_nan_step=record.grad_nan_step,
        pg_timeout_s=record.pg_timeout_s,
        simulated=record.simulated,
        phase_since_s=None if record.phase_since is None else round(now - record.phase_since, 3),
        log_tail=list(record.log_tail)[-LOG_TAIL_IN_STATUS:],
        checkpoints=list(record.checkpoint_paths),
        attempt=record.attempt,
        ended_at=_ended_at(record),
        median_step_s=_median_step(record),
        job_id=record.job_id,
    )


def _ended_at(record: RankRecord) -> float | None:
    """When the rank's process ended (its crash, else its exit), server time; None while
    it runs. The end-of-run verdict orders failures by it."""
    times = [t for t in (record.error_time, record.exit_time) if t is not None]
    return min(times) if times else None


def _median_step(record: RankRecord) -> float | None:
    """Its median step over every step it timed, one step one vote (``step_times``)."""
    found = record.median_step_s()
    return None if found is None else round(found, 6)


def _host_growth(record: RankRecord) -> float | None:
    """How fast the rank's host memory (its own and its workers') grows, bytes a second."""
    found = growth(record.host_mem_points)
    return None if found is None else round(found.rate, 1)


def _collective(c: Collective | None) -> FinalCollective | None:
    return None if c is None else FinalCollective(c.op, c.seq, c.shape, c.dtype)


def missing_entry(rank: int, world_size: int) -> RankEntry:
    """A rank below the known world size that has never reported: every other field null."""
    return RankEntry(rank=rank, world_size=world_size, state=RankState.NOT_CONNECTED)


def status_document(
    state: ServerState,
    alerts: list[Alert],
    now: float,
    th: Thresholds,
    history: list[HistoryEntry] | None = None,
    *,
    final: bool = False,
) -> StatusDocument:
    """The whole ``ddpwatch status --json`` document; ``history``: the alert timeline's
    entries (``AlertTracker.entries``), oldest first; ``final``: its verdict judged as the
    watch ends (the summary's, the report's, the trackers')."""
    stall_after = effective_stall_after(state, th)
    world_size = state.world_size
    as_of, since = state.as_of(now), state.listening_since
    stepping = state.stepping_since is not None
    ranks = [
        rank_entry(
            state.ranks[r], now, th, stall_after, as_of=as_of, since=since, stepping=stepping
        )
        for r in sorted(state.ranks)
    ]
    missing = state.missing_ranks()  # below the world size, MAX_WORLD at most
    if world_size and missing:
        ranks = sorted(
            ranks + [missing_entry(r, world_size) for r in missing], key=lambda e: e.rank
        )
    attempts = [_past_attempt(past, now, state) for past in state.past_attempts]
    document = document_around(ranks, state, alerts, now, history, attempts)
    document.verdict = judged(document, final=final)  # as of ``now``
    return document


def document_around(
    ranks: list[RankEntry],
    state: ServerState,
    alerts: list[Alert],
    now: float,
    history: list[HistoryEntry] | None = None,
    attempts: list[PastAttemptEntry] | None = None,
) -> StatusDocument:
    """The document with these rank entries: ``status_document`` gives every rank (and the
    past attempts' ranks), the paged queries (``server/pages.py``) some, in the same
    envelope."""
    return StatusDocument(
        schema=SCHEMA,
        server_time=now,
        world_size=state.world_size,
        ranks=ranks,
        alerts=[alert.entry() for alert in alerts],
        stats=Stats(
            received=state.received,
            rejected=state.rejected,
            shed=state.shed,
            failed=state.failed,
            lag_s=round(now - state.as_of(now), 3),
            pace=state.pace,
        ),
        history=history or [],
        job_started=state.job_started,
        relays=[relay_entry(relay, now) for relay in state.relays.values()],
        attempt=state.attempt,
        attempts=attempts or [],
        job_end=UNSET if state.job_end is None else state.job_end,
    )


def _past_attempt(past: PastAttempt, now: float, state: ServerState) -> PastAttemptEntry:
    """An attempt the launcher restarted the job after, as its ranks ended."""
    th = Thresholds()  # every rank of it ended: no threshold changes how it reads
    return PastAttemptEntry(
        attempt=past.attempt,
        started=past.started,
        ended=past.ended,
        ranks=[
            rank_entry(past.records[r], now, th, th.stall_after, since=state.listening_since)
            for r in sorted(past.records)
        ],
    )
