"""What one rank's own record says, which every model reads: its state (``rank_state``),
whether it is silent or busy, how it ended, and which collective it waits in, by the
counter its number comes from (``wait_key``, ``entered``)."""

from __future__ import annotations

import math
import re
from functools import lru_cache

from ddpwatch.core.protocol import Collective
from ddpwatch.core.vocabulary import STARTUP_PHASES, CollectiveSource, Phase, RankState
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.state.records import RankRecord
from ddpwatch.state.relays import RELAY_HOLD_S

_TERM_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP"})
_TERM_CODES = frozenset({-15, -2, -1, 143, 130, 129})
_STARTING = frozenset(STARTUP_PHASES) - {Phase.TRAIN}

CPU_RATE = 0.05
"""CPU seconds a second, between a rank's last two marks (``RankRecord.cpu_rate``), that tell
work: a rank importing or computing uses 0.3 or more on a loaded 2-core machine; the agent's
own threads on a rank that sleeps or waits ~0.006 (measured), a mark every ~17 s."""
CPU_GROWING_S = 2.5
"""A rank whose CPU time grew (``RankRecord.cpu_grew_at``) within this long of its last
heartbeat, at ``CPU_RATE`` or more, is working (``cpu_growing``): at ``CPU_RATE`` a mark
comes every 2 s, and a beat later; a rank that stops (a sleep, a wait) reads as stopped
this long after (5 s said "working" of a rank that had slept for 3.5 s)."""
COLLECTIVE_WAIT_S = 5.0
"""A rank inside one collective for longer than this is waiting in it, not working, however
its CPU time grows (``still_working``)."""


def phase_at(record: RankRecord, at: float) -> str | None:
    """The phase the rank was in at ``at`` (server time), from the phases it entered
    (``record.phases``, the last 32); its phase now where none is that old."""
    then = None
    for phase, since in record.phases:
        if since > at:
            break
        then = phase
    return then if then is not None else record.phase


def silent_after(record: RankRecord, th: Thresholds, stepping: bool = False) -> float:
    """How long this rank may go unheard before it counts as silent.

    Longer while it starts (no step yet, in a startup phase): its heartbeat thread then
    waits seconds for the GIL behind imports, model building and DataLoader workers on a
    busy host (seen: 2.5 to 10 s at a load average above 4 on 2 cores). Not once a peer is
    ``stepping`` (``ServerState.stepping_since``): in lockstep, the peers' steps say this
    rank started too, and one that only never reported a step (killed at step 12 in the
    job's first second) is not starting (seen: named silent 15 s late). A relayed rank gets
    the beats its relay may hold its frames on top (``RankRecord.relayed``: its pace).
    """
    limit = th.silent
    if not stepping and record.step is None and (record.phase is None or record.phase in _STARTING):
        limit = max(limit, th.startup_silent)
    return limit + RELAY_HOLD_S * record.relayed


def is_silent(
    record: RankRecord, now: float, th: Thresholds, since: float, stepping: bool = False
) -> bool:
    """Unheard for longer than ``silent_after``, counting only time the server listened
    through without a break (``since``: ``ServerState.listening_since``)."""
    return now - max(record.last_seen, since) > silent_after(record, th, stepping)


def rank_state(
    record: RankRecord,
    now: float,
    th: Thresholds,
    stall_after: float,
    since: float = -math.inf,
    stepping: bool = False,
) -> str:
    """One word for a rank (a ``RankState``): running, waiting, stalled, silent, crashed,
    stopped or exited, as of ``now`` (``ServerState.as_of``); silence and stalls count from
    ``since`` at the earliest (``ServerState.listening_since``); ``stepping``: a rank of the
    job has reported a step (``silent_after``).

    ``stopped``: ended by a signal from outside (SIGTERM, SIGINT, SIGHUP), usually the
    launcher stopping the rest after one rank failed; ``exited``: ended on its own.
    """
    if record.error is not None:
        return RankState.CRASHED
    if record.exit_time is not None:
        return RankState.STOPPED if is_term_exit(record) else RankState.EXITED
    if is_silent(record, now, th, since, stepping):
        return RankState.SILENT
    if record.collective is not None:
        return RankState.WAITING
    if record.step is not None and now - max(record.last_progress, since) > stall_after:
        working = is_busy(record, now, th) or is_compiling(record)
        return RankState.BUSY if working else RankState.STALLED
    return RankState.RUNNING


def is_busy(record: RankRecord, now: float, th: Thresholds) -> bool:
    """No step, but working: a stack that differs from the last one at the same step came
    within the silent threshold (the agent samples it every heartbeat once the rank idles).

    A rank evaluating or saving alone moves through Python code; a stuck one (a lock, a
    dead peer, a hung read) shows the same stack beat after beat. A long call into C++
    (one big kernel, a GPU sync) looks stuck too: that is the conservative side."""
    moved = record.stack_moved_at
    return moved is not None and moved > record.last_progress and now - moved <= th.silent


def cpu_growing(record: RankRecord, now: float) -> bool:
    """The rank works: its CPU time grew at ``CPU_RATE`` or more between its last two marks,
    and its last heartbeat came within ``CPU_GROWING_S`` of the last mark. One mark is not
    enough: the agent's own threads reach one every ~17 s on a rank that sleeps or waits.
    Judged as of its last heartbeat: a rank that went quiet is the silent rule's to name, not
    a hang on stale evidence."""
    rate, grew = record.cpu_rate, record.cpu_grew_at
    if rate is None or grew is None or rate < CPU_RATE:
        return False
    seen = record.sample_seen
    return (now if seen is None else seen) - grew <= CPU_GROWING_S


def still_working(record: RankRecord, now: float) -> bool:
    """A rank that works, slow but not hung: its CPU time grows, and it is neither waiting
    for its peers in 'rendezvous' nor inside a collective for longer than
    ``COLLECTIVE_WAIT_S`` (one it waits in: a rank spinning on a GPU sync burns CPU waiting)."""
    if (record.phase or Phase.STARTED) == Phase.RENDEZVOUS or not cpu_growing(record, now):
        return False
    age = record.collective_age(now)
    return age is None or age <= COLLECTIVE_WAIT_S


def working_start(record: RankRecord, now: float) -> bool:
    """Before its first step, in a start-up phase, and working (``still_working``): slow to
    start, not hung. Ranks that wait for it wait for its start-up, which ``startup_hang``
    tells (a note while it works), never a straggler's error."""
    phase = record.phase or Phase.STARTED
    return record.step is None and phase in _STARTING and still_working(record, now)


def is_compiling(record: RankRecord) -> bool:
    """Inside ``torch.compile`` (dynamo, AOT autograd, inductor), as the agent hears from
    torch itself: working, however long a cold compile takes (minutes on a large model),
    never stalled."""
    return record.phase == Phase.COMPILING


def is_term_exit(record: RankRecord) -> bool:
    """Stopped from outside (the launcher's SIGTERM after a peer failed, Ctrl-C)."""
    return record.exit_signal in _TERM_SIGNALS or (
        record.exit_signal is None and record.exit_code in _TERM_CODES
    )


def is_clean_exit(record: RankRecord) -> bool:
    return record.exit_signal is None and record.exit_code in (0, None)


@lru_cache(maxsize=1024)
def normal_op(op: str) -> str:
    """One spelling per collective: "nccl:all_reduce", "ALLREDUCE", "_allreduce_base"."""
    name = op.rsplit(":", 1)[-1].lower()
    name = re.sub(r"[^a-z]", "", name)
    for suffix in ("intotensor", "coalesced", "base", "tensor"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    return name


WaitKey = tuple[object, ...]
P2P_OPS = frozenset({"send", "recv", "isend", "irecv"})
"""Point-to-point ops (``normal_op``'s spelling): one peer releases a rank blocked in one."""


def is_p2p(c: Collective) -> bool:
    """A point-to-point op, not a collective: a send or a receive, numbered by no counter."""
    return c.seq is None and normal_op(c.op) in P2P_OPS


def is_p2p_place(place: tuple[str | None, str | None, int | None, str | None]) -> bool:
    """``is_p2p`` of a ``state.waits`` place (source, group, seq, op)."""
    return place[2] is None and normal_op(place[3] or "") in P2P_OPS


def wait_key(c: Collective) -> WaitKey:
    """Which collective a rank waits in, comparable across ranks: the counter its number
    comes from (flight recorder per group, or the agent's Python-level count), else the op."""
    return key_of_place(c.source, c.group, c.seq, c.op)


def key_of_place(
    source: str | None, group: str | None, seq: int | None, op: str | None
) -> WaitKey:
    """``wait_key`` of a collective's raw fields (a ``state.waits`` place)."""
    if seq is None:
        return ("op", normal_op(op or ""))
    return (source, (group or "0") if source == CollectiveSource.FR else None, seq)


def entered(record: RankRecord, key: WaitKey) -> bool | None:
    """The rank's own evidence that it has entered collective ``key``: True, False, or None
    when its report cannot tell (no counts, another counter, a group it is not in)."""
    counts = record.collectives
    source, group, seq = key if len(key) == 3 else (None, None, None)
    if counts is None or not isinstance(seq, int):
        return None
    if source == CollectiveSource.PY:
        return counts.py >= seq
    if source == CollectiveSource.FR and counts.fr is not None and group in counts.fr:
        return counts.fr[str(group)] >= seq
    return None
