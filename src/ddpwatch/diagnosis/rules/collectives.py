"""Collectives: the rank the others wait for (straggler), every rank stuck in one collective
(stalled), and ranks calling different collectives or sizes (collective_mismatch)."""

from __future__ import annotations

from collections import Counter

from ddpwatch.core.protocol import CallSeen
from ddpwatch.core.vocabulary import AlertKind, CollectiveSource, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.census import world_complete
from ddpwatch.diagnosis.facts.mismatch import Mismatch, OddCalls, call_words
from ddpwatch.diagnosis.facts.ranks import is_busy, is_compiling, normal_op, working_start
from ddpwatch.diagnosis.facts.stragglers import Straggle
from ddpwatch.diagnosis.knowledge import named_ranks
from ddpwatch.diagnosis.rules.registry import alert, odd_alert, rule
from ddpwatch.diagnosis.text import (
    collective_name,
    first_line,
    format_ranks,
    format_sorted_ranks,
    in_data_loading,
    verb,
    where,
)
from ddpwatch.state.records import RankRecord
from ddpwatch.status.fmt import STACKS_IN, seconds, wait


@rule(AlertKind.STRAGGLER, AlertKind.STALLED)
def rule_straggler(f: Facts) -> list[Alert]:
    """Ranks wait in a collective that a live rank has not entered: name that rank; never one
    still working through its start-up (``working_start``): slow, not hung, which
    ``startup_hang`` tells as a note (#32: a rank still in 'deepspeed_init' on a loaded
    machine while the others wait in backward's all-reduce)."""
    found = f.straggle
    if found is None or found.deadlock is not None or f.cascade.roots:
        return []  # a deadlock through a send or receive: ``rule_p2p`` says it
    if not found.culprits:
        return _all_waiting(f, found)
    culprits = [r for r in found.culprits if not working_start(r, f.now)]
    if not culprits:
        return []
    waiting = found.waiting_ranks()
    name = collective_name(found.op, found.seq)
    first = culprits[0]
    subject = "it is" if len(culprits) == 1 and not found.via else f"rank {first.rank} is"
    compiling = first.collective is None and is_compiling(first)
    loading = in_data_loading(first.stack)
    detail = _culprit_detail(f, first, subject, compiling, loading)
    waiters = format_sorted_ranks(waiting)  # once, and not sorted again: 131,072 at scale
    chain = "".join(
        f"; {format_ranks(hop.ranks)} {verb(len(hop.ranks), 'waits', 'wait')} in {hop.name}"
        + ("" if hop.p2p else f" for {format_ranks(hop.blockers)}")
        for hop in found.via
    )  # the victims in other groups' collectives or in a send or receive, on the way
    message = (
        f"{format_ranks(r.rank for r in culprits)} "
        f"{verb(len(culprits), 'has', 'have')} not entered {name} that "
        f"{waiters} {verb(len(waiting), 'has', 'have')} waited in for "
        f"{seconds(found.age)}{chain}; {detail}"
    )
    if found.timeout_left is not None:
        message += (
            f"; {waiters} will time out in {wait(found.timeout_left)}"
            if found.timeout_left > 0
            else f"; the process group's timeout has passed by {wait(-found.timeout_left)}"
        )
    hint = _straggler_hint(first.rank, name, compiling, loading, found.timeout_left is not None)
    severity = Severity.ERROR if found.age >= f.stall_after else Severity.WARNING
    return [
        alert(
            AlertKind.STRAGGLER,
            severity,
            [r.rank for r in culprits],
            sorted({*waiting, *(rank for hop in found.via for rank in hop.ranks)})
            if found.via
            else waiting,
            message,
            hint,
            waited_s=found.age,
            phase=first.phase,
            waiting_sorted=True,  # the group's sorted list, or a sorted set
        )
    ]


def _culprit_detail(
    f: Facts, first: RankRecord, subject: str, compiling: bool, loading: bool
) -> str:
    """Where the first culprit is and what it does: "it is in 'forward' at step 311,
    train.py:88", then inside which collective, busy, compiling or waiting for data."""
    if compiling:  # its phase, said in full
        detail = f"{subject} {_compiling(first)} {where(first, phase=False)}"
    else:
        detail = f"{subject} {where(first)}"
    if first.collective is not None:
        detail += f", inside {collective_name(first.collective.op, first.collective.seq)}"
    elif not compiling and is_busy(first, f.now, f.th):
        detail += ", busy: its stack moves (working, not stuck)"
    if loading:
        detail += ", waiting for its DataLoader"
    return detail


def _straggler_hint(rank: int, name: str, compiling: bool, loading: bool, timed: bool) -> str:
    """What to do about the culprit; ``timed``: the waiters' process-group timeout is known."""
    if compiling:
        return _compile_hint(rank, name)
    if loading:
        return (
            f"data loading: rank {rank}'s main thread waits for a DataLoader worker; a "
            "worker that hangs (a deadlock, a network read, a lock taken before fork) keeps it "
            "there: run with num_workers=0 to see where, and give DataLoader a timeout="
        )
    hint = (
        f"see where rank {rank} is (its stack in {STACKS_IN}): a "
        "rank-dependent branch, slow data loading or I/O, or a collective that not every "
        f"rank calls keeps it from {name}"
    )
    if timed:
        hint += (
            "; if that rank's work is legitimate (saving, evaluating on one rank), raise "
            "timeout= in init_process_group or let the other ranks do it too"
        )
    return hint


def _compiling(record: RankRecord) -> str:
    """What a rank inside torch.compile is doing, and why where torch said (a guard that
    failed: this rank compiles again where the others run what they compiled)."""
    reason = record.compile_reason
    if reason:
        return f"compiling (torch.compile recompiles: {first_line(reason)})"
    return "compiling (torch.compile)"


def _compile_hint(rank: int, name: str) -> str:
    return (
        f"rank {rank} is inside torch.compile while the others wait in {name}: a recompile on "
        "one rank (a guard failed: a shape, a dtype or a Python value that differs by rank; "
        "TORCH_LOGS=recompiles says which) or a compile cache the others hit and it missed; "
        "pad inputs to one shape or mark the dimension dynamic (torch._dynamo.mark_dynamic), "
        "and warm the cache (TORCHINDUCTOR_CACHE_DIR on a shared disk)"
    )


def _all_waiting(facts: Facts, found: Straggle) -> list[Alert]:
    """Every rank is inside the same collective and it does not finish."""
    live = facts.live
    if len(found.waiting) != len(live) or not world_complete(facts.state, live):
        return []
    if len({normal_op(op) for op in found.ops()}) > 1:
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
    return [alert(AlertKind.STALLED, Severity.ERROR, ranks, [], message, hint)]


@rule(AlertKind.COLLECTIVE_MISMATCH)
def rule_collective_mismatch(f: Facts) -> list[Alert]:
    """Ranks that made different calls at the same collective number: another op, or the same
    op with another size or dtype (live, or from what the ranks died in); else a mismatch
    error the knowledge base recognises, naming only what the evidence names."""
    found = f.mismatch
    if found is not None:
        return [_mismatch_alert(f, found)]
    return _mismatch_from_crashes(f)


@rule(AlertKind.COLLECTIVE_MISMATCH, every="slow")
def rule_evaluation_desync(f: Facts) -> list[Alert]:
    """A rank that evaluated through its DDP model while the others did not (or more often):
    DDP broadcasts the model's buffers from rank 0 before every forward, under ``no_grad``
    too (pytorch/pytorch#175024), so each such forward is a collective the other ranks did
    not make. gloo may let rank 0's broadcasts complete and the job run on, every later
    collective paired one off; or the job hangs, which the mismatch in flight tells. Every
    rank marks (every 8th step) its evaluation forwards through a buffer-broadcasting DDP
    model; one whose count differs from a strict majority's is named."""
    if f.mismatch is not None:
        return []  # in flight, the mismatch says more
    found = f.odd_at_mark("evals_marked")
    if found is None:
        return []
    odd, diff = found.odd, found.diff
    forwards = f"{abs(diff)} {verb(abs(diff), 'evaluation forward', 'evaluation forwards')}"
    message = (
        f"{format_ranks(r.rank for r in odd)} had run {forwards} through "
        f"{verb(len(odd), 'its', 'their')} DDP model {'more' if diff > 0 else 'fewer'} than "
        f"{format_ranks(r.rank for r in found.majority)} by step {found.step} ({found.own} "
        f"against {found.usual}): each broadcasts the model's buffers (BatchNorm's running "
        "statistics) from rank 0, a collective the others did not make, so the ranks' "
        "collectives no longer pair up"
    )
    hint = (
        f"rank {odd[0].rank} evaluates through the DDP wrapper alone: evaluate through the "
        "wrapped module (model.module) on one rank, or through the wrapper on every rank, or "
        "build DDP with broadcast_buffers=False (SyncBatchNorm keeps the statistics in step)"
    )
    return [odd_alert(AlertKind.COLLECTIVE_MISMATCH, found, message, hint)]


@rule(AlertKind.COLLECTIVE_MISMATCH, every="slow")
def rule_collective_desync(f: Facts) -> list[Alert]:
    """Ranks that entered a different number of collectives by the end of the same step,
    when no mismatch shows otherwise (``rule_collective_mismatch``).

    Every rank marks the same steps (every 8th) with how many Python-level collectives it
    had entered; in a lockstep job they agree. A rank that differs at the latest step all
    live ranks have marked calls a collective the others do not (or skips one): the job is
    out of step before anything fails. Named only against a strict majority.
    """
    if f.mismatch is not None or _mismatch_from_crashes(f):
        return []  # the mismatch says more
    found = f.odd_at_mark("step_marks")
    if found is None:
        return []
    odd, diff = found.odd, found.diff
    more = (
        f"{abs(diff)} {'more' if diff > 0 else 'fewer'} "
        f"{verb(abs(diff), 'collective', 'collectives')}"
    )
    message = (
        f"{format_ranks(r.rank for r in odd)} had entered {more} than "
        f"{format_ranks(r.rank for r in found.majority)} by the end of step {found.step} "
        f"({found.own} against {found.usual}): the ranks no longer call the same "
        "collective at the same number, so the next ones pair up wrongly or hang"
    )
    hint = (
        "a collective that only some ranks call (under `if rank == 0`, in logging, metrics or "
        "evaluation), or one skipped after a caught exception: every rank must call the same "
        f"collectives in the same order; look at what rank {odd[0].rank} does differently"
    )
    return [odd_alert(AlertKind.COLLECTIVE_MISMATCH, found, message, hint)]


@rule(AlertKind.COLLECTIVE_MISMATCH, every="slow")
def rule_collective_arguments(f: Facts) -> list[Alert]:
    """Ranks that called as many collectives as the others between two marks, but with other
    arguments: another root (src/dst), reduce op, dtype or size, when nothing else shows it.

    The backend may run on: gloo completes an all_reduce whose reduce op differs on one rank
    (mixed values, measured on torch 2.13), NCCL a reduce whose ``dst`` differs
    (pytorch/pytorch#39706) or an all_reduce whose dtype differs, with wrong values
    (pytorch/pytorch#150248); no rank ever blocks, so no collective in flight shows it.
    Every rank digests its Python-level calls between two marks (``collectives.digests``); a
    rank whose digest differs from a strict majority's, with the same count, is named. Counts
    that differ are ``rule_collective_desync``'s, a mismatch in flight
    ``rule_collective_mismatch``'s.
    """
    if f.mismatch is not None or _mismatch_from_crashes(f):
        return []  # the mismatch says more
    found = f.odd_calls
    if found is None or f.odd_at_mark("step_marks") is not None:
        return []
    odd, majority = found.odd, found.majority
    odd_text = format_ranks(r.rank for r in odd)
    usual_text = format_ranks(r.rank for r in majority)
    span = (
        f"between steps {found.since} and {found.step}"
        if found.since is not None
        else f"up to step {found.step}"
    )
    message = f"{odd_text}'s collectives {span} differ from {usual_text}'s"
    message += _how_calls_differ(found, usual_text)
    message += (
        ", with as many calls: the backend ran on with no error, so the ranks' data no longer "
        "pairs up as the script means"
    )
    first = odd[0].rank
    hint = (
        "every rank must call each collective with the same root (src/dst), reduce op, dtype "
        "and size: look for a src or dst computed from the rank (src=rank, a rank-local "
        "variable), a dtype that depends on the rank's data (torch.tensor() of Python or "
        f"NumPy numbers: give it dtype=), or a size that does; see what rank {first} passes"
    )
    return [
        alert(
            AlertKind.COLLECTIVE_MISMATCH,
            Severity.ERROR,
            [r.rank for r in odd],
            [r.rank for r in majority],
            message,
            hint,
        )
    ]


def _how_calls_differ(found: OddCalls, usual_text: str) -> str:
    """ ": rank 2 called broadcast src=1 with 4 elements (float32) at collective #17 where
    ranks 0, 1 called broadcast src=0 with 4 elements (float32)", or nothing when no window
    tells."""
    theirs, usual = found.theirs, found.usual
    if theirs is None:
        return ""
    ops = usual is None or usual.reduce_op != theirs.reduce_op  # the default's "sum" only then
    text = (
        f": rank {found.odd[0].rank} called {_seen_words(theirs, ops)} at collective #{theirs.seq}"
    )
    if usual is None:
        return text + f", a call {usual_text} made nowhere in that window"
    return text + f" where {usual_text} called {_seen_words(usual, ops)}"


def _seen_words(call: CallSeen, reduce_op: bool) -> str:
    return call_words(
        call.op, call.numel, call.dtype, call.reduce_op if reduce_op else None, call.root
    )


def _mismatch_alert(f: Facts, found: Mismatch) -> Alert:
    source, group, seq = found.key
    (usual, majority), *odd = found.calls
    number = f"collective #{seq}"
    if source == CollectiveSource.FR and group != "0":
        number += f" of process group {group}"
    if found.culprits:
        odd_text = "; ".join(
            f"{format_ranks(r.rank for r in group)} called {text}" for text, group in odd[:3]
        )
        message = (
            f"{odd_text} at {number} where {format_ranks(r.rank for r in majority)} called {usual}"
        )
    else:
        calls = "; ".join(
            f"{format_ranks(r.rank for r in group)} called {text}"
            for text, group in found.calls[:4]
        )
        message = f"the ranks made different calls at {number}: {calls}"
        called = {r.rank for _, group in found.calls for r in group}
        unknown = sorted(r.rank for r in f.records if r.rank not in called)
        if unknown:
            message += (
                f"; {format_ranks(unknown)}'s {verb(len(unknown), 'call is', 'calls are')} "
                "not known, so which side is odd cannot be told"
            )
    culprits = {r.rank for r in found.culprits}
    affected = {r.rank for r in found.others} | _dead_or_blocked(f)
    failed = sorted(r.rank for r in f.records if r.error is not None and r.rank not in culprits)
    if failed:
        message += f"; {format_ranks(failed)} failed because of it"
    hint = (
        "every rank must call the same collectives in the same order with the same shapes, "
        "dtypes, reduce op and root: look for a dist.* call that only some ranks make (under "
        "`if rank == 0`, in logging or metrics code), a size that depends on the rank's data "
        "(pad it, or all_gather the sizes first) or a src/dst computed from the rank "
        "(src=rank); TORCH_DISTRIBUTED_DEBUG=DETAIL checks every call"
    )
    return alert(AlertKind.COLLECTIVE_MISMATCH, Severity.ERROR, culprits, affected, message, hint)


def _dead_or_blocked(f: Facts) -> set[int]:
    """Everyone who failed, was stopped or waits: the ranks a mismatch took down with it."""
    cascade = f.cascade
    dead = {r.rank for r in cascade.symptoms} | {r.rank for r in cascade.stopped}
    return dead | set(cascade.blocked) | {r.rank for r in cascade.mismatched}


def _mismatch_from_crashes(facts: Facts) -> list[Alert]:
    """A mismatch error with no calls to compare: name the ranks the error text names, if
    any; the ranks that raised it may only have received the odd rank's data."""
    crashed = facts.crashes_of_kind(AlertKind.COLLECTIVE_MISMATCH)
    if not crashed:
        return []
    first = crashed[0]
    assert first.error is not None
    votes = Counter(rank for r in crashed if r.error for rank in named_ranks(r.error))
    named = [rank for rank, n in votes.items() if n * 2 > len(crashed)]  # most reporters agree
    message = (
        f"{format_ranks(r.rank for r in crashed)} failed with {first.error.type}: "
        f"{first_line(first.error.message)} — the ranks called different collectives, or "
        "the same one with different sizes"
    )
    if not named:
        message += "; which rank made the odd call is not known yet"
    signature = facts.signatures.get(first.rank)
    hint = signature.hint if signature else ""
    return [
        alert(
            AlertKind.COLLECTIVE_MISMATCH,
            Severity.ERROR,
            named,
            _dead_or_blocked(facts),
            message,
            hint,
        )
    ]
