"""A rank's record: everything the server knows of one rank, as the collector applies its
messages (``state/state.py``) and diagnosis reads it. Its own module so that the state, the
wait index and the relays' records all read it without importing each other.

Times are the server's own clock (``time.time()`` when a message arrived), never the
sender's, so ranks on hosts with skewed clocks compare fairly.
"""

from __future__ import annotations

from array import array
from collections import deque
from dataclasses import dataclass, field, fields
from enum import IntEnum

from ddpwatch.core.protocol import CallSeen, Collective, CollectiveCounts, ErrorInfo, Sample
from ddpwatch.state.step_times import StepTimes

LOG_LINES = 50
BEATS = 16
"""Heartbeats that ended steps a rank's ``beats`` keeps (8 s at 2 Hz): enough for medians
that one long step does not move, few enough to follow a job as it changes."""


class Beat(IntEnum):
    """The columns of one heartbeat in ``RankRecord.beats``: seconds per step of the steps it
    ended (NaN where the agent did not time it)."""

    GAP = 0
    """Since the rank's step before them ended, by the server's clock, less the beats a
    paced relay skipped: a long one ends an episode (a stall, a stop, the start), after
    which ``slow_rank`` starts afresh."""
    STEP = 1  # the last step's time
    WAITED = 2  # in Python-level collectives (the last step) and in DDP's all-reduce
    GRAD_WAIT = 3  # in DDP's gradient all-reduce alone
    INPUT_WAIT = 4  # in DataLoader iterators
    COMPUTE = 5  # the rest of the step, less the waits
    DATA_WAIT = 6  # from the step's end to the next forward pass (the last step)
    STANDS_FOR = 7
    """The heartbeats this one stands for: its relay's pace when it came (1 direct). A relay
    at pace 4 sends a rank's newest heartbeat of every 4 (``server/pace.py``), so a window
    counted in beats would span four times the seconds, and follow a change four times
    slower."""


BEAT_WIDTH = len(Beat)
MIN_BEATS = 5
"""Beats a window keeps however many heartbeats each stands for: a median of fewer is one
jittery step away from another verdict, on some rank of a large job."""


def note_beat(beats: array[float] | None, values: tuple[float, ...]) -> array[float]:
    """Add one heartbeat's ``values`` (one per ``Beat`` column) to a rank's window, dropping
    the oldest past ``BEATS`` heartbeats (``Beat.STANDS_FOR``; ``MIN_BEATS`` beats at least):
    one ``array`` of floats per rank, nothing the garbage collector scans. A beat that
    stands for one heartbeat, nearly every beat, costs one length check: it trims by count,
    so after a slower pace the window holds ``BEATS`` beats, more heartbeats, until the
    paced ones are gone (more evidence, never less)."""
    if beats is None:
        return array("d", values)
    beats.extend(values)
    if values[Beat.STANDS_FOR] == 1.0:
        if len(beats) > BEATS * BEAT_WIDTH:
            del beats[:BEAT_WIDTH]
        return beats
    if len(beats) <= MIN_BEATS * BEAT_WIDTH:
        return beats  # nothing to trim: no sum of the window's weights
    held = stands_for(beats)
    while len(beats) > MIN_BEATS * BEAT_WIDTH and held - beats[Beat.STANDS_FOR] >= BEATS:
        held -= beats[Beat.STANDS_FOR]
        del beats[:BEAT_WIDTH]
    return beats


def stands_for(beats: array[float]) -> float:
    """The heartbeats a window's beats stand for (``Beat.STANDS_FOR``)."""
    return sum(beats[Beat.STANDS_FOR :: BEAT_WIDTH])


CPU_STEP_S = 0.1
"""CPU seconds a rank must use for its CPU time to count as growing (``cpu_grew_at``): the
agent's own threads use a few milliseconds a second (~6 ms measured on an attached rank that
sleeps: a step every ~17 s), a rank that imports or computes ~1 s (0.3 s on a loaded machine)."""

STORED_FIELDS = tuple(name for name in Sample.__struct_fields__ if name not in ("v", "t"))
"""Every field of a ``Hello`` or a ``Sample`` the server keeps on the rank's record (all but
the protocol version and the sender's clock): ``RankRecord`` declares each one."""


@dataclass(slots=True)
class RankRecord:
    """Everything known about one rank. Unknown values stay ``None``.

    Declares every field of ``Hello`` and ``Sample`` the server keeps (checked below, at
    import); slotted, so a field it does not declare is refused, never silently added.
    """

    rank: int
    first_seen: float
    last_seen: float
    # identity
    local_rank: int | None = None
    world_size: int | None = None
    local_world_size: int | None = None
    node_rank: int | None = None
    host: str | None = None
    pid: int | None = None
    launcher: str | None = None
    job_id: str | None = None
    backend: str | None = None
    torch_version: str | None = None
    cuda_visible_devices: str | None = None
    device: str | None = None
    device_index: int | None = None
    device_name: str | None = None
    device_uuid: str | None = None
    device_pci_bus_id: str | None = None
    device_count: int | None = None
    pg_timeout_s: float | None = None
    restart_count: int | None = None
    rendezvous: str | None = None
    simulated: bool = False
    master_addr: str | None = None
    master_port: str | None = None
    init_method: str | None = None
    run_id: str | None = None
    script: str | None = None
    script_hash: str | None = None
    cuda_version: str | None = None
    nccl_version: str | None = None
    box: str | None = None  # its black box's file name, read on its host (``core/boxreader.py``)
    attempt: int = 1
    """The launcher's attempt this process belongs to: ``restart_count + 1`` where the
    launcher says, else one more than the rank's last process if that one had ended."""
    relayed: int = 0
    """How its last frame came: 0 directly, else through a per-node relay that sends a batch
    every this many beats (``Batch.every``) and holds frames that long."""
    identity_key: tuple[object, ...] | None = None
    """The identity fields last applied: heartbeats repeat them, unchanged, every time."""
    # measurements
    phase: str | None = None
    phase_since: float | None = None
    cpu_s: float | None = None
    cpu_grew_at: float | None = None
    """When its CPU time last grew by ``CPU_STEP_S`` (server time): a rank working, not hung."""
    cpu_mark_s: float | None = None  # its CPU time at ``cpu_grew_at``
    cpu_rate: float | None = None
    """CPU seconds a second between its last two marks (None until it has two): a rank that
    works uses 0.1 or more, even on a loaded machine; an idle agent's own threads ~0.006."""
    compile_reason: str | None = None  # while ``phase`` is ``compiling``: why (a recompile)
    step: int | None = None
    loss: float | None = None
    step_time_s: float | None = None
    avg_step_time_s: float | None = None
    data_wait_s: float | None = None
    collective_time_s: float | None = None
    input_wait_s: float | None = None
    compute_s: float | None = None
    grad_wait_s: float | None = None
    collective: Collective | None = None
    collective_seen: float | None = None
    collectives: CollectiveCounts | None = None
    """How many collectives the rank had entered at its last sample (the attribution evidence)."""
    sample_seen: float | None = None  # when its last sample arrived
    beats: array[float] | None = None
    """The last ``BEATS`` heartbeats that ended steps and timed the rank's collective wait,
    ``BEAT_WIDTH`` floats each (``Beat``): where its steps go, which ``slow_rank`` reads as
    medians (one step is noisy, one stall is no slow rank)."""
    step_times: StepTimes | None = None
    """Every step it timed since its process started, one step one vote: its median step
    (``state/step_times.py``), what the summary, the report and ``status`` quote."""
    timed_step: int | None = None
    timed_sent: float = 0.0
    """The step of its last heartbeat that moved the step, and the sender's clock then (two
    plain fields, not a tuple: no object for the collector to track, beat after beat)."""
    step_marks: dict[int, int] = field(default_factory=dict)
    """Python-level collectives entered by the end of marked steps (every MARK_EVERY-th)."""
    call_digests: dict[int, int] = field(default_factory=dict)
    """The digest of its Python-level calls in the window that ends at each marked step
    (``collectives.digests``, kept like ``step_marks``)."""
    call_windows: dict[int, list[CallSeen]] = field(default_factory=dict)
    """The distinct calls of its latest few windows, by the step that ends each
    (``collectives.window``): what the server quotes where digests differ."""
    forwards: int | None = None
    batch_marks: list[tuple[int, int]] | None = None
    drawn_marks: dict[int, int] = field(default_factory=dict)
    """Batches drawn from the training DataLoader by the end of marked steps (``batch_marks``,
    kept like ``step_marks``)."""
    backward_marks: list[tuple[int, int]] | None = None
    eval_sync_marks: list[tuple[int, int]] | None = None
    evals_marked: dict[int, int] = field(default_factory=dict)
    """Evaluation forwards through a DDP model that broadcasts its buffers, by the end of
    marked steps (``eval_sync_marks``, kept like ``step_marks``)."""
    backwards_marked: dict[int, int] = field(default_factory=dict)
    """Backward passes run by the end of marked steps (``backward_marks``, kept like
    ``step_marks``)."""
    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    mem_peak_bytes: int | None = None
    gpu_mem_used_bytes: int | None = None
    gpu_mem_total_bytes: int | None = None
    gpu_pids: list[int] | None = None
    host_rss_bytes: int | None = None
    workers_rss_bytes: int | None = None
    host_available_bytes: int | None = None
    host_total_bytes: int | None = None
    cgroup_limit_bytes: int | None = None
    cgroup_used_bytes: int | None = None
    host_mem_points: array[float] | None = None
    """(server time, rank + workers bytes, step) about every second, the last 16,
    interleaved, once its memory settled: how fast its host memory grows
    (``state/host_memory.py``)."""
    first_step: int | None = None
    first_step_at: float | None = None
    """The first step the rank reported, and when (server time): its start ends some time
    after it (``host_memory.settled``)."""
    last_progress: float = 0.0  # a step ended or a forward pass ran
    last_step_at: float = 0.0  # a step ended
    wait_ended_at: float = 0.0
    """When the rank last came out of a collective (server time), and how long it had
    waited in it: peers released from a long wait after a rank's last report are evidence
    that it entered that collective since (``rules.progress.rule_stalled``)."""
    wait_ended_s: float = 0.0
    # trouble
    stack: str | None = None
    stack_moved_at: float | None = None
    """When a stack came that differs from the one before it at the same step: the rank is
    working (``busy``), not stuck, while its stacks keep changing."""
    error: ErrorInfo | None = None
    error_time: float | None = None
    exit_code: int | None = None
    exit_signal: str | None = None
    exit_time: float | None = None
    final_collective: Collective | None = None
    """The collective the rank was in when it crashed or exited (no longer timed)."""
    nan_step: int | None = None
    nan_exact: bool = False  # nan_step is the exact first bad step the agent saw, not a bound
    grad_nan_step: int | None = None
    """The first step whose own gradients, before DDP's all-reduce, were not finite (the
    agent's exact step, as it came): where a NaN that DDP spread began (``nan_loss``)."""
    checkpoint_paths: list[str] = field(default_factory=list)
    phases: list[tuple[str, float]] = field(default_factory=list)
    log_tail: deque[str] = field(default_factory=lambda: deque(maxlen=LOG_LINES))

    def median_step_s(self) -> float | None:
        """Its median step over every step it timed (None before it timed one)."""
        return None if self.step_times is None else self.step_times.median_s

    @property
    def finished(self) -> bool:
        """True once the rank crashed or exited: it will send no more heartbeats."""
        return self.error is not None or self.exit_time is not None

    def collective_age(self, now: float) -> float | None:
        """How long the in-flight collective has been waited on, as of ``now``."""
        if self.collective is None or self.collective_seen is None:
            return None
        return self.collective.since_s + max(0.0, now - self.collective_seen)


_UNDECLARED = sorted(set(STORED_FIELDS) - {f.name for f in fields(RankRecord)})
if _UNDECLARED:  # a wire field added to the protocol but not to the record: fail at import
    raise TypeError(f"RankRecord does not declare the protocol fields {_UNDECLARED}")
