"""Training progress: stalled ranks, step skew, the slow rank, non-finite losses and
checkpoint files written by several ranks."""

from __future__ import annotations

import math
import statistics
from collections import defaultdict

from ddpwatch.server.alerts import Alert
from ddpwatch.server.rules.facts import Facts, is_busy
from ddpwatch.server.rules.registry import alert, rule
from ddpwatch.server.rules.text import STACKS_IN, format_ranks, record_location, seconds, verb
from ddpwatch.server.state import RankRecord
from ddpwatch.vocabulary import AlertKind, Severity


@rule(AlertKind.STALLED)
def rule_stalled(f: Facts) -> list[Alert]:
    """A training rank that stopped making progress outside any collective."""
    cutoff = f.now - f.stall_after  # idle(r) > stall_after, without a call per rank
    if f.since >= cutoff:
        return []
    candidates = [r for r in f.census.idle if r.last_progress < cutoff and r.step is not None]
    if not candidates or f.cascade.roots:
        return []
    found = f.straggle
    excluded = {r.rank for r in found.culprits} if found else set()
    released = _latest_release(f)
    stalled = [
        r
        for r in candidates
        if r.rank not in excluded
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
    # a step is evidence of where a rank is now only if it was sent lately: a rank whose
    # relay died keeps its last relayed step until its first heartbeat on the direct path
    # (seen: healthy ranks named 114 steps behind within a second of the switch)
    fresh = f.now - (2 * th.interval + 0.5)
    ranks = [r for r in f.live if r.step is not None and r.last_seen >= fresh]
    if f.since < f.now - f.stall_after:  # else none has idled longer than that yet
        moved = f.now - f.stall_after  # ``idle(r) <= stall_after``, without a call per rank
        ranks = [r for r in ranks if r.last_progress >= moved]
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
    times = [
        min(values)
        for values in (
            [r.step_time_s for r in ranks if r.step_time_s],
            [r.avg_step_time_s for r in ranks if r.avg_step_time_s],
        )
        if values
    ]
    if not times:
        return []
    allowed = 3 + (th.interval + 0.5 + f.lag) / min(times)
    top = max(r.step or 0 for r in ranks)
    lead = min((r for r in ranks if (r.step or 0) == top), key=lambda r: r.rank)
    behind = sorted((r for r in ranks if (r.step or 0) < top - allowed), key=lambda r: r.rank)
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


SETTLED_SAMPLES = 10
"""Heartbeats a rank's averaged collective wait needs before slow_rank reads it: the
warm-up's weight in the average is 0.8**10, about a tenth, after 10 (5 s at 2 Hz)."""


@rule(AlertKind.SLOW_RANK, every="slow")
def rule_slow_rank(f: Facts) -> list[Alert]:
    """The rank the others wait for every step: its own collective wait is far shorter.

    Conservative on purpose: a healthy job must stay silent, so the slow rank must
    stand out clearly in waits averaged over steps (one step's wait jitters by milliseconds
    on a busy host), every average must hold enough steps to be past warm-up (DataLoader
    workers starting, first compilations: a rank slow for its first second is not slow), and
    collectives must be a real share of the step.
    """
    moved = f.now - f.stall_after  # ``idle(r) <= stall_after``, without a call per rank
    ranks = [
        r
        for r in f.live
        if r.avg_step_time_s is not None
        and r.avg_collective_time_s is not None
        and r.collective_time_samples >= SETTLED_SAMPLES
        and (r.collective is not None or r.last_progress >= moved or f.since >= moved)
    ]
    if len(ranks) < 3:
        return []
    step = statistics.median(r.avg_step_time_s or 0.0 for r in ranks)
    wait = statistics.median(r.avg_collective_time_s or 0.0 for r in ranks)
    if step <= 0 or wait < 0.2 * step or wait < 0.005:
        return []
    slow = sorted(
        (r for r in ranks if (r.avg_collective_time_s or 0.0) < 0.25 * wait), key=lambda r: r.rank
    )
    if not slow or len(slow) > max(1, len(ranks) // 4):
        return []
    slowest = min(slow, key=lambda r: (r.avg_collective_time_s or 0.0, r.rank))
    lost_ms = (wait - (slowest.avg_collective_time_s or 0.0)) * 1000
    who = format_ranks(r.rank for r in slow)
    message = (
        f"{who} {verb(len(slow), 'is', 'are')} the slowest: the other ranks wait "
        f"{lost_ms:.0f} ms per step for {verb(len(slow), 'it', 'them')} in collectives"
    )
    hint = (
        f"rank {slowest.rank} computes or loads data slower than the others: compare its data "
        "wait, its GPU (clocks, temperature, other processes) and its batch sizes"
    )
    if slowest.data_wait_s and slowest.data_wait_s * 1000 > 0.5 * lost_ms:
        hint = (
            f"rank {slowest.rank} waits {slowest.data_wait_s * 1000:.0f} ms per step for data: "
            "give its DataLoader more workers or faster storage"
        )
    return [alert(AlertKind.SLOW_RANK, Severity.WARNING, [r.rank for r in slow], [], message, hint)]


@rule(AlertKind.NAN_LOSS)
def rule_nan_loss(f: Facts) -> list[Alert]:
    """A loss that became nan or inf: the rank whose first bad step is earliest.

    DDP averages gradients, so one rank's NaN reaches every rank a step later. A rank is
    named first only when every other live rank's own report shows it was still finite at
    that step (an agent reports the exact first bad step; a heartbeat's step is only an
    upper bound); until then, a heartbeat at most, nothing is said.
    """
    bad = sorted((r for r in f.records if r.nan_step is not None), key=lambda r: r.rank)
    if not bad:
        return []
    since = min(r.nan_step or 0 for r in bad)
    first = [r for r in bad if r.nan_step == since]
    others = [r for r in f.live if r.nan_step is None or r.nan_step > since]
    if not all(_finite_at(r, since) for r in others):
        if any(r.nan_step is not None and not r.nan_exact for r in bad) and len(bad) > 1:
            return [_nan_alert(f, bad, [], since, "which rank went first is not known")]
        return []  # a rank has not reported past that step yet: its next heartbeat will
    if any(not r.nan_exact for r in first) and len(first) < len(bad):
        return [_nan_alert(f, bad, [], since, "which rank went first is not known")]
    return [_nan_alert(f, bad, first, since, None)]


def _finite_at(record: RankRecord, step: int) -> bool:
    """The rank's own report shows a finite loss at ``step``: it went bad later, or not."""
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
    finite = [r.rank for r in f.live if r.nan_step is None and r.loss is not None]
    later = [r for r in bad if r not in first]
    if unknown:
        message = f"{format_ranks(r.rank for r in bad)} loss is {word}, the first by step {since}"
        message += f"; {unknown}"
    else:
        message = f"{format_ranks(r.rank for r in first)} loss is {word} since step {since}"
        if later:
            then = min(r.nan_step or 0 for r in later)
            message += f" and {format_ranks(r.rank for r in later)} followed from step {then}"
    if finite:
        message += f" while {format_ranks(finite)} {verb(len(finite), 'is', 'are')} finite"
    if first and (finite or later):
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
