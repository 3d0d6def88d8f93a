"""Root cause over cascade: the rank that failed, exited or went silent first, and the
ranks that failed or wait because of it (listed as ``waiting``, never as culprits)."""

from __future__ import annotations

from ddpwatch.core.vocabulary import AlertKind, Severity
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.cascade import Cascade, Root
from ddpwatch.diagnosis.facts.mismatch import call_text
from ddpwatch.diagnosis.facts.ranks import (
    is_clean_exit,
    is_p2p,
    is_term_exit,
    normal_op,
    phase_at,
)
from ddpwatch.diagnosis.facts.stragglers import p2p_name
from ddpwatch.diagnosis.knowledge import fitted_hint
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.diagnosis.text import (
    collective_name,
    first_line,
    format_ranks,
    ordinal_advice,
    verb,
    where,
)
from ddpwatch.state.host_memory import oom_note
from ddpwatch.state.records import RankRecord
from ddpwatch.status.fmt import STACKS_IN, seconds


def _root_alert(root: Root, cascade: Cascade | None, now: float, stepping: bool = False) -> Alert:
    """The alert for one root: what failed first, why, what followed, and what to do."""
    ranks = sorted(root.ranks)
    first = min(root.records, key=lambda r: (r.error_time or r.exit_time or r.last_seen, r.rank))
    who = format_ranks(ranks)
    waiting, after = _consequences(cascade, ranks)
    if root.named:  # the ranks that raised the error only reported it
        waiting = sorted(set(waiting) | {r.rank for r in root.records})
    if root.kind == AlertKind.SILENT:
        return _silent_alert(root, ranks, waiting, after, now, stepping)
    if root.kind == AlertKind.STRAGGLER and any(_in_p2p(r) for r in root.timed_out):
        return _held_by_peer_alert(root, waiting, AlertKind.STRAGGLER)
    if root.kind == AlertKind.STRAGGLER:
        return _held_alert(root, cascade, waiting, now)
    if root.kind == AlertKind.SEND_RECV_DEADLOCK:
        return _held_by_peer_alert(root, waiting, AlertKind.SEND_RECV_DEADLOCK)
    if root.kind == AlertKind.EXITED:
        return _exit_alert(first, ranks, waiting, after)
    assert first.error is not None
    signature = root.signature
    error = f"{first.error.type}: {first_line(first.error.message)}".rstrip(": ")
    if root.named:
        reporters = format_ranks(r.rank for r in root.records)
        message = f"{reporters} failed with {error}, naming {who}"
    else:
        message = f"{who} crashed {where(first)} with {error}"
    # (cause, fix): a device index that did not exist is explained from what the rank saw
    known = (
        ordinal_advice(first) if signature and signature.kind == AlertKind.DEVICE_ORDINAL else None
    )
    if known is None and signature is not None:
        known = (signature.cause, fitted_hint(signature, first.rendezvous))
    if known is not None:
        message += f" — {known[0]}"
    message += after
    hint = (
        known[1]
        if known is not None
        else f"read the traceback of {format_ranks(ranks[:1])} ({STACKS_IN} shows "
        "it); the other ranks only failed because it died"
    )
    return alert(AlertKind.CRASHED, Severity.ERROR, ranks, waiting, message, hint)


def _consequences(cascade: Cascade | None, roots: list[int]) -> tuple[list[int], str]:
    """The ranks that failed, were stopped or wait because of the first root, and a clause
    saying which did what: "; ranks 0, 2 failed because of it; rank 3 was stopped"."""
    if cascade is None:
        return [], ""
    skip = set(roots)
    failed = sorted({r.rank for r in cascade.symptoms} - skip)
    stopped = sorted({r.rank for r in cascade.stopped} - skip - set(failed))
    blocked = sorted(set(cascade.blocked) - skip)
    parts = []
    if failed:
        parts.append(f"{format_ranks(failed)} failed because of it")
    if stopped:
        parts.append(
            f"{format_ranks(stopped)} {verb(len(stopped), 'was', 'were')} stopped by the "
            "launcher after it"
        )
    if blocked:
        parts.append(f"{format_ranks(blocked)} {verb(len(blocked), 'waits', 'wait')} for it")
    return failed + stopped + blocked, "".join(f"; {part}" for part in parts)


def _held_alert(root: Root, cascade: Cascade | None, waiting: list[int], now: float) -> Alert:
    """Ranks whose collective timed out waiting for ``root``'s: the blame stays where the
    straggler alert had it, with the timeout as its consequence (the same alert, so its
    episode goes on), also once the launcher has stopped everyone."""
    ranks = sorted(root.ranks)
    first = root.records[0]
    victims = sorted(r.rank for r in root.timed_out)
    place = root.timed_out[0].final_collective
    name = collective_name(place.op, place.seq) if place is not None else "a collective"
    limits = {r.pg_timeout_s for r in root.timed_out}
    limit = limits.pop() if len(limits) == 1 else None
    after = f" after {seconds(limit)}" if limit else ""
    # where it was when they gave up, not where it went after (seen under load: it had left
    # its checkpoint for the next batch before it failed, and the verdict said "in 'data'")
    phase = phase_at(first, root.time)
    detail = f"in '{phase}' {where(first, phase=False)}" if phase else where(first)
    if first.exit_time is not None:
        detail += "; it was stopped after them" if is_term_exit(first) else "; it ended after them"
    message = (
        f"{format_ranks(victims)} timed out{after} in {name} waiting for "
        f"{format_ranks(ranks)}, which had not entered it: {detail}"
    )
    others = sorted(set(waiting) - set(victims))
    if others and cascade is not None:
        message += f"; {format_ranks(others)} failed or {verb(len(others), 'was', 'were')} stopped"
    hint = (
        f"the timeout is the consequence: see what {format_ranks(ranks[:1])} was doing (its "
        f"stack in {STACKS_IN}); if that work is legitimate (saving, evaluating, downloading on "
        "one rank), raise timeout= in init_process_group or let every rank wait outside a "
        "collective (or do the work on every rank)"
    )
    return alert(
        AlertKind.STRAGGLER,
        Severity.ERROR,
        ranks,
        sorted(set(waiting) | set(victims)),
        message,
        hint,
        waited_s=limit,
        phase=phase,
    )


def _in_p2p(record: RankRecord) -> bool:
    c = record.final_collective
    return c is not None and is_p2p(c)


def _held_by_peer_alert(root: Root, waiting: list[int], kind: str) -> Alert:
    """Ranks that timed out in a send or receive (and in the collective its peer waited in)
    waiting for ``root``'s rank: the blame stays where the live alert had it."""
    (peer,) = root.records
    blocked = sorted((r for r in root.timed_out if _in_p2p(r)), key=lambda r: r.rank)
    others = sorted(r.rank for r in root.timed_out if not _in_p2p(r))
    limits = {r.pg_timeout_s for r in root.timed_out}
    limit = limits.pop() if len(limits) == 1 else None
    after = f" after {seconds(limit)}" if limit else ""
    calls = ", ".join(
        f"rank {r.rank} in {p2p_name(r.final_collective)}"
        for r in blocked
        if r.final_collective is not None
    )
    missing = " and a ".join(
        sorted(
            {
                "recv" if normal_op(r.final_collective.op) in ("send", "isend") else "send"
                for r in blocked
                if r.final_collective is not None
            }
        )
    )
    c = peer.final_collective if peer.error is not None else peer.collective
    phase = phase_at(peer, root.time)
    if kind == AlertKind.SEND_RECV_DEADLOCK:
        there = (
            f"it was in {collective_name(c.op, c.seq)}"
            if c is not None
            else f"it went on to a collective, {where(peer)}"
        )
        if others:
            there += f", where {format_ranks(others)} timed out too"
    else:
        there = f"it was in '{phase}' {where(peer, phase=False)}" if phase else where(peer)
    message = f"{calls} timed out{after}: a {missing} rank {peer.rank} did not make; {there}"
    hint = (
        f"the timeouts are the consequence: see why rank {peer.rank} went on without its "
        f"{missing.replace(' and a ', ' and ')} (its stack in {STACKS_IN}): a rank-dependent "
        "branch or a skipped micro-batch; every send needs its receive on the peer, with the "
        "same tag"
    )
    return alert(
        kind,
        Severity.ERROR,
        [peer.rank],
        sorted(set(waiting) | {r.rank for r in root.timed_out}),
        message,
        hint,
        waited_s=limit,
        phase=phase,
    )


def _exit_alert(first: RankRecord, ranks: list[int], waiting: list[int], after: str) -> Alert:
    """A rank that ended without an exception while the others still needed it."""
    who = format_ranks(ranks)
    if first.exit_signal and first.exit_signal not in ("SIGTERM", "SIGINT"):
        how = f"was killed by {first.exit_signal}"
    elif first.exit_code not in (0, None):
        how = f"exited with code {first.exit_code}"
    else:
        how = "exited normally (code 0)"
    inside = first.final_collective if first.exit_signal == "SIGABRT" else None
    if inside is not None:  # its black box: the collective it died in
        text = call_text(inside, reduce_op=inside.reduce_op not in (None, "sum"))
        number = f", collective #{inside.seq}," if inside.seq is not None else ""
        how += f" inside {text}{number}"
    message = f"{who} {how} {where(first)}, without an exception, while the others still trained"
    message += after
    if inside is not None:
        hint = (
            "the backend aborted the process from C++ inside that collective (gloo does when "
            "a peer's data has another size: a peer made another call, with another tensor, "
            "or another collective at that point); its last output says why ('Received data "
            "size doesn't match expected size'), its stack in the detail pane shows the call: "
            "make every rank call the same collectives in the same order with the same shapes "
            "and dtypes"
        )
    elif first.exit_signal and first.exit_signal not in ("SIGTERM", "SIGINT"):
        hint = (
            f"something killed the process ({first.exit_signal}): the OOM killer (dmesg), a "
            "segfault in native code, or the scheduler; its own log shows the last lines"
        )
    else:
        hint = (
            "the rank left the training loop on its own: sys.exit, os._exit or a return after a "
            "rank-local decision (early stopping, a caught exception, fewer batches): make every "
            "rank decide together (all_reduce a stop flag) and give every rank the same number "
            "of batches"
        )
    return alert(AlertKind.EXITED, Severity.ERROR, ranks, waiting, message, hint)


def _silent_alert(
    root: Root, ranks: list[int], waiting: list[int], after: str, now: float, stepping: bool
) -> Alert:
    who = format_ranks(ranks)
    first = min(root.records, key=lambda r: (r.last_seen, r.rank))
    quiet = now - first.last_seen
    n = len(ranks)
    message = (
        f"{who} {verb(n, 'has', 'have')} sent no heartbeat for {seconds(quiet)}, last "
        f"{where(first, stepping)}; {verb(n, 'it was', 'they were')} probably killed (kill -9, "
        f"the OOM killer) or {verb(n, 'is', 'are')} stuck in native code holding the GIL"
    )
    message += oom_note(first)  # memory near a limit or growing: "likely the OOM killer"
    message += after
    on_host = f" on host {first.host}" if first.host else ""
    pid = f"py-spy dump --pid {first.pid}" if first.pid else "py-spy dump --pid PID"
    hint = (
        f"check the launcher's log and dmesg (OOM killer){on_host}; if the process still runs, "
        f"{pid} shows where it hangs"
    )
    return alert(AlertKind.SILENT, Severity.ERROR, ranks, waiting, message, hint)


def _no_root_alerts(cascade: Cascade, now: float, th: Thresholds) -> list[Alert]:
    """Peer failures or SIGTERMs with no rank to blame.

    Within th.silent of the first one the real culprit is probably about to show up
    as silent, so say nothing. After that, say what happened but name no culprit: a
    rank whose own error only says that a peer went away is a victim, whatever the
    order in which the reports arrived.
    """
    events = [(r.error_time or r.last_seen, r.rank, r) for r in cascade.symptoms]
    stops = [(r.exit_time or r.last_seen, r.rank, r) for r in cascade.stopped]
    if (not events and not stops) or cascade.mismatched or cascade.missing or cascade.held:
        return []  # nothing failed, a mismatch or a missing rank (their rules tell it), or
        # silent ranks not yet told apart (one of them is the culprit)
    if now - min(t for t, _, _ in events + stops) <= th.silent:
        return []
    affected = sorted({r.rank for _, _, r in events + stops} | set(cascade.blocked))
    if not events:
        stopped = sorted(r.rank for _, _, r in stops)
        signals = sorted({r.exit_signal or f"exit code {r.exit_code}" for _, _, r in stops})
        message = (
            f"{format_ranks(stopped)} {verb(len(stopped), 'was', 'were')} stopped by "
            f"{', '.join(signals)} and no rank reported a failure before"
        )
        hint = (
            "something outside the job stopped it: the launcher (its log names the first "
            "failure), the scheduler (time limit, preemption) or Ctrl-C"
        )
        return [alert(AlertKind.EXITED, Severity.WARNING, [], affected, message, hint)]
    failed = sorted(r.rank for _, _, r in events)
    _, _, example = min(events, key=lambda e: (e[0], e[1]))
    assert example.error is not None
    message = (
        f"{format_ranks(failed)} lost the connection to a peer "
        f"({example.error.type}: {first_line(example.error.message, 120)}) and no rank reported "
        "a failure of its own: a process ddpwatch does not see died, or the network failed"
    )
    hint = (
        "a process died without reporting (kill -9, the OOM killer, a segfault) or the network "
        "between hosts failed: check dmesg and the launcher's log on every host"
    )
    return [alert(AlertKind.CRASHED, Severity.ERROR, [], affected, message, hint)]


def _together_alert(records: list[RankRecord], now: float) -> Alert:
    """Every rank went quiet within a heartbeat or two, none reporting a failure or exit."""
    ranks = sorted(r.rank for r in records)
    last = max(records, key=lambda r: r.last_seen)
    steps = sorted({r.step for r in records if r.step is not None})
    at = f" at step {steps[-1]}" if steps else ""
    message = (
        f"all {len(ranks)} ranks stopped reporting {seconds(now - last.last_seen)} ago, within "
        f"a heartbeat of each other{at}, and none reported an exit or a failure"
    )
    hint = (
        "nothing tells one rank from another: the job was killed as a whole (the scheduler, "
        "kill -9, a node going down) or the network between the job and ddpwatch failed; "
        "check the launcher's log"
    )
    return alert(AlertKind.SILENT, Severity.WARNING, [], ranks, message, hint)


@rule(
    AlertKind.CRASHED,
    AlertKind.EXITED,
    AlertKind.SILENT,
    AlertKind.STRAGGLER,
    AlertKind.SEND_RECV_DEADLOCK,
)
def rule_cascade(f: Facts) -> list[Alert]:
    """Name the ranks that failed first; list everything that failed because of them."""
    now, th = f.now, f.th
    cascade = f.cascade
    if cascade.together:
        return [_together_alert(cascade.together, now)]
    if not cascade.roots:
        return _no_root_alerts(cascade, now, th)
    first, *others = cascade.roots
    stepping = f.stepping
    return [_root_alert(first, cascade, now, stepping)] + [
        _root_alert(root, None, now, stepping) for root in others
    ]


@rule(AlertKind.EXITED)
def rule_clean_exit(f: Facts) -> list[Alert]:
    """A rank that finished while others still train: they hang in their next collective."""
    now = f.now
    exited = [  # the finished ranks only (the census has them): not a pass over every rank
        r
        for r in f.census.finished
        if r.exit_time is not None and r.error is None and is_clean_exit(r)
    ]
    live = f.live
    if not exited or not live or f.cascade.roots:
        return []  # with a cascade, the first root's alert tells the story
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
    severity = Severity.ERROR if stuck else Severity.WARNING
    return [alert(AlertKind.EXITED, severity, ranks, [r.rank for r in stuck], message, hint)]
