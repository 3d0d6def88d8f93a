"""Collectives: the rank the others wait for (straggler), every rank stuck in one collective
(stalled), and ranks calling different collectives or sizes (collective_mismatch)."""

from __future__ import annotations

from collections import Counter, defaultdict

from ddpwatch.server.alerts import Alert, Severity
from ddpwatch.server.rules.facts import Facts, Straggle, normal_op, world_complete
from ddpwatch.server.rules.registry import alert, rule
from ddpwatch.server.rules.text import (
    collective_name,
    duration,
    first_line,
    format_ranks,
    in_data_loading,
    seconds,
    verb,
    where,
)
from ddpwatch.server.state import RankRecord


@rule("straggler", "stalled")
def rule_straggler(f: Facts) -> list[Alert]:
    """Ranks wait in a collective that a live rank has not entered: name that rank."""
    found = f.straggle
    if found is None or f.cascade.roots:
        return []
    if not found.culprits:
        return _all_waiting(f, found)
    culprits = sorted(found.culprits, key=lambda r: r.rank)
    waiting = sorted(r.rank for r in found.waiting)
    name = collective_name(found.op, found.seq)
    first = culprits[0]
    subject = "it is" if len(culprits) == 1 else f"rank {first.rank} is"
    detail = f"{subject} {where(first)}"
    if first.collective is not None:
        detail += f", inside {collective_name(first.collective.op, first.collective.seq)}"
    loading = in_data_loading(first.stack)
    if loading:
        detail += ", waiting for its DataLoader"
    message = (
        f"{format_ranks(r.rank for r in culprits)} "
        f"{verb(len(culprits), 'has', 'have')} not entered {name} that "
        f"{format_ranks(waiting)} {verb(len(waiting), 'has', 'have')} waited in for "
        f"{seconds(found.age)}; {detail}"
    )
    if found.timeout_left is not None:
        message += (
            f"; {format_ranks(waiting)} will time out in {duration(found.timeout_left)}"
            if found.timeout_left > 0
            else f"; the process group's timeout has passed by {duration(-found.timeout_left)}"
        )
    if loading:
        hint = (
            f"data loading: rank {first.rank}'s main thread waits for a DataLoader worker; a "
            "worker that hangs (a deadlock, a network read, a lock taken before fork) keeps it "
            "there: run with num_workers=0 to see where, and give DataLoader a timeout="
        )
    else:
        hint = (
            f"see where rank {first.rank} is (its stack in ddpwatch status --json): a "
            "rank-dependent branch, slow data loading or I/O, or a collective that not every "
            f"rank calls keeps it from {name}"
        )
    if found.timeout_left is not None and not loading:
        hint += (
            "; if that rank's work is legitimate (saving, evaluating on one rank), raise "
            "timeout= in init_process_group or let the other ranks do it too"
        )
    severity: Severity = "error" if found.age >= f.stall_after else "warning"
    return [alert("straggler", severity, [r.rank for r in culprits], waiting, message, hint)]


def _all_waiting(facts: Facts, found: Straggle) -> list[Alert]:
    """Every rank is inside the same collective and it does not finish."""
    live = facts.live
    if len(found.waiting) != len(live) or not world_complete(facts.state, live):
        return []
    if len({normal_op(r.collective.op) for r in live if r.collective}) > 1:
        return []  # different collectives at one sequence number: collective_mismatch
    age = min(r.collective_age(facts.now) or 0.0 for r in live)  # all have waited this long
    if age <= facts.stall_after:
        return []
    ranks = sorted(r.rank for r in live)
    name = collective_name(found.op, found.seq)
    message = (
        f"all {len(ranks)} ranks have waited in {name} for {seconds(age)} and none is "
        "missing from it"
    )
    hint = (
        "the collective itself does not complete: check the network (NCCL_DEBUG=INFO), "
        "NCCL_SOCKET_IFNAME / InfiniBand settings, and whether its process group includes "
        "a process that ddpwatch does not see"
    )
    return [alert("stalled", "error", ranks, [], message, hint)]


@rule("collective_mismatch")
def rule_collective_mismatch(f: Facts) -> list[Alert]:
    """Ranks in different collectives at the same sequence number, or a mismatch crash."""
    now = f.now
    alerts = _mismatch_from_crashes(f)
    by_seq: dict[int, dict[str, list[RankRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in f.live:
        c = r.collective
        if c is not None and c.seq is not None:
            by_seq[c.seq][normal_op(c.op)].append(r)
    for seq in sorted(by_seq):
        ops = by_seq[seq]
        if len(ops) < 2:
            continue
        members = [r for group in ops.values() for r in group]
        if max(r.collective_age(now) or 0.0 for r in members) < 1.0:
            continue
        alerts.append(_mismatch_alert(seq, ops))
        break  # the first divergence; later ones follow from it
    return alerts


def _mismatch_alert(seq: int, ops: dict[str, list[RankRecord]]) -> Alert:
    ranked = sorted(ops.values(), key=lambda group: (-len(group), min(r.rank for r in group)))
    majority = ranked[0]
    if len(ranked[0]) == len(ranked[1]):
        culprits = sorted(r.rank for group in ranked for r in group)
        waiting: list[int] = []
    else:
        culprits = sorted(r.rank for group in ranked[1:] for r in group)
        waiting = sorted(r.rank for r in majority)
    parts = [f"{format_ranks(r.rank for r in group)} called {_op_of(group)}" for group in ranked]
    odd = ", ".join(parts[1:4]) + (f" and {len(parts) - 4} more" if len(parts) > 4 else "")
    message = f"at collective #{seq} {odd} while {parts[0]}"
    hint = (
        "every rank must call the same collectives in the same order: look for a dist.* call "
        "that only some ranks make (under `if rank == 0`, in logging or metrics code)"
    )
    return alert("collective_mismatch", "error", culprits, waiting, message, hint)


def _op_of(group: list[RankRecord]) -> str:
    return Counter(r.collective.op for r in group if r.collective).most_common(1)[0][0]


def _mismatch_from_crashes(facts: Facts) -> list[Alert]:
    crashed = facts.crashes_of_kind("collective_mismatch")
    if not crashed:
        return []
    first = crashed[0]
    assert first.error is not None
    ranks = [r.rank for r in crashed]
    message = (
        f"{format_ranks(ranks)} failed with {first.error.type}: "
        f"{first_line(first.error.message)} — the ranks called different collectives, or "
        "the same one with different sizes"
    )
    signature = facts.signatures.get(first.rank)
    hint = signature.hint if signature else ""
    return [alert("collective_mismatch", "error", ranks, [], message, hint)]
