"""Root cause over cascade: the rank that failed, exited or went silent first, and the
ranks that failed or wait because of it (listed as ``waiting``, never as culprits)."""

from __future__ import annotations

from ddpwatch.server.alerts import Alert, Severity, Thresholds
from ddpwatch.server.rules.facts import Cascade, Facts, Root, is_clean_exit
from ddpwatch.server.rules.registry import alert, rule
from ddpwatch.server.rules.text import (
    collective_name,
    first_line,
    format_ranks,
    seconds,
    verb,
    where,
)


def _root_alert(root: Root, waiting: list[int], now: float) -> Alert:
    """The alert for one root: what failed first, why, and what to do."""
    ranks = sorted(root.ranks)
    first = min(root.records, key=lambda r: (r.error_time or r.exit_time or r.last_seen, r.rank))
    who = format_ranks(ranks)
    if root.kind == "silent":
        return _silent_alert(root, ranks, waiting, now)
    if root.kind == "exited":
        how = f"signal {first.exit_signal}" if first.exit_signal else f"exit code {first.exit_code}"
        message = f"{who} exited with {how} {where(first)}"
        hint = (
            "read the rank's own log: it ended without a Python exception (sys.exit, a crash "
            "in C++ code, or a signal from outside such as the OOM killer)"
        )
        return alert("exited", "error", ranks, waiting, message, hint)
    assert first.error is not None
    signature = root.signature
    error = f"{first.error.type}: {first_line(first.error.message)}".rstrip(": ")
    message = f"{who} crashed {where(first)} with {error}"
    if signature is not None:
        message += f" — {signature.cause}"
    if waiting:
        message += f"; {format_ranks(waiting)} failed or wait because of it"
    hint = (
        signature.hint
        if signature is not None
        else f"read the traceback of {format_ranks(ranks[:1])} (ddpwatch status --json shows "
        "it); the other ranks only failed because it died"
    )
    return alert("crashed", "error", ranks, waiting, message, hint)


def _silent_alert(root: Root, ranks: list[int], waiting: list[int], now: float) -> Alert:
    who = format_ranks(ranks)
    first = min(root.records, key=lambda r: (r.last_seen, r.rank))
    quiet = now - first.last_seen
    n = len(ranks)
    message = (
        f"{who} {verb(n, 'has', 'have')} sent no heartbeat for {seconds(quiet)}, last "
        f"{where(first)}; {verb(n, 'it was', 'they were')} probably killed (kill -9, the OOM "
        f"killer) or {verb(n, 'is', 'are')} stuck in native code holding the GIL"
    )
    if waiting:
        message += f"; {format_ranks(waiting)} failed or wait because of it"
    on_host = f" on host {first.host}" if first.host else ""
    pid = f"py-spy dump --pid {first.pid}" if first.pid else "py-spy dump --pid PID"
    hint = (
        f"check the launcher's log and dmesg (OOM killer){on_host}; if the process still runs, "
        f"{pid} shows where it hangs"
    )
    return alert("silent", "error", ranks, waiting, message, hint)


def _no_root_alerts(cascade: Cascade, now: float, th: Thresholds) -> list[Alert]:
    """Peer failures or SIGTERMs with no rank to blame yet.

    Within th.silent of the first one the real culprit is probably about to show up
    as silent, so say nothing; after that, blame the rank that failed first.
    """
    events = [(r.error_time or r.last_seen, r.rank, r) for r in cascade.symptoms]
    stops = [(r.exit_time or r.last_seen, r.rank, r) for r in cascade.stopped]
    if not events and not stops:
        return []
    if now - min(t for t, _, _ in events + stops) <= th.silent:
        return []
    if not events:
        ranks = sorted(r.rank for _, _, r in stops)
        signals = sorted({r.exit_signal or f"exit code {r.exit_code}" for _, _, r in stops})
        message = (
            f"{format_ranks(ranks)} {verb(len(ranks), 'was', 'were')} stopped by "
            f"{', '.join(signals)} and no rank reported a failure before"
        )
        hint = (
            "something outside the job stopped it: the launcher (its log names the first "
            "failure), the scheduler (time limit, preemption) or Ctrl-C"
        )
        return [alert("exited", "error", ranks, cascade.blocked, message, hint)]
    _, culprit_rank, culprit = min(events, key=lambda e: (e[0], e[1]))
    assert culprit.error is not None
    waiting = sorted({r.rank for _, _, r in events + stops} - {culprit_rank} | set(cascade.blocked))
    message = (
        f"rank {culprit_rank} failed first, {where(culprit)}, with "
        f"{culprit.error.type}: {first_line(culprit.error.message)}; the first failure was a "
        "lost connection and no rank reported another error"
    )
    if waiting:
        message += f"; {format_ranks(waiting)} failed after it"
    hint = (
        "a process died without reporting (kill -9, the OOM killer, a segfault) or the network "
        "between hosts failed: check dmesg and the launcher's log on every host"
    )
    return [alert("crashed", "error", [culprit_rank], waiting, message, hint)]


@rule("crashed", "exited", "silent")
def rule_cascade(f: Facts) -> list[Alert]:
    """Name the ranks that failed first; list everything that failed because of them."""
    now, th = f.now, f.th
    cascade = f.cascade
    if not cascade.roots:
        return _no_root_alerts(cascade, now, th)
    victims = {r.rank for r in cascade.symptoms} | {r.rank for r in cascade.stopped}
    victims |= set(cascade.blocked)
    victims -= {rank for root in cascade.roots for rank in root.ranks}
    first, *others = cascade.roots
    return [_root_alert(first, sorted(victims), now)] + [
        _root_alert(root, [], now) for root in others
    ]


@rule("exited")
def rule_clean_exit(f: Facts) -> list[Alert]:
    """A rank that finished while others still train: they hang in their next collective."""
    now = f.now
    exited = [
        r for r in f.records if r.exit_time is not None and r.error is None and is_clean_exit(r)
    ]
    live = f.live
    if not exited or not live:
        return []
    limit = f.collective_limit
    stuck = [r for r in live if (r.collective_age(now) or 0.0) > limit]
    if not stuck and now - min(r.exit_time or now for r in exited) <= f.stall_after:
        return []  # ranks finishing apart at the end of a healthy run (rank 0 saving last)
    ranks = sorted(r.rank for r in exited)
    steps = sorted({r.step for r in exited if r.step is not None})
    at = (
        "before its first step"
        if not steps
        else f"at step {steps[0]}"
        if len(steps) == 1
        else f"at steps {steps[0]}-{steps[-1]}"
    )
    others = format_ranks(r.rank for r in live)
    message = (
        f"{format_ranks(ranks)} exited {at} while {others} still "
        f"{verb(len(live), 'runs', 'run')}; {verb(len(live), 'it', 'they')} will hang in "
        f"{verb(len(live), 'its', 'their')} next collective"
    )
    if stuck:
        worst = max(stuck, key=lambda r: r.collective_age(now) or 0.0)
        assert worst.collective is not None
        name = collective_name(worst.collective.op, worst.collective.seq)
        message += (
            f"; {format_ranks(r.rank for r in stuck)} "
            f"{verb(len(stuck), 'has', 'have')} waited in {name} for "
            f"{seconds(worst.collective_age(now) or 0.0)}"
        )
    hint = (
        "the ranks ran different numbers of steps: give every rank the same number of "
        "batches (DistributedSampler with drop_last=True, or the DDP join() context manager)"
    )
    severity: Severity = "error" if stuck else "warning"
    return [alert("exited", severity, ranks, [r.rank for r in stuck], message, hint)]
