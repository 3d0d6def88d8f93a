"""The server's state: every rank's record, past attempts and relays, with the counters of
what came in, changed only by ``ServerState.apply``.

Times here are the server's own clock (``time.time()`` when a message arrived),
never the sender's, so ranks on hosts with skewed clocks compare fairly.
"""

from __future__ import annotations

import math
from collections import Counter
from dataclasses import dataclass, field
from math import isfinite

from msgspec.structs import astuple, replace

from ddpwatch.core.protocol import (
    IDENTITY_FIELDS,
    AnyMessage,
    Collective,
    CollectiveCounts,
    Event,
    Identity,
    Sample,
)
from ddpwatch.core.vocabulary import EventKind, Phase
from ddpwatch.state.claims import Claim, NewPid, RankClaims
from ddpwatch.state.devices import DeviceIndex
from ddpwatch.state.flags import RankFlags
from ddpwatch.state.host_memory import note as note_host_memory
from ddpwatch.state.host_memory import settled
from ddpwatch.state.marks import MarkIndex
from ddpwatch.state.records import CPU_STEP_S, LOG_LINES, RankRecord, note_beat
from ddpwatch.state.relays import RELAY_HOLD_S, RelayRecord
from ddpwatch.state.step_times import SHORTEST_S, StepTimes
from ddpwatch.state.waits import WaitIndex
from ddpwatch.status.schema import JobEnd

MAX_WORLD = 1 << 20  # never iterate a bogus world size further than this
WINDOWS_KEPT = 4  # a rank's latest windows of calls (``RankRecord.call_windows``)

_IDENTITY_SLICE = slice(
    Identity.__struct_fields__.index(IDENTITY_FIELDS[0]),
    Identity.__struct_fields__.index(IDENTITY_FIELDS[-1]) + 1,
)
_NO_IDENTITY = astuple(Identity(v=1, rank=0, t=0.0))[_IDENTITY_SLICE]
"""A heartbeat that does not repeat the identity (agents send it when it changes)."""


@dataclass(frozen=True)
class PastAttempt:
    """An attempt the launcher restarted the job after: how each rank's process ended."""

    attempt: int
    started: float
    ended: float
    records: dict[int, RankRecord]


PAST_ATTEMPTS_KEPT = 16


@dataclass
class ServerState:
    """All ranks, plus counters. Mutated only by ``apply``; read by diagnosis and views."""

    started: float
    ranks: dict[int, RankRecord] = field(default_factory=dict)
    received: int = 0
    rejected: int = 0
    shed: int = 0
    """Of ``received``: heartbeats counted from their head while far behind, not decoded
    (``collector.SHED_AFTER_S``)."""
    failed: int = 0
    """Valid frames whose handling raised (a bug in ddpwatch, not in the frame): dropped, each
    counted here and the first of each rank and kind logged (``ingest.frame_failed``), so
    that one frame cannot stop the collector, as a rule that raises cannot stop a tick."""
    failures_logged: set[tuple[int | None, str]] = field(
        default_factory=set, repr=False, compare=False
    )
    """The (rank, kind) of the failed frames logged so far: each logged once."""
    collector_failure: str | None = None
    """What the collector's loop last failed on (``service.describe``), until a poll goes
    through again; once its thread has stopped, what stopped it. ``server_behind`` names it."""
    collector_stopped: float | None = None
    """When the collector's thread stopped while the server was meant to run: no message is
    taken in after it, and ``server_behind`` says so at once, not as a quiet job."""
    first_report: float | None = None
    """When the first rank reported: the job's start, as far as the server can tell."""
    relays: dict[str, RelayRecord] = field(default_factory=dict)
    """Per-node relays heard from, by name (``state/relays.py``)."""
    generation: int = 0
    """Bumped by what is not a measurement: a new rank or process, an identity change, a
    crash, an exit, a checkpoint. Rules run on a slower cadence rerun at once when it moves."""
    heard_until: float | None = None
    """Every message sent before this time has been read (the collector last found its
    queue empty then); None: no collector says, take ``now``. Diagnosis runs as of it, so
    a server that falls behind its ranks sees them as they were, never as silent."""
    pace: int = 1
    """The pace the server asks of its relays (``server/pace.py``): one batch every this many
    beats; above 1 only while it is, or lately was, behind its queue. The status document's
    ``stats.pace``; no alert's words depend on it, since a recording keeps each batch's pace
    (``route`` records), not the one asked."""
    listening_since: float = -math.inf
    """Since when the collector has kept up without a break (a backlog that may have made
    senders drop heartbeats, or the server itself paused): silence counts from here."""
    stepping_since: float | None = None
    """When a rank of this attempt first reported a step: from then on no rank gets the
    start-up grace for silence (``diagnosis.facts.ranks.silent_after``)."""
    attempt: int = 1
    """The launcher's attempt the job is in: 2 once it restarted the workers (torchrun's
    ``--max-restarts``, an elastic membership change), and so on."""
    attempt_started: float | None = None
    """When the current attempt's first process reported (None: the job's first attempt)."""
    past_attempts: list[PastAttempt] = field(default_factory=list)
    """The attempts before this one, oldest first, each with its ranks' last records."""
    job_end: JobEnd | None = None
    """How the job ended, as the ``ddpwatch run`` that launched it saw it (``Server.end_job``;
    a replay, from the recording): who stopped it, why it never started."""
    waits: WaitIndex = field(default_factory=WaitIndex, repr=False, compare=False)
    devices: DeviceIndex = field(default_factory=DeviceIndex, repr=False, compare=False)
    """Each rank's GPU and the ranks the device rules may name, kept by ``apply``
    (``state/devices.py``); like ``waits``, records changed by hand are not in it."""
    flags: RankFlags = field(default_factory=RankFlags, repr=False, compare=False)
    """The ranks with no step yet and those whose loss or gradients went bad, kept by
    ``apply`` (``state/flags.py``); like ``waits``, records changed by hand are not in it."""
    marks: MarkIndex = field(default_factory=MarkIndex, repr=False, compare=False)
    """How many ranks hold each value at each marked step, kept by ``apply``
    (``state/marks.py``); like ``waits``, records changed by hand are not in it."""
    claims: RankClaims = field(default_factory=RankClaims, repr=False, compare=False)
    """Ranks reported by two live processes at once (``state/claims.py``)."""
    _replaced: dict[int, RankRecord] = field(default_factory=dict, repr=False, compare=False)
    """Records a rank's new process replaced in this attempt: the attempt's if it ends."""
    """Which collective each unfinished rank is in, kept by ``apply`` (``state/waits.py``):
    a ticking diagnosis reads it. Records changed by hand are not in it: ``WaitIndex.of``."""

    _derived: tuple[tuple[int, int], int | None, list[int]] | None = field(
        default=None, init=False, repr=False, compare=False
    )  # ``_by_generation``'s cache

    def as_of(self, now: float) -> float:
        """The latest time the state is complete for: ``now``, or ``heard_until`` if earlier."""
        heard = self.heard_until
        return now if heard is None or heard >= now else heard

    @property
    def job_started(self) -> float:
        """Where a job's elapsed time counts from: its first report, else the server start."""
        return self.started if self.first_report is None else self.first_report

    @property
    def world_size(self) -> int | None:
        """The world size most ranks reported, the largest on a tie (ranks may start before
        they know it; a rank whose WORLD_SIZE differs is ``config_mismatch``'s, and the ranks
        it alone counts are not missing)."""
        return self._by_generation()[0]

    def missing_ranks(self) -> list[int]:
        """Ranks below ``world_size`` (at most ``MAX_WORLD``) that never sent anything."""
        return list(self._by_generation()[1])

    def _by_generation(self) -> tuple[int | None, list[int]]:
        """World size and missing ranks change only with ``generation`` (a new rank, an
        identity): worked out once per generation, not per tick at 65,536 ranks."""
        key = (self.generation, len(self.ranks))
        cached = self._derived
        if cached is not None and cached[0] == key:
            return cached[1], cached[2]
        sizes = Counter(r.world_size for r in self.ranks.values() if r.world_size)
        size = max(sizes, key=lambda s: (sizes[s], s)) if sizes else None
        missing = [r for r in range(min(size, MAX_WORLD)) if r not in self.ranks] if size else []
        self._derived = (key, size, missing)
        return size, missing

    def apply(self, message: AnyMessage, now: float) -> None:
        """Fold one validated message into the per-rank records."""
        self.received += 1
        rank = message.rank
        record = self.ranks.get(rank)
        placed = record is not None  # ``waits`` has it where its last message put it
        pid = getattr(message, "pid", None)  # events have none
        if record is None or (pid is not None and record.pid is not None and pid != record.pid):
            fresh = self._record_of_new_process(rank, record, pid, message, now)
            if fresh is None:
                return  # a late frame: of a past attempt, or of a process already replaced
            placed = placed and fresh is record
            record = fresh
        record.last_seen = now
        if isinstance(message, Identity):
            key = astuple(message)[_IDENTITY_SLICE]
            # most heartbeats leave the identity out: one compare of Nones tells them
            if key != _NO_IDENTITY and key != record.identity_key:
                self._take_identity(record, message, key, now)
            if isinstance(message, Sample):
                idle = placed and record.collective is None
                self._take_sample(record, message, now)
                if idle and record.collective is None:
                    return  # in no collective still: ``waits`` has it there (most heartbeats)
        elif isinstance(message, Event):
            _apply_event(record, message, now)
            self.flags.note(record)
            if message.event in _GENERATION_EVENTS:
                self.generation += 1
        self.waits.place(record)

    def _take_sample(self, record: RankRecord, sample: Sample, now: float) -> None:
        """A heartbeat's measurements, and the indexes they move (marks, flags, GPU lists)."""
        pids = record.gpu_pids
        _apply_sample(record, sample, now, self.marks)
        self.flags.note(record)
        if record.gpu_pids is not pids:  # a new list (an equal one is not stored)
            self.devices.place_pids(record)
        if self.stepping_since is None and record.step is not None:
            self.stepping_since = now

    def _take_identity(
        self, record: RankRecord, message: Identity, key: tuple[object, ...], now: float
    ) -> None:
        _apply_identity(record, message)
        record.identity_key = key
        self.devices.place(record)
        self.generation += 1
        if message.restart_count is not None:  # the launcher's own count
            record.attempt = max(record.attempt, message.restart_count + 1)
        if record.attempt > self.attempt:
            self._begin_attempt(record.attempt, now)

    def _record_of_new_process(
        self, rank: int, record: RankRecord | None, pid: int | None, message: AnyMessage, now: float
    ) -> RankRecord | None:
        """A new rank, or a restarted worker (its rank with a new pid): a fresh record; but
        two live processes reporting one rank keep theirs, and a late frame of a process
        already replaced gets none (``state/claims.py``), nor one of a past attempt."""
        if record is None and pid is None and self._late_for_past_attempt(message, now):
            return None
        if (
            record is not None
            and pid is not None
            and record.pid is not None
            and (not record.finished or rank in self.claims.duplicates)  # their events mix
        ):
            old = Claim(record.pid, record.host, record.last_seen)
            verdict = self.claims.changed(rank, old, pid, getattr(message, "host", None), now)
            if verdict is NewPid.LATE:
                return None
            if verdict is NewPid.DUPLICATE:
                self.generation += 1
                return record
        return self._new_record(rank, now, record)

    def _new_record(self, rank: int, now: float, previous: RankRecord | None) -> RankRecord:
        """A fresh record for a new rank or a rank's new process: a process that follows one
        that ended belongs to the launcher's next attempt (until its own report says)."""
        record = RankRecord(rank=rank, first_seen=now, last_seen=now, last_progress=now)
        if previous is None:
            record.attempt = self.attempt
        else:
            record.attempt = previous.attempt + 1 if previous.finished else previous.attempt
            self._replaced[rank] = previous  # its attempt's last word on the rank, so far
        if record.attempt > self.attempt:
            self._begin_attempt(record.attempt, now)
        replaced = self.ranks.get(rank)  # ``previous``, unless its attempt just ended
        if replaced is not None:
            self.marks.drop(replaced)
        self.ranks[rank] = record
        self.devices.place(record)  # no identity yet: the last process's GPU is forgotten
        self.flags.note(record)
        self.generation += 1
        if self.first_report is None:
            self.first_report = now
        return record

    def _begin_attempt(self, attempt: int, now: float) -> None:
        """The launcher restarted the job: the ranks' records of the attempts before move to
        ``past_attempts``; their ranks count again as their new processes report."""
        old = {r: record for r, record in self._replaced.items() if record.attempt < attempt}
        self._replaced = {}
        for rank, record in list(self.ranks.items()):
            if record.attempt < attempt:
                old[rank] = record
                del self.ranks[rank]
                self.waits.drop(rank)
                self.devices.drop(rank)
                self.flags.drop(rank)
                self.marks.drop(record)
        started = self.attempt_started if self.attempt_started is not None else self.job_started
        self.past_attempts.append(PastAttempt(self.attempt, started, now, old))
        del self.past_attempts[:-PAST_ATTEMPTS_KEPT]
        self.attempt, self.attempt_started = attempt, now
        self.stepping_since = None
        self.generation += 1

    def _late_for_past_attempt(self, message: AnyMessage, now: float) -> bool:
        """An event (it carries no pid) for a rank whose record moved to the last attempt:
        the old process's last words (its exit), applied there, not to a new record."""
        past = self.past_attempts[-1].records if self.past_attempts else {}
        record = past.get(message.rank)
        if record is None or not isinstance(message, Event):
            return False
        _apply_event(record, message, now)
        return True


_GENERATION_EVENTS = frozenset({EventKind.CRASH, EventKind.EXIT, EventKind.CHECKPOINT})


def _apply_identity(record: RankRecord, message: Identity) -> None:
    for name in IDENTITY_FIELDS:
        value = getattr(message, name)
        if value is not None:
            setattr(record, name, value)


def _beat(sample: Sample, gap_s: float, pace: int) -> tuple[float, ...]:
    """A heartbeat's ``records.Beat`` columns: NaN for what its agent did not time. Through a
    relay at ``pace`` (0: direct), it stands for that many heartbeats, and its gap leaves
    out the beats the relay skipped: else, 2 s apart at pace 4, every beat would end an
    episode (``Lag``: a gap longer than a collective may wait, 2 s at least)."""
    nan = math.nan
    grad = sample.grad_wait_s
    inputs, compute, data = sample.input_wait_s, sample.compute_s, sample.data_wait_s
    if pace > 1:
        gap_s = max(0.0, gap_s - RELAY_HOLD_S * (pace - 1))
    return (
        gap_s,
        nan if sample.step_time_s is None else sample.step_time_s,
        (sample.collective_time_s or 0.0) + (grad or 0.0),
        nan if grad is None else grad,
        nan if inputs is None else inputs,
        nan if compute is None else compute,
        nan if data is None else data,
        float(pace) if pace > 1 else 1.0,
    )


def _set_phase(record: RankRecord, phase: str | None, now: float) -> None:
    """Enter ``phase``. 'starting' (the early hello's) is only ever a process's first phase:
    a beat of the early sender that arrives after the agent's first word (two sockets, no
    order between them) must not put the rank back, nor restart its phase's clock."""
    if phase == Phase.STARTING and record.phase not in (None, Phase.STARTING):
        return
    if phase and phase != record.phase:
        if record.phase == Phase.COMPILING:
            # a compile that ends is progress: else the rank it kept from stepping for
            # minutes is "stalled" until its step ends (seen: inductor, a cold cache on 2
            # cores, stalled for 0.25 s as both ranks left 16 s of compiling)
            record.last_progress = now
        record.phase = phase
        record.phase_since = now
        record.phases.append((phase, now))
        del record.phases[:-32]


def _note_cpu(record: RankRecord, cpu_s: float, now: float) -> None:
    """Keep the rank's CPU time, when it last grew by ``CPU_STEP_S``, and how fast it grew
    since the mark before: the agent's own threads cost far less, so a rate is the rank's own
    work. A process's first CPU time (or a new process's, lower) starts afresh."""
    record.cpu_s = cpu_s
    mark, at = record.cpu_mark_s, record.cpu_grew_at
    if mark is None or at is None or cpu_s < mark:
        record.cpu_mark_s, record.cpu_grew_at, record.cpu_rate = cpu_s, now, None
    elif cpu_s - mark >= CPU_STEP_S and now > at:
        record.cpu_rate = (cpu_s - mark) / (now - at)
        record.cpu_mark_s, record.cpu_grew_at = cpu_s, now


def _apply_sample(record: RankRecord, sample: Sample, now: float, marks: MarkIndex) -> None:  # noqa: C901, PLR0912, PLR0915 -- hot path: every heartbeat of every rank, kept flat
    """Store a heartbeat's measurements (each replaces the last, ``None`` included) and what
    follows from them: progress, phase, the collective timer, step marks and NaN bookkeeping.

    A list equal to the one the record holds (``gpu_pids``, a collective's ``shape``, the
    step ``marks``: the same beat after beat) is not stored: the record keeps its own equal
    list (in a copy of the new struct: the message is left as it came), and the new one dies
    young instead of giving the cyclic garbage collector one more object per rank to scan."""
    step = sample.step
    collective = sample.collective
    counts = sample.collectives
    before = record.collectives
    moved = step is not None and step != record.step
    stepped_at = record.last_step_at
    if moved:
        record.last_progress = now
        record.last_step_at = now
        _time_steps(record, step or 0, sample)
        if record.first_step_at is None:
            record.first_step, record.first_step_at = step, now
        if record.error is None and record.exit_time is None:  # not ``finished``
            record.stack = None  # it moved on: the captured stack is stale
    elif (
        (sample.forwards is not None and sample.forwards != record.forwards)
        or _left_collective(record.collective, collective)
        or _entered_more(before, counts)
    ):
        # a forward pass is progress too (evaluation has no steps), and so are collectives:
        # a rank that came out of one, or entered new ones, has not stalled
        record.last_progress = now
    if record.collective is not None and _left_collective(record.collective, collective):
        record.wait_ended_at = now
        record.wait_ended_s = record.collective_age(now) or 0.0
    phase = sample.phase
    if phase and phase != record.phase:
        _set_phase(record, phase, now)
    cpu_s = sample.cpu_s
    if cpu_s is not None:
        _note_cpu(record, cpu_s, now)
    # every measurement as it came (``tests/server/test_records.py`` checks that each
    # lands): plain stores on a slotted record
    loss = sample.loss
    collective_time_s = sample.collective_time_s
    record.step = step
    record.loss = loss
    record.step_time_s = sample.step_time_s
    record.avg_step_time_s = sample.avg_step_time_s
    record.data_wait_s = sample.data_wait_s
    record.collective_time_s = collective_time_s
    record.input_wait_s = sample.input_wait_s
    record.compute_s = sample.compute_s
    record.grad_wait_s = sample.grad_wait_s
    record.forwards = sample.forwards
    record.compile_reason = sample.compile_reason
    record.mem_allocated_bytes = sample.mem_allocated_bytes
    record.mem_reserved_bytes = sample.mem_reserved_bytes
    record.mem_peak_bytes = sample.mem_peak_bytes
    record.gpu_mem_used_bytes = sample.gpu_mem_used_bytes
    record.gpu_mem_total_bytes = sample.gpu_mem_total_bytes
    pids = sample.gpu_pids
    if pids != record.gpu_pids:  # equal: keep the record's list (see above)
        record.gpu_pids = pids
    batch_marks = sample.batch_marks
    if batch_marks != record.batch_marks:  # equal: ``drawn_marks`` already holds them
        record.batch_marks = batch_marks
        if batch_marks:
            marks.keep(record, "drawn_marks", batch_marks)
    backward_marks = sample.backward_marks
    if backward_marks != record.backward_marks:  # equal: ``backwards_marked`` holds them
        record.backward_marks = backward_marks
        if backward_marks:
            marks.keep(record, "backwards_marked", backward_marks)
    eval_marks = sample.eval_sync_marks
    if eval_marks != record.eval_sync_marks:  # equal: ``evals_marked`` holds them
        record.eval_sync_marks = eval_marks
        if eval_marks:
            marks.keep(record, "evals_marked", eval_marks)
    rss = sample.host_rss_bytes
    workers = sample.workers_rss_bytes
    record.host_rss_bytes = rss
    record.workers_rss_bytes = workers
    record.host_available_bytes = sample.host_available_bytes
    record.host_total_bytes = sample.host_total_bytes
    record.cgroup_limit_bytes = sample.cgroup_limit_bytes
    record.cgroup_used_bytes = sample.cgroup_used_bytes
    if rss is not None:  # a window only once its start is behind it: warm-up is no leak
        record.host_mem_points = (
            note_host_memory(record.host_mem_points, now, rss + (workers or 0), step)
            if settled(record, now)
            else None
        )
    if collective is not None:
        shape = collective.shape
        held = record.collective
        if shape is not None and held is not None and held.shape == shape:
            collective = replace(collective, shape=held.shape)
        record.collective = collective
        record.collective_seen = now
    else:
        record.collective = None
        record.collective_seen = None
    record.sample_seen = now
    if moved and collective_time_s is not None:
        record.beats = note_beat(
            record.beats, _beat(sample, now - stepped_at, record.relayed)
        )
    if counts is not None:
        step_marks = counts.marks
        if step_marks:
            if before is not None and before.marks == step_marks:
                # ``step_marks`` already holds these (updating again and trimming to the same
                # bound would change nothing): keep the record's list of them
                counts = replace(counts, marks=before.marks)
            else:
                marks.keep(record, "step_marks", step_marks)
        if counts.digests is not None or counts.window is not None or counts.earlier:
            counts = _keep_calls(record, before, counts, marks)
    record.collectives = counts
    record.grad_nan_step = sample.grad_nan_step
    nan_step = sample.nan_step
    if nan_step is not None:
        record.nan_step, record.nan_exact = nan_step, True
    elif loss is not None:
        if isfinite(loss):
            record.nan_step, record.nan_exact = None, False
        elif record.nan_step is None:
            # an agent that does not report nan_step: the heartbeat's step is only a bound
            record.nan_step = step if step is not None else (record.step or 0)


def _time_steps(record: RankRecord, step: int, sample: Sample) -> None:
    """A heartbeat that moved the step: its steps into the rank's median (``step_times``),
    each at the heartbeat's seconds per step by the sender's clock since the last heartbeat
    that moved it (one step: its own time). Nothing for the first step, nor for a counter
    that went back. Inline, not through calls: every heartbeat of every rank passes here."""
    last, sent = record.timed_step, sample.t
    if last is not None and step > last:
        steps = step - last
        own = sample.step_time_s
        if steps == 1 and own is not None:
            per_step = own
        else:
            span = sent - record.timed_sent
            per_step = span / steps if span > 0 else 0.0  # 0: not timed (skipped)
        times = record.step_times
        if times is not None:
            times.add(per_step, steps)
        elif per_step >= SHORTEST_S:  # its first step timed: a median from here on
            times = record.step_times = StepTimes()
            times.add(per_step, steps)
    record.timed_step, record.timed_sent = step, sent


def _left_collective(before: Collective | None, now: Collective | None) -> bool:
    """The rank was in a collective at its last sample and is out of it, or in another."""
    if before is None:
        return False
    return now is None or (now.op, now.seq, now.source) != (before.op, before.seq, before.source)


def _entered_more(before: CollectiveCounts | None, now: CollectiveCounts | None) -> bool:
    if before is None or now is None:
        return False
    return now.py != before.py or (now.fr != before.fr and now.fr is not None)


_LAST_WORDS = frozenset({EventKind.CRASH, EventKind.EXIT})


def _apply_event(record: RankRecord, event: Event, now: float) -> None:
    kind = event.event
    if (
        kind in _LAST_WORDS
        and event.step is not None
        and (record.step is None or event.step > record.step)
    ):
        # an exit or crash carries the last step the rank reached. Any other event's step is
        # context: taken as the record's, it paired a newer step with the last heartbeat's
        # loss ("step 5, loss 0.0" of step 1) and hid the next heartbeat's progress
        record.step = event.step
    if event.phase:
        _set_phase(record, event.phase, now)
    if kind == EventKind.STACK:
        _take_stack(record, event.stack, now)
    elif kind == EventKind.CRASH and event.error is not None:
        if record.error is None:
            record.error = event.error
            record.error_time = now
            _stop_timing(record, event.collective)
        if event.stack:
            record.stack = event.stack
    elif kind == EventKind.EXIT:
        _take_exit(record, event, now)
    elif kind == EventKind.LOG and event.text:
        record.log_tail.extend(event.text.splitlines()[-LOG_LINES:])
    elif kind == EventKind.CHECKPOINT and event.path:
        record.checkpoint_paths.append(event.path)
        del record.checkpoint_paths[:-16]


def _take_exit(record: RankRecord, event: Event, now: float) -> None:
    record.exit_time = now
    record.exit_code = event.exit_code
    record.exit_signal = event.signal
    _stop_timing(record, event.collective)
    if event.stack:  # where a fatal signal found it (its black box: ``core/boxreader.py``)
        record.stack = event.stack


def _take_stack(record: RankRecord, stack: str | None, now: float) -> None:
    """The rank's stack while it idles; one that differs from the last at the same step (the
    record drops its stack when the step moves) says the rank is working."""
    if record.stack is not None and stack != record.stack:
        record.stack_moved_at = now
    record.stack = stack


def _keep_calls(
    record: RankRecord, before: CollectiveCounts | None, counts: CollectiveCounts, marks: MarkIndex
) -> CollectiveCounts:
    """Fold a heartbeat's call digests and windows into the record's (as the step marks:
    what repeats the last heartbeat's is not stored again; the earlier windows, once folded,
    are not kept on the counts)."""
    digests, window, earlier = counts.digests, counts.window, counts.earlier
    if digests:
        if before is not None and before.digests == digests:
            counts = replace(counts, digests=before.digests)
        else:
            marks.keep(record, "call_digests", digests)
    windows = record.call_windows
    if earlier:
        for told in earlier:
            windows[told.step] = told.calls
        counts = replace(counts, earlier=None)
    if window is not None:
        if before is not None and before.window == window:
            counts = replace(counts, window=before.window)
        else:
            windows[window.step] = window.calls
    while len(windows) > WINDOWS_KEPT:
        del windows[min(windows)]
    return counts


def _stop_timing(record: RankRecord, collective: Collective | None) -> None:
    """A dead rank waits in nothing: keep what it was in, but no longer as a live timer."""
    if record.final_collective is None:
        record.final_collective = collective or record.collective
    record.collective = None
    record.collective_seen = None
