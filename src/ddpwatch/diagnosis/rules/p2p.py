"""Point-to-point: a rank blocked in a ``send`` or ``recv`` (a pipeline stage's hand-off)
waits for its one peer, never for the ranks that wait with it. Name that peer: the stage
everyone waits for (``straggler``), or the rank whose missing send (or receive) has
deadlocked the job (``send_recv_deadlock``): it waits in a collective the blocked rank must
enter, or in a send or receive of its own that waits back.

From public reports: a stage that skips its ``send`` of the targets to the last stage
(tdrussell/diffusion-pipe#409), a ``batch_isend_irecv`` whose peer posts its half later or
never (pytorch/PiPPy#969), two stages that both send (or both receive) first
(pytorch/pytorch#172668)."""

from __future__ import annotations

from ddpwatch.core.protocol import Collective
from ddpwatch.core.vocabulary import AlertKind, Severity
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.ranks import is_compiling, is_p2p, normal_op, working_start
from ddpwatch.diagnosis.facts.stragglers import Deadlock, Hop, p2p_name
from ddpwatch.diagnosis.rules.registry import alert, rule
from ddpwatch.diagnosis.text import collective_name, format_ranks, verb, where
from ddpwatch.state.records import RankRecord
from ddpwatch.status.fmt import STACKS_IN, seconds


@rule(AlertKind.SEND_RECV_DEADLOCK, AlertKind.STRAGGLER)
def rule_p2p(f: Facts) -> list[Alert]:
    """Ranks blocked in a send or receive for longer than a collective may wait: follow each
    to the peer it waits for. A deadlock the straggler's collective closes is said here
    (``Straggle.deadlock``); waits no straggle covers are followed from each blocked rank."""
    if f.cascade.roots:
        return []
    found = f.straggle
    if found is not None and found.deadlock is not None:
        blocked = {*found.waiting_ranks(), *(rank for hop in found.via for rank in hop.ranks)}
        deadlock = found.deadlock
        late = [r for r in found.culprits if r is not deadlock.peer]  # in no collective
        return [_deadlock_alert(f, deadlock, found.via, sorted(blocked), found.age, late)]
    alerts = []
    for hold in f.p2p_holds:
        if hold.deadlock is not None:
            held = sorted(hold.waiting)
            alerts.append(_deadlock_alert(f, hold.deadlock, hold.via, held, hold.age))
            continue
        stuck = [r for r in hold.culprits if not working_start(r, f.now)]
        if stuck:  # a stage still working through its start-up is slow, not hung
            alerts.append(_late_peer_alert(f, stuck, hold.via, hold.age))
    return alerts


def _late_peer_alert(f: Facts, roots: list[RankRecord], hops: list[Hop], age: float) -> Alert:
    """The chain ends at a rank in no collective: the stage the others wait for."""
    first = roots[0]
    hops = sorted(hops, key=lambda hop: hop.ranks)
    if len(hops) == 1:
        chain = f"{format_ranks(hops[0].ranks)} has waited in {hops[0].name} for {seconds(age)}"
    else:
        each = ", ".join(f"{format_ranks(hop.ranks)} in {hop.name}" for hop in hops)
        chain = f"{each}: waiting for up to {seconds(age)}"
    doing = ", compiling (torch.compile)" if is_compiling(first) else ""
    message = (
        f"{chain}; {format_ranks(r.rank for r in roots)} "
        f"{verb(len(roots), 'is', 'are')} {where(first)}{doing}"
    )
    hint = (
        f"see where rank {first.rank} is (its stack in {STACKS_IN}): a slow or stuck stage, a "
        "rank-dependent branch that skips its send, or a receive posted for a message its "
        "peer sends later keeps the others waiting"
    )
    severity = Severity.ERROR if age >= f.stall_after else Severity.WARNING
    waiting = {rank for hop in hops for rank in hop.ranks}
    return alert(
        AlertKind.STRAGGLER,
        severity,
        [r.rank for r in roots],
        waiting,
        message,
        hint,
        waited_s=age,
        phase=first.phase,
    )


def _deadlock_alert(
    f: Facts,
    found: Deadlock,
    via: list[Hop],
    waiting: list[int],
    age: float,
    late: list[RankRecord] | None = None,
) -> Alert:
    """A wait that closes on itself: through a collective, the peer that did not send (or
    receive) holds everyone; through the peer's own send or receive, both ends are named.
    ``late``: other ranks that have not entered that collective, in none themselves (named
    too)."""
    waiter, call, peer, peer_in = found.waiter, found.call, found.peer, found.peer_in
    waited = seconds(waiter.collective_age(f.now) or age)
    spot = f" at step {waiter.step}" if waiter.step is not None else ""
    if is_p2p(peer_in):
        (low, low_in), (high, high_in) = sorted(((waiter, call), (peer, peer_in)), key=_by_rank)
        culprits = [low.rank, high.rank]
        waited = seconds(max(low.collective_age(f.now) or 0.0, high.collective_age(f.now) or 0.0))
        message = (
            f"ranks {low.rank} and {high.rank} wait for each other: rank {low.rank} in "
            f"{_call(low_in)}{_at(low)}, rank {high.rank} in {_call(high_in)}{_at(high)}, "
            f"for {waited}: {_why_both(low_in, high_in)}"
        )
        hint = (
            "make each send meet its receive: the same peer, tag and order on both sides "
            "(post the receive first on one of the two, e.g. the lower rank, or use "
            "batch_isend_irecv for the pair)"
        )
    else:
        others = late or []
        culprits = [peer.rank, *(r.rank for r in others)]
        missing = "recv" if _sends(call) else "send"
        also = _also(via, waiting, (waiter.rank, peer.rank), peer_in)
        if others:
            also += (
                f"; {format_ranks(r.rank for r in others)} {verb(len(others), 'has', 'have')} "
                f"not entered {collective_name(peer_in.op, peer_in.seq)} either: "
                f"{where(others[0])}"
            )
        message = (
            f"rank {waiter.rank} waits in {_call(call)}{spot} for {waited}; rank {peer.rank} "
            f"is in {collective_name(peer_in.op, peer_in.seq)}{_at(peer)}, which rank "
            f"{waiter.rank} must enter: a {missing} rank {peer.rank} did not make{also}"
        )
        hint = (
            f"rank {peer.rank} went on to the collective without its {missing} to rank "
            f"{waiter.rank}: a rank-dependent branch or a skipped micro-batch; every send "
            f"needs its receive on the peer, with the same tag, before either rank enters "
            f"the next collective (the stacks in {STACKS_IN} show both calls)"
        )
    return alert(
        AlertKind.SEND_RECV_DEADLOCK,
        Severity.ERROR,
        culprits,
        {*waiting, waiter.rank},
        message,
        hint,
        waited_s=age,
        phase=peer.phase,
    )


def _also(
    via: list[Hop], waiting: list[int], told: tuple[int, ...], collective: Collective
) -> str:
    """The other blocked ranks: those in sends or receives, with their peer, and those in
    the collective the peer waits in: "; rank 2 waits in isend to rank 0 too; rank 3 waits
    in all_reduce #45 too"."""
    parts = []
    sending = [hop for hop in via if hop.p2p and not set(hop.ranks) & set(told)]
    for hop in sorted(sending, key=lambda hop: hop.ranks):
        parts.append(f"{format_ranks(hop.ranks)} waits in {hop.name} too")
    named = {*told, *(rank for hop in sending for rank in hop.ranks)}
    others = [rank for rank in waiting if rank not in named]
    if others:
        parts.append(
            f"{format_ranks(others)} {verb(len(others), 'waits', 'wait')} in "
            f"{collective_name(collective.op, collective.seq)} too"
        )
    return "".join(f"; {part}" for part in parts)


def _by_rank(pair: tuple[RankRecord, Collective]) -> int:
    return pair[0].rank


def _sends(c: Collective) -> bool:
    return normal_op(c.op) in ("send", "isend")


def _call(c: Collective) -> str:
    """"recv from rank 0 (tag 3)": the tag only where one was given (0 is torch's default)."""
    tag = f" (tag {c.tag})" if c.tag else ""
    return f"{p2p_name(c)}{tag}"


def _at(record: RankRecord) -> str:
    return f" at step {record.step}" if record.step is not None else ""


def _why_both(a: Collective, b: Collective) -> str:
    """Why two ranks blocked on each other's send or receive never meet."""
    if _sends(a) != _sends(b):
        if (a.tag or 0) != (b.tag or 0):
            return f"the tags differ ({a.tag or 0} and {b.tag or 0}), so neither completes"
        return "the send and the receive do not meet (another group, or another order)"
    if _sends(a):
        return "both send before either receives (a send blocks until its peer receives)"
    return "both receive before either sends"
