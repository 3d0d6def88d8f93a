"""Training progress: stalled ranks, step skew, the slow rank, non-finite losses and
checkpoint files written by several ranks."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict
from collections.abc import Callable
from operator import attrgetter

from ddpwatch.core.vocabulary import AlertKind, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.ranks import is_busy, is_compiling
from ddpwatch.diagnosis.facts.stragglers import Lag, lag_since_episode, timed
from ddpwatch.diagnosis.rules.registry import alert, odd_alert, rule
from ddpwatch.diagnosis.text import format_ranks, record_location, verb
from ddpwatch.state.records import BEAT_WIDTH, MIN_BEATS, Beat, RankRecord, stands_for
from ddpwatch.status.fmt import STACKS_IN, seconds, wait

COMPILE_LONG_S = 1200.0
"""A compile this long (or 60 stall thresholds, if more) may never end: a cold compile of a
large model takes minutes, but ``torch.compile(dynamic=True)`` has compiled forever (PyTorch
#118492) and max-autotune has hung under DDP (#140395)."""


@rule(AlertKind.STALLED)
def rule_stalled(f: Facts) -> list[Alert]:
    """A training rank that stopped making progress outside any collective. A rank that
    compiles (``torch.compile``) works: not a stall until it has compiled far longer than a
    cold compile takes (then a warning that says so); one the others wait for in a
    collective is the straggler's business."""
    cutoff = f.now - f.stall_after  # idle(r) > stall_after, without a call per rank
    if f.since >= cutoff:
        return []
    idle = [r for r in f.census.idle if r.last_progress < cutoff]
    if not idle or f.cascade.roots:
        return []
    stepping = [r for r in idle if r.step is not None]  # before: startup_hang's business
    stalled = _stalled(f, stepping) if stepping else []
    return stalled or _compiling_too_long(f, idle)


def _stalled(f: Facts, candidates: list[RankRecord]) -> list[Alert]:
    found = f.straggle
    excluded = {r.rank for r in found.culprits} if found else set()
    excluded.update(r.rank for hold in f.p2p_holds for r in hold.culprits)  # rule_p2p's
    released = _latest_release(f)
    stalled = [
        r
        for r in candidates
        if r.rank not in excluded
        and not is_compiling(r)
        and not is_busy(r, f.now, f.th)
        and (r.sample_seen or 0.0) >= released
    ]
    if not stalled:
        return []
    worst = min(stalled, key=lambda r: (r.last_progress, r.rank))
    ranks = sorted(r.rank for r in stalled)
    quiet = seconds(f.idle(worst))
    phase = f" in phase '{worst.phase}'" if worst.phase else ""
    loc = record_location(worst)
    spot = f"at step {worst.step}{phase}" + (f", {loc}" if loc else "")
    if len(ranks) == 1:
        message = f"rank {worst.rank} has made no progress for {quiet} {spot}"
    else:
        message = (
            f"{format_ranks(ranks)} have made no progress for up to {quiet}; "
            f"rank {worst.rank} is {spot}"
        )
    pid = f"py-spy dump --pid {worst.pid}" if worst.pid else "py-spy dump"
    hint = (
        f"look at rank {worst.rank}'s stack ({STACKS_IN}) or run {pid}: it may "
        "wait on data loading, I/O, a lock or a GPU kernel"
    )
    return [alert(AlertKind.STALLED, Severity.ERROR, ranks, [], message, hint, phase=worst.phase)]


def _compiling_too_long(f: Facts, candidates: list[RankRecord]) -> list[Alert]:
    """Ranks inside ``torch.compile`` for longer than any cold compile should take: at their
    first step too (startup_hang counts no compiling rank as starting)."""
    limit = max(COMPILE_LONG_S, 60 * f.stall_after)
    cutoff = f.now - limit
    if f.since >= cutoff:
        return []
    long = [
        r
        for r in candidates
        if is_compiling(r) and max(r.last_progress, r.phase_since or 0.0) < cutoff
    ]
    if not long:
        return []
    worst = min(long, key=lambda r: (r.last_progress, r.rank))
    ranks = sorted(r.rank for r in long)
    took = wait(f.now - max(worst.last_progress, worst.phase_since or 0.0))
    who = f"rank {worst.rank} has" if len(ranks) == 1 else f"{format_ranks(ranks)} have"
    reason = f" (a recompile: {worst.compile_reason})" if worst.compile_reason else ""
    message = (
        f"{who} been compiling (torch.compile) for {'up to ' if len(ranks) > 1 else ''}{took} "
        f"{_at_step(worst)}{reason}: a cold compile takes minutes, this one may never end"
    )
    pid = f"py-spy dump --pid {worst.pid}" if worst.pid else "py-spy dump"
    hint = (
        f"run {pid} to see where the compiler is; TORCH_LOGS=+dynamo,+inductor tells what it "
        "compiles. Compiles known to run forever: dynamic=True on some models (PyTorch "
        "#118492), mode='max-autotune' under DDP (#140395): try the default mode, "
        "dynamic=False or TORCHINDUCTOR_COMPILE_THREADS=1"
    )
    return [
        alert(AlertKind.STALLED, Severity.WARNING, ranks, [], message, hint, phase=worst.phase)
    ]


def _at_step(record: RankRecord) -> str:
    return "before its first step" if record.step is None else f"at step {record.step}"


def _latest_release(f: Facts) -> float:
    """The last time a live rank came out of a wait long enough to be a straggler's: a
    rank whose last report is older may be the one they waited for, and their release says
    it has since entered that collective (seen: the straggler, done with its solo work, named
    ``stalled`` for 0.3 s, between its peers' release and its own next heartbeat)."""
    limit = f.collective_limit
    return max((r.wait_ended_at for r in f.live if r.wait_ended_s > limit), default=0.0)


@rule(AlertKind.STEP_SKEW, every="slow")
def rule_step_skew(f: Facts) -> list[Alert]:
    """Training ranks far apart in step count: they are not really in lockstep."""
    th = f.th
    ranks, steps = _lately_stepping(f)
    if len(ranks) < 2:
        return []
    # Heartbeats sample steps at different moments: allow what the fastest plausible step
    # rate covers in one interval. The latest step time, not only the average, because an
    # average still includes a pause the job has just recovered from; the fastest rank's, not
    # the median, because right after a long barrier most ranks' last step is the wait itself
    # while the first one out already runs at full speed (seen: rank 2, last heard at step
    # 21, named 5 steps behind a rank 0 that had left a 25 s barrier first). A server behind
    # its queue (``f.lag``) may have read some ranks' heartbeats up to that much further than
    # others' (relays' backlogs drain unevenly): their steps were sampled that far apart too
    # (seen: 64,287 of 65,536 lockstep ranks named behind the freshest, ``scale.py``).
    fastest = [
        min(filter(None, map(field, ranks)), default=None)  # the fastest non-zero time
        for field in (_STEP_TIME, _AVG_STEP_TIME)
    ]
    times = [t for t in fastest if t is not None]
    if not times:
        return []
    allowed = 3 + (th.interval + 0.5 + f.lag) / min(times)
    top = max(steps)
    if min(steps) >= top - allowed:
        return []  # lockstep: a C loop each, no rank looked at one by one
    leads = [r for r in ranks if (r.step or 0) == top]
    lead = min(leads, key=lambda r: r.rank)
    late = _late_by(leads, min(times))
    behind = sorted(
        (r for r in ranks if (r.step or 0) + late(r) < top - allowed), key=lambda r: r.rank
    )
    if not behind:
        return []
    last = min(behind, key=lambda r: (r.step or 0, r.rank))
    gap = top - (last.step or 0)
    who = format_ranks(r.rank for r in behind)
    message = (
        f"{who} {verb(len(behind), 'is', 'are')} up to {gap} steps behind rank {lead.rank} "
        f"(step {last.step} against {top}); ranks in lockstep differ by at most {allowed:.0f}"
    )
    hint = (
        "DDP keeps ranks in lockstep, so a growing gap means they do not synchronise: check "
        "that the model is wrapped in DistributedDataParallel on every rank and that all "
        "ranks use the same process group"
    )
    return [
        alert(AlertKind.STEP_SKEW, Severity.WARNING, [r.rank for r in behind], [], message, hint)
    ]


def _late_by(leads: list[RankRecord], step_s: float) -> Callable[[RankRecord], float]:
    """How many steps a rank's evidence may be older than the leads', by the senders' clocks:
    ``timed_sent`` dates the heartbeat that took each rank to its step. A node whose frames
    spend seconds in transit reports steps that old, and an age added by a relay cannot say
    so (seen: ``scale.py --node-fault late``, a node's 8 lockstep ranks named 8 steps behind on
    evidence 2 s old). Only ever subtracted from a gap, never added: hosts' clocks that
    disagree can then hide a small skew (a gap that grows shows later), never invent one."""
    dated = [r.timed_sent for r in leads if r.timed_step is not None and r.timed_step == r.step]
    if not dated:
        return lambda r: 0.0
    newest = max(dated)

    def late(r: RankRecord) -> float:
        if r.timed_step is None or r.timed_step != r.step or r.timed_sent >= newest:
            return 0.0
        return (newest - r.timed_sent) / step_s

    return late


_STEP, _SEEN, _PROGRESS = attrgetter("step"), attrgetter("last_seen"), attrgetter("last_progress")
_STEP_TIME, _AVG_STEP_TIME = attrgetter("step_time_s"), attrgetter("avg_step_time_s")


def _lately_stepping(f: Facts) -> tuple[list[RankRecord], list[int]]:
    """The live ranks whose step says where they are now, and their steps. A step is
    evidence of where a rank is now only if it was sent lately: a rank whose relay died
    keeps its last relayed step until its first heartbeat on the direct path (seen: healthy
    ranks named 114 steps behind within a second of the switch); and only from a rank that
    moved within the stall threshold. Where every live rank passes (most ticks), each test
    is one C loop over them, not a look at each rank (131,072 ranks: 90 -> 15 ms)."""
    live = f.live
    fresh = f.now - (2 * f.th.interval + 0.5)
    cutoff = f.now - f.stall_after  # ``idle(r) <= stall_after``, without a call per rank,
    moved = cutoff if f.since < cutoff else None  # where any rank can have idled that long
    steps: list[int] = list(map(_STEP, live))  # None among them: the slow path below
    if (
        None not in steps
        and min(map(_SEEN, live), default=fresh) >= fresh
        and (moved is None or min(map(_PROGRESS, live), default=moved) >= moved)
    ):
        return live, steps
    ranks = [r for r in live if r.step is not None and r.last_seen >= fresh]
    if moved is not None:
        ranks = [r for r in ranks if r.last_progress >= moved]
    return ranks, [r.step or 0 for r in ranks]


@rule(AlertKind.STEP_SKEW, every="slow")
def rule_batch_desync(f: Facts) -> list[Alert]:
    """A rank whose data is out of step with the others' while their steps still agree.

    A rank that skips a batch after a caught exception (PyTorch #44353), in a loop whose only
    collective is DDP's all-reduce, raises nothing: sizes match, and from then on its gradients
    are averaged with the others' next batch. So does a rank that accumulates another number
    of micro-batches per step. Every rank marks the same steps (every 8th) with the batches
    it has drawn from its training DataLoader (``batch_marks``); a rank that differs from a
    strict majority at the latest step all live ranks marked is named.
    """
    found = f.odd_at_mark("drawn_marks")
    if found is None:
        return []
    odd, diff = found.odd, found.diff
    batches = f"{abs(diff)} {verb(abs(diff), 'batch', 'batches')}"
    message = (
        f"{format_ranks(r.rank for r in odd)} had drawn {batches} "
        f"{'more' if diff > 0 else 'fewer'} than {format_ranks(r.rank for r in found.majority)} "
        f"from {verb(len(odd), 'its', 'their')} DataLoader by step {found.step} ({found.own} "
        f"against {found.usual}) while {verb(len(odd), 'its', 'their')} steps and collectives "
        "still pair up with theirs: DDP averages its gradients with other batches than the "
        "ones the others use, and nothing fails"
    )
    hint = (
        f"rank {odd[0].rank} skipped a batch (an exception caught in the loop: an OOM, a corrupt "
        "sample) or accumulates another number of micro-batches per step: skip on every rank "
        "together (all_reduce a skip flag) or not at all, and give every rank the same "
        "gradient accumulation"
    )
    return [odd_alert(AlertKind.STEP_SKEW, found, message, hint)]


@rule(AlertKind.STEP_SKEW, every="slow")
def rule_backward_desync(f: Facts) -> list[Alert]:
    """A rank that runs another number of backward passes per step than the others, whatever
    feeds it (synthetic data, a hand-written loader, pre-loaded shards: no DataLoader count
    to compare). One backward more under ``no_sync()`` is a micro-batch the others do not
    accumulate (FunASR #3472's shape); one more outside it, a step skipped after its backward
    (a caught error, a loss check on one rank), whose all-reduce the others spent on their
    next step. Every rank marks the same steps (every 8th) with its backwards so far
    (``backward_marks``); one that differs from a strict majority at the latest step all live
    ranks marked is named. Where their DataLoaders tell it (``rule_batch_desync``), that
    says it."""
    if f.odd_at_mark("drawn_marks") is not None:
        return []
    found = f.odd_at_mark("backwards_marked")
    if found is None:
        return []
    odd, diff = found.odd, found.diff
    passes = f"{abs(diff)} {verb(abs(diff), 'backward pass', 'backward passes')}"
    message = (
        f"{format_ranks(r.rank for r in odd)} had run {passes} "
        f"{'more' if diff > 0 else 'fewer'} than {format_ranks(r.rank for r in found.majority)} "
        f"by step {found.step} ({found.own} against {found.usual}) while "
        f"{verb(len(odd), 'its', 'their')} steps still pair up with theirs: its gradients are "
        "accumulated or averaged over other micro-batches than the others', and nothing fails"
    )
    hint = (
        f"rank {odd[0].rank} accumulates another number of micro-batches per step (its no_sync "
        "loop) or skipped an optimizer step after a backward (an exception caught, a check of "
        "its own loss): give every rank the same accumulation, and skip on every rank "
        "together (all_reduce a skip flag) or not at all"
    )
    return [odd_alert(AlertKind.STEP_SKEW, found, message, hint)]


SETTLED_BEATS = 10
"""Heartbeats since a rank's last episode (``Lag``) before slow_rank reads it: medians of 10
(5 s at 2 Hz) hold neither a warm-up's first second (DataLoader workers starting, first
compilations) nor the stall or stop before them. Counted as the heartbeats its beats stand
for (``Beat.STANDS_FOR``), ``MIN_BEATS`` beats at least: through a relay at pace 4, 5 beats
(10 s), not 10 (20 s)."""
SLOW_COST = 0.075
"""The share of the step the others lose waiting from which slow_rank speaks: a rank that
costs the job 10 % is named within seconds (once it lags on most beats of the window), one
that costs under 5 % never is, and a cost near the line does not come and go with each
step's jitter (medians over 8 s move only when most of its beats do)."""
MIN_WAIT_S = 0.005  # the others' wait per step below which nothing is said (timer noise)
PACE_BEATS = 5
"""Heartbeats of the others' own steps (their work, less their waits) that the pace the job
would have without the slow rank needs: with fewer, "instead of ~N steps/s" is not said."""
LISTED = 8  # the waiting ranks a message names one by one
SAMPLED = 256
"""Ranks whose windows tell the others' typical wait and step (``_spread``)."""


@rule(AlertKind.SLOW_RANK, every="slow")
def rule_slow_rank(f: Facts) -> list[Alert]:
    """The rank the others wait for on most steps: its own wait is far shorter than theirs.

    DDP's all-reduce evens out every rank's step time, so a rank slower in its input or its
    compute shows only as the others' wait (TraceML issue 252): in collectives, and in the
    gradient all-reduce at the end of ``backward()`` (``grad_wait_s``). Conservative on
    purpose: a healthy job must stay silent, so the slow rank must stand out clearly in
    waits that are medians over heartbeats since each rank's last episode (``Lag``: one
    step's wait jitters by milliseconds on a busy host, and a one-off stall or stop is the
    straggler's and silent alerts' business, not a slow rank), every window must hold enough
    beats (``SETTLED_BEATS``), and what the others lose must be a real share of the step
    (``SLOW_COST``).
    """
    limit = f.collective_limit  # a step gap longer than this ends an episode
    ranks = _judged(f)
    sample = _settled(_spread(ranks), limit)
    if len(sample) < 3:
        return []
    wait = statistics.median(lag.waited_s for _, lag in sample)
    if wait < MIN_WAIT_S:
        return []
    slow = _lagging(ranks, 0.25 * wait, limit)
    if not slow or len(slow) > max(1, len(ranks) // 4):
        return []
    culprits = {r.rank for r, _ in slow}
    theirs = [lag for r, lag in sample if r.rank not in culprits]
    if not theirs:
        return []
    slowest, lag = min(slow, key=lambda found: (found[1].waited_s, found[0].rank))
    lost = statistics.median(their.waited_s for their in theirs) - lag.waited_s
    step = statistics.median(their.median(Beat.STEP) or 0.0 for their in theirs)
    if step <= 0 or lost < SLOW_COST * step:
        return []
    others = [r for r in ranks if r.rank not in culprits]
    part = _differing_part(lag, theirs, lost)
    without = _pace_without(lag, theirs, step)
    message = _slow_message([r for r, _ in slow], others, theirs, (lost, step, without), part)
    hint = _slow_hint(slowest.rank, (lag, theirs), lost, part)
    return [
        alert(
            AlertKind.SLOW_RANK,
            Severity.WARNING,
            sorted(culprits),
            [r.rank for r in others],
            message,
            hint,
            lost_share=min(1.0, lost / step),
        )
    ]


def _judged(f: Facts) -> list[RankRecord]:
    """The live ranks slow_rank compares, by what their records say at a glance: moving or
    inside a collective, ``SETTLED_BEATS`` heartbeats kept (``_settles``), their steps
    timed; only those that time DDP's wait where any does (one that cannot see it would
    look the slowest: an older agent, a model on a GPU)."""
    moved = f.now - f.stall_after  # ``idle(r) <= stall_after``, without a call per rank
    least, need = MIN_BEATS * BEAT_WIDTH, SETTLED_BEATS * BEAT_WIDTH
    ranks = [
        r
        for r in f.live
        if r.beats is not None
        and len(r.beats) >= least
        and (len(r.beats) >= need or stands_for(r.beats) >= SETTLED_BEATS)
        and timed(r.beats, Beat.STEP)
        and (r.collective is not None or r.last_progress >= moved or f.since >= moved)
    ]
    seeing = [r for r in ranks if r.beats is not None and timed(r.beats, Beat.GRAD_WAIT)]
    return seeing or ranks


def _spread(ranks: list[RankRecord]) -> list[RankRecord]:
    """Up to about ``SAMPLED`` ranks spread over the list, whose windows tell the others'
    typical wait and step: 65,536 ranks of one lockstep job tell them no better than a few
    hundred, and reading every window each second would cost a tenth of a core."""
    return ranks if len(ranks) <= 2 * SAMPLED else ranks[:: len(ranks) // SAMPLED]


def _settled(ranks: list[RankRecord], limit: float) -> list[tuple[RankRecord, Lag]]:
    """Each rank's ``Lag`` since its last episode, where that has settled (``_settles``)."""
    found = []
    for r in ranks:
        lag = lag_since_episode(r, limit)
        if lag is not None and _settles(lag):
            found.append((r, lag))
    return found


def _settles(lag: Lag) -> bool:
    """The window holds ``MIN_BEATS`` and stands for ``SETTLED_BEATS`` heartbeats."""
    return lag.beats >= MIN_BEATS and (
        lag.beats >= SETTLED_BEATS or lag.heartbeats >= SETTLED_BEATS
    )


def _lagging(
    ranks: list[RankRecord], below: float, limit: float
) -> list[tuple[RankRecord, Lag]]:
    """The settled ranks whose wait is under ``below`` on most beats since their episode,
    by rank; a rank none of whose beats waited that little is passed over at a glance."""
    found = []
    for r in ranks:
        beats = r.beats
        if beats is None or min(beats[Beat.WAITED :: BEAT_WIDTH]) >= below:
            continue
        lag = lag_since_episode(r, limit)
        if lag is not None and _settles(lag) and lag.waited_s < below:
            found.append((r, lag))
    return sorted(found, key=lambda found: found[0].rank)


def _differing_part(
    slowest: Lag, others: list[Lag], lost: float
) -> tuple[str, float, float] | None:
    """The part of the slow rank's step that differs from the others' (its input wait or
    its compute, medians), when that explains half the loss at least."""
    found = []
    for name, column in (("input wait", Beat.INPUT_WAIT), ("compute", Beat.COMPUTE)):
        own = slowest.median(column)
        values = [v for v in (lag.median(column) for lag in others) if v is not None]
        if own is not None and values:
            theirs = statistics.median(values)
            found.append((own - theirs, name, own, theirs))
    if not found:
        return None
    extra, name, own, theirs = max(found)
    return (name, own, theirs) if extra >= 0.5 * lost else None


def _pace_without(slowest: Lag, others: list[Lag], step: float) -> float | None:
    """The step the job would take without the slow rank: the others' own step (their work,
    less their waits: median) plus what the slow rank itself waits (the all-reduce's own
    time). None without ``PACE_BEATS`` of the others' own steps, for own steps within timer
    noise (no "~1000000 steps/s" from a step of nothing), or for no faster pace than now."""
    owns = [own for own, beats in filter(None, (lag.own_step() for lag in others))
            if beats >= PACE_BEATS]  # fmt: skip
    if not owns:
        return None
    own = statistics.median(owns)
    if own < MIN_WAIT_S:
        return None
    without = own + slowest.waited_s
    return without if without < step else None


def _slow_message(
    slow: list[RankRecord],
    others: list[RankRecord],
    theirs: list[Lag],
    cost: tuple[float, float, float | None],
    part: tuple[str, float, float] | None,
) -> str:
    """The alert's sentence: "rank 1 enters DDP's gradient all-reduce ~190 ms after ranks 0, 2
    every step (its compute takes 210 ms, theirs 20 ms): the job runs at 4.3 steps/s instead
    of ~5.2"; without the last clause where ``_pace_without`` cannot tell."""
    lost, step, without = cost
    grad = statistics.median(lag.median(Beat.GRAD_WAIT) or 0.0 for lag in theirs)
    total = statistics.median(lag.waited_s for lag in theirs)
    where = "DDP's gradient all-reduce" if grad >= 0.5 * total else "their collectives"
    if len(slow) == 1:
        where = where.replace("their", "its")
    who = format_ranks(r.rank for r in slow)
    them = (
        format_ranks(r.rank for r in others)
        if len(others) <= LISTED
        else f"the other {len(others)} ranks"
    )
    message = (
        f"{who} {verb(len(slow), 'enters', 'enter')} {where} ~{lost * 1000:.0f} ms after "
        f"{them} every step"
    )
    if part is not None:
        name, own, their = part
        mine = "its" if len(slow) == 1 else f"rank {min(slow, key=lambda r: r.rank).rank}'s"
        message += f" ({mine} {name} takes {own * 1000:.0f} ms, theirs {their * 1000:.0f} ms)"
    message += f": the job {_pace(step)}"
    return message if without is None else message + f" instead of ~{_pace(without, bare=True)}"


def _pace(step: float, bare: bool = False) -> str:
    """How fast the job goes (``step`` > 0): "runs at 4.3 steps/s", or "takes 2.5 s a step"
    for slow steps."""
    if step < 1.0:
        rate = 1.0 / step
        text = f"{rate:.0f}" if rate >= 10 else f"{rate:.1f}"
        return text if bare else f"runs at {text} steps/s"
    return seconds(step) if bare else f"takes {seconds(step)} a step"


def _slow_hint(
    rank: int, lags: tuple[Lag, list[Lag]], lost: float, part: tuple[str, float, float] | None
) -> str:
    """What to look at on the slow rank: the part of its step that differs; else its data
    wait where that alone differs from the others' (a wait every rank has is no fix)."""
    if part is not None and part[0] == "input wait":
        return (
            f"rank {rank} waits {part[1] * 1000:.0f} ms per step for its input: give its "
            "DataLoader more workers (num_workers, pin_memory) or faster storage, and check "
            "its shard of the data (larger samples, a slow transform)"
        )
    if part is not None:
        return (
            f"rank {rank} computes slower than the others: compare its GPU (clocks, "
            "temperature, other processes), its batch and sequence sizes, and any work it "
            "alone does in its step (hooks, logging, checks)"
        )
    data = _data_waits(*lags)
    if data is not None and data[0] - data[1] > 0.5 * lost:
        return (
            f"rank {rank} waits {data[0] * 1000:.0f} ms per step for data, the others "
            f"{data[1] * 1000:.0f} ms: give its DataLoader more workers or faster storage"
        )
    return (
        f"rank {rank} computes or loads data slower than the others: compare its data "
        "wait, its GPU (clocks, temperature, other processes) and its batch sizes"
    )


def _data_waits(slowest: Lag, others: list[Lag]) -> tuple[float, float] | None:
    """The slow rank's wait for data per step and the others' (medians, 0 where they timed
    none), or None where it timed none."""
    own = slowest.median(Beat.DATA_WAIT)
    if own is None:
        return None
    theirs = [v for v in (lag.median(Beat.DATA_WAIT) for lag in others) if v is not None]
    return own, statistics.median(theirs) if theirs else 0.0


@rule(AlertKind.NAN_LOSS)
def rule_nan_loss(f: Facts) -> list[Alert]:
    """A loss that became nan or inf: the rank whose first bad step is earliest.

    DDP averages gradients, so one rank's NaN reaches every rank a step later. A rank's first
    bad step is the earlier of its loss's (``nan_step``) and its own gradients' before the
    all-reduce (``grad_nan_step``): a bad sample may give a rank infinite gradients from a
    finite loss, and then every loss, its own included, is NaN only from the next step. A
    rank is named first only when every other live rank's own report shows it was still
    finite at that step (an agent reports the exact first bad step; a heartbeat's step is
    only an upper bound); until then, a heartbeat at most, nothing is said.
    """
    if not f.flags.non_finite:
        return []  # no rank's loss or gradients went bad: no rank looked at one by one
    bad = sorted((r for r in f.records if r.nan_step is not None), key=lambda r: r.rank)
    if not bad:
        return []  # gradients alone (a GradScaler's overflow, a skipped step) are no alert
    grads = [r for r in f.records if r.grad_nan_step is not None and r.nan_step is None]
    since = min(_first_bad(r) for r in bad + grads)
    first = sorted((r for r in bad + grads if _first_bad(r) == since), key=lambda r: r.rank)
    named = {r.rank for r in first}
    others = [r for r in f.live if r.rank not in named]
    if not all(_finite_at(r, since) for r in others):
        if any(r.nan_step is not None and not r.nan_exact for r in bad) and len(bad) > 1:
            return [_nan_alert(f, bad, [], since, "which rank went first is not known")]
        return []  # a rank has not reported past that step yet: its next heartbeat will
    if any(not _exact_at(r, since) for r in first) and len(first) < len(bad):
        return [_nan_alert(f, bad, [], since, "which rank went first is not known")]
    return [_nan_alert(f, bad, first, since, None)]


def _first_bad(record: RankRecord) -> int:
    """The first step of the rank's current bad run: its loss's or its own gradients'."""
    steps = [s for s in (record.nan_step, record.grad_nan_step) if s is not None]
    return min(steps) if steps else 0


def _exact_at(record: RankRecord, step: int) -> bool:
    """The rank's own report names ``step`` exactly (gradients always do)."""
    return record.grad_nan_step == step or (record.nan_exact and record.nan_step == step)


def _finite_at(record: RankRecord, step: int) -> bool:
    """The rank's own report shows a finite loss at ``step``: it went bad later, or not."""
    if record.grad_nan_step is not None and record.grad_nan_step <= step:
        return False
    if record.nan_step is not None:
        return record.nan_exact and record.nan_step > step
    return record.step is not None and record.step >= step


def _nan_alert(
    f: Facts, bad: list[RankRecord], first: list[RankRecord], since: int, unknown: str | None
) -> Alert:
    values = {
        "nan" if math.isnan(r.loss) else "inf"
        for r in bad
        if r.loss is not None and not math.isfinite(r.loss)
    }
    word = values.pop() if len(values) == 1 else "not finite"
    named = {r.rank for r in first}
    # finite on its own report of the step after the first bad one, which DDP's all-reduce
    # reaches: a rank that has not reported it yet may be NaN already (seen under load:
    # "while rank 0 is finite", rank 0 NaN from that step, its heartbeat not in yet)
    finite = [
        r.rank
        for r in f.live
        if r.nan_step is None
        and r.loss is not None
        and r.rank not in named
        and (r.step or 0) > since
    ]
    later = [r for r in bad if r.rank not in named]
    by_grads = [r for r in first if r.nan_step is None or r.nan_step > since]
    if unknown:
        message = f"{format_ranks(r.rank for r in bad)} loss is {word}, the first by step {since}"
        message += f"; {unknown}"
    elif by_grads:
        message = _grads_message(first, by_grads, later, since, word)
    else:
        message = f"{format_ranks(r.rank for r in first)} loss is {word} since step {since}"
        if later:
            then = min(r.nan_step or 0 for r in later)
            message += f" and {format_ranks(r.rank for r in later)} followed from step {then}"
    if finite:
        message += f" while {format_ranks(finite)} {verb(len(finite), 'is', 'are')} finite"
    if by_grads:
        hint = (
            f"look for a bad sample in the data of {format_ranks(r.rank for r in by_grads)} at "
            f"step {since} whose backward is not finite (sqrt or norm of 0, log of 0, a "
            "division by a tiny number): torch.autograd.set_detect_anomaly(True) on that rank "
            "finds the operation; clipping gradients does not help, as the all-reduce runs first"
        )
    elif first and (finite or later):
        hint = (
            f"look for a bad sample or shard in the data of {format_ranks(r.rank for r in first)} "
            f"at step {since}; torch.autograd.set_detect_anomaly(True) finds the first bad "
            "operation"
        )
    else:
        hint = (
            "lower the learning rate, clip gradients, check for log(0) or division by zero, "
            "or use torch.autograd.set_detect_anomaly(True) to find the first bad operation"
        )
    waiting = [r.rank for r in later] if first else [r.rank for r in bad]
    return alert(
        AlertKind.NAN_LOSS, Severity.ERROR, [r.rank for r in first], waiting, message, hint
    )


def _grads_message(
    first: list[RankRecord],
    by_grads: list[RankRecord],
    later: list[RankRecord],
    since: int,
    word: str,
) -> str:
    """Where a NaN came from when a rank's own gradients went bad before its loss did."""
    n = len(by_grads)
    who = format_ranks(r.rank for r in by_grads)
    text = f"{who}'s own gradients" if n == 1 else f"the own gradients of {who}"
    text += f" were not finite at step {since}"
    if all(r.nan_step is not None or r.loss is not None for r in by_grads):
        text += f" ({verb(n, 'its', 'their')} loss was finite)"
    parts = [text]
    grads = {r.rank for r in by_grads}
    own = [r for r in first if r.rank not in grads]
    if own:
        parts.append(f"{format_ranks(r.rank for r in own)} loss is {word} since step {since}")
    message = " and ".join(parts)
    if later:
        then = min(r.nan_step or 0 for r in later)
        message += (
            f"; {format_ranks(r.rank for r in later)} received them through DDP's all-reduce "
            f"and {verb(len(later), 'its', 'their')} loss is {word} since step {then}"
        )
    return message


@rule(AlertKind.CHECKPOINT_CONFLICT, every="change")
def rule_checkpoint_conflict(f: Facts) -> list[Alert]:
    """Several ranks writing the same checkpoint file overwrite each other."""
    writers: dict[str, set[int]] = defaultdict(set)
    for r in f.records:
        for path in r.checkpoint_paths:
            writers[path].add(r.rank)
    conflicts = sorted((path, ranks) for path, ranks in writers.items() if len(ranks) > 1)
    if not conflicts:
        return []
    culprits = sorted({rank for _, ranks in conflicts for rank in ranks})
    path, ranks = conflicts[0]
    message = f"{format_ranks(ranks)} all wrote the checkpoint {path}, overwriting each other"
    if len(conflicts) > 1:
        message += f" ({len(conflicts)} paths are written by several ranks)"
    hint = (
        "save from one rank only (if dist.get_rank() == 0) or put the rank in the file name; "
        "ignore this for a sharded torch.distributed.checkpoint directory"
    )
    return [alert(AlertKind.CHECKPOINT_CONFLICT, Severity.WARNING, culprits, [], message, hint)]
