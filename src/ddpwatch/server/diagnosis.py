"""Pure rules over ``ServerState`` that name the rank behind a problem, its cause and the fix.

Every rule is a small function ``(state, now, th) -> list[Alert]`` listed in ``RULES``,
so each can be tested alone; ``diagnose`` runs them all. Rules never mutate the
state and never loop over pairs of ranks: the server calls ``diagnose`` four times
a second with up to thousands of ranks, so each rule is one or two linear passes
plus a sort.

The most important idea is root cause over cascade: when one rank dies, its peers
fail within a second with "connection closed by peer" and the launcher stops the
rest. Those ranks are listed as ``waiting`` on the rank that failed first, never as
culprits.
"""

from __future__ import annotations

import math
import re
import statistics
from collections import Counter, defaultdict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property, lru_cache
from typing import Protocol

from ddpwatch.protocol import ErrorInfo
from ddpwatch.server.alerts import Alert, Severity, Thresholds
from ddpwatch.server.knowledge import TIMEOUT_NAMES, Signature, explain_error
from ddpwatch.server.state import RankRecord, ServerState

GIB = float(1 << 30)
MAX_LISTED = 8  # rank runs written out before "and N more"
MAX_WORLD = 1 << 20  # never iterate a bogus world size further than this
STARTUP_PHASES = (
    "started",
    "rendezvous",
    "setup",
    "configure_model",  # Lightning: this rank's setup hooks are done
    "device",
    "strategy_setup",  # Lightning: strategy.setup (to device, wrap, optimizers)
    "model_wrap",
    "deepspeed_init",  # inside deepspeed.initialize
    "zero_partition",  # deepspeed.initialize builds the ZeRO optimizer
    "fit_start",  # Lightning: on_fit_start hooks, restoring the training state
    "sanity_check",  # Lightning: validation sanity check
    "first_step",
    "train",
)
_PHASE_ORDER = {name: index for index, name in enumerate(STARTUP_PHASES)}
_TERM_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP"})
_TERM_CODES = frozenset({-15, -2, -1, 143, 130, 129})
_SKIP_PARTS = frozenset({"ddpwatch", "torch", "site-packages", "dist-packages"})
_FRAME = re.compile(r'File "([^"]+)", line (\d+)')
_DUPLICATE_PAIR = re.compile(r"rank (\d+) and rank (\d+) both on CUDA device", re.IGNORECASE)
_SEVERITY_ORDER = {"error": 0, "warning": 1, "info": 2}


# --------------------------------------------------------------------------- text helpers


def format_ranks(ranks: Iterable[int], limit: int = MAX_LISTED) -> str:
    """Write ranks as "rank 3", "ranks 0, 2" or "ranks 0-5, 9"; huge lists end "and 8000 more".

    Runs of three or more collapse to "a-b" so 8192 ranks stay one short phrase.
    """
    ordered = sorted(set(ranks))
    if not ordered:
        return "no rank"
    if len(ordered) == 1:
        return f"rank {ordered[0]}"
    pieces: list[tuple[str, int]] = []  # (text, how many ranks it stands for)
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        if prev - start >= 2:
            pieces.append((f"{start}-{prev}", prev - start + 1))
        else:
            pieces.extend((str(r), 1) for r in range(start, prev + 1))
        if rank is not None:
            start = prev = rank
    text = ", ".join(piece for piece, _ in pieces[:limit])
    if len(pieces) > limit:
        text += f" and {sum(n for _, n in pieces[limit:])} more"
    return f"ranks {text}"


def _verb(count: int, one: str, many: str) -> str:
    return one if count == 1 else many


def _seconds(value: float) -> str:
    return f"{value:.1f} s"


def _gib(value: float) -> str:
    return f"{value / GIB:.1f} GiB"


def _first_line(text: str, limit: int = 200) -> str:
    line = text.strip().splitlines()[0] if text.strip() else ""
    return line if len(line) <= limit else line[: limit - 1] + "…"


def _collective_name(op: str, seq: int | None) -> str:
    return op if seq is None else f"{op} #{seq}"


def location(stack: str | None) -> str | None:
    """Return "train.py:88", the innermost frame of a formatted stack in the user's own code.

    Frames inside ddpwatch, torch, threading or installed packages say nothing about
    where the user's program is, so they are skipped.
    """
    if not stack:
        return None
    for path, line in reversed(_FRAME.findall(stack)):
        parts = re.split(r"[\\/]", path)
        name = parts[-1]
        if name == "threading.py" or name.startswith("<") or _SKIP_PARTS.intersection(parts):
            continue
        return f"{name}:{line}"
    return None


def _record_location(record: RankRecord) -> str | None:
    """Where the rank is: its captured stack, else the traceback it died with."""
    found = location(record.stack)
    if found is None and record.error is not None:
        found = location(record.error.traceback)
    return found


def _where(record: RankRecord) -> str:
    """Describe where a rank is: "in 'forward' at step 311, train.py:88", as far as known."""
    parts = []
    if record.phase:
        parts.append(f"in '{record.phase}'")
    parts.append("before its first step" if record.step is None else f"at step {record.step}")
    text = " ".join(parts)
    loc = _record_location(record)
    return f"{text}, {loc}" if loc else text


# --------------------------------------------------------------------------- rank state


def rank_state(record: RankRecord, now: float, th: Thresholds, stall_after: float) -> str:
    """One word for a rank: running, waiting, stalled, silent, crashed or exited."""
    if record.error is not None:
        return "crashed"
    if record.exit_time is not None:
        return "exited"
    if now - record.last_seen > th.silent:
        return "silent"
    if record.collective is not None:
        return "waiting"
    if record.step is not None and now - record.last_progress > stall_after:
        return "stalled"
    return "running"


def _median(values: Iterable[float | None]) -> float | None:
    data = [v for v in values if v is not None and v > 0]
    return statistics.median(data) if data else None


def _median_step_time(records: Iterable[RankRecord]) -> float | None:
    return _median(
        r.avg_step_time_s if r.avg_step_time_s is not None else r.step_time_s for r in records
    )


def effective_stall_after(state: ServerState, th: Thresholds) -> float:
    """The stall threshold for this job: longer for jobs with slow steps."""
    times = [
        r.avg_step_time_s
        for r in state.ranks.values()
        if r.avg_step_time_s is not None and r.avg_step_time_s > 0
    ]
    return th.stall(times)


def _collective_threshold(live: Sequence[RankRecord], stall_after: float) -> float:
    """How long a wait in a collective is suspicious: ~3 s, longer for slow steps.

    Healthy ranks sit in all_reduce for milliseconds, so 2 s never flickers.
    """
    median = _median_step_time(live)
    typical = 3.0 * median if median is not None else 3.0
    return max(2.0, min(stall_after, typical))


def _is_term_exit(record: RankRecord) -> bool:
    """Stopped from outside (the launcher's SIGTERM after a peer failed, Ctrl-C)."""
    return record.exit_signal in _TERM_SIGNALS or (
        record.exit_signal is None and record.exit_code in _TERM_CODES
    )


def _is_clean_exit(record: RankRecord) -> bool:
    return record.exit_signal is None and record.exit_code in (0, None)


def _world_complete(state: ServerState, live: Sequence[RankRecord]) -> bool:
    """Every rank of the job is connected and alive."""
    size = state.world_size
    if size is None:
        return len(live) == len(state.ranks)
    return sum(1 for r in live if r.rank < size) == size


class Facts:
    """What several rules need, worked out at most once per ``diagnose`` call.

    A rule called alone builds its own; ``diagnose`` shares one between all rules so
    that 8192 ranks cost a few linear passes, not one per rule.
    """

    def __init__(self, state: ServerState, now: float, th: Thresholds) -> None:
        self.state = state
        self.now = now
        self.th = th

    @cached_property
    def records(self) -> list[RankRecord]:
        return list(self.state.ranks.values())

    @cached_property
    def live(self) -> list[RankRecord]:
        """Ranks still sending heartbeats and not finished."""
        now, silent = self.now, self.th.silent
        return [
            r
            for r in self.records
            if r.error is None and r.exit_time is None and now - r.last_seen <= silent
        ]

    @cached_property
    def stall_after(self) -> float:
        return effective_stall_after(self.state, self.th)

    @cached_property
    def collective_limit(self) -> float:
        return _collective_threshold(self.live, self.stall_after)

    @cached_property
    def signatures(self) -> dict[int, Signature | None]:
        """The knowledge base's reading of every crashed rank's error."""
        return {r.rank: explain_error(r.error) for r in self.records if r.error is not None}

    @cached_property
    def cascade(self) -> _Cascade:
        return _cascade(self)

    @cached_property
    def straggle(self) -> _Straggle | None:
        return _find_straggle(self.live, self.now, self.collective_limit, self.th.interval)

    @cached_property
    def duplicate_groups(self) -> list[list[RankRecord]]:
        return _duplicate_groups(self.live)

    @cached_property
    def ordinal_suspects(self) -> list[RankRecord]:
        return _ordinal_suspects(self.live)

    def crashes_of_kind(self, kind: str) -> list[RankRecord]:
        """Crashed ranks whose error the knowledge base ties to alert ``kind``, by rank."""
        found = [
            self.state.ranks[rank]
            for rank, sig in self.signatures.items()
            if sig is not None and sig.kind == kind
        ]
        return sorted(found, key=lambda r: r.rank)


class Rule(Protocol):
    """A diagnosis rule: pure, over the state at ``now``; ``facts`` only saves work."""

    def __call__(
        self, state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
    ) -> list[Alert]: ...


# --------------------------------------------------------------------------- cascade


@dataclass
class _Root:
    """One group of ranks that failed first for the same reason."""

    kind: str
    ranks: list[int]
    time: float
    records: list[RankRecord]
    signature: Signature | None = None


@dataclass
class _Cascade:
    """Who failed first (roots) and who only failed or blocks because of them (victims)."""

    roots: list[_Root]
    symptoms: list[RankRecord]  # peer failures (and timeouts when a real root exists)
    stopped: list[RankRecord]  # SIGTERM/SIGINT exits
    blocked: list[int]  # live ranks waiting in a collective


def _crash_key(error: ErrorInfo, signature: Signature | None) -> tuple[str, str]:
    if signature is not None:
        return ("sig", signature.name)
    return (error.type, _first_line(error.message))


def _group(
    roots: dict[tuple, _Root],
    key: tuple,
    kind: str,
    record: RankRecord,
    t: float,
    signature: Signature | None = None,
) -> None:
    """Add ``record`` to the root group ``key``: the same error on many ranks is one alert."""
    root = roots.get(key)
    if root is None:
        roots[key] = _Root(kind, [record.rank], t, [record], signature)
        return
    root.ranks.append(record.rank)
    root.records.append(record)
    root.time = min(root.time, t)


def _cascade(facts: Facts) -> _Cascade:
    """Split finished and silent ranks into roots and victims (one linear pass)."""
    now, silent_after = facts.now, facts.th.silent
    primary: dict[tuple, _Root] = {}
    timeouts: dict[tuple, _Root] = {}
    silent: list[RankRecord] = []
    symptoms: list[RankRecord] = []
    stopped: list[RankRecord] = []
    blocked: list[int] = []
    for record in facts.records:
        if record.error is not None:
            signature = facts.signatures[record.rank]
            t = record.error_time if record.error_time is not None else record.last_seen
            if signature is not None and signature.peer_failure:
                symptoms.append(record)
            elif signature is not None and signature.name in TIMEOUT_NAMES:
                key = _crash_key(record.error, signature)
                _group(timeouts, key, "crashed", record, t, signature)
            else:
                key = _crash_key(record.error, signature)
                _group(primary, key, "crashed", record, t, signature)
        elif record.exit_time is not None:
            if _is_term_exit(record):
                stopped.append(record)
            elif not _is_clean_exit(record):
                key = ("exit", record.exit_code, record.exit_signal)
                _group(primary, key, "exited", record, record.exit_time)
        elif now - record.last_seen > silent_after:
            silent.append(record)
        elif record.collective is not None:
            blocked.append(record.rank)
    if silent:
        # A rank that still sent heartbeats after another one failed was alive when the
        # cascade began (the launcher killed it later): a victim, not a second root.
        cutoff = min(
            [root.time for root in primary.values()]
            + [r.error_time or r.last_seen for r in symptoms]
            + [r.exit_time or r.last_seen for r in stopped],
            default=math.inf,
        )
        early = [r for r in silent if r.last_seen < cutoff]
        stopped.extend(r for r in silent if r.last_seen >= cutoff)
        if early:
            root = _Root("silent", [r.rank for r in early], min(r.last_seen for r in early), early)
            primary[("silent",)] = root
    if primary:
        for root in timeouts.values():
            symptoms.extend(root.records)
        roots = list(primary.values())
    else:
        roots = list(timeouts.values())
    roots.sort(key=lambda root: (root.time, min(root.ranks)))
    return _Cascade(roots, symptoms, stopped, blocked)


def _root_alert(root: _Root, waiting: list[int], now: float) -> Alert:
    """The alert for one root: what failed first, why, and what to do."""
    ranks = sorted(root.ranks)
    first = min(root.records, key=lambda r: (r.error_time or r.exit_time or r.last_seen, r.rank))
    who = format_ranks(ranks)
    if root.kind == "silent":
        return _silent_alert(root, ranks, waiting, now)
    if root.kind == "exited":
        how = f"signal {first.exit_signal}" if first.exit_signal else f"exit code {first.exit_code}"
        message = f"{who} exited with {how} {_where(first)}"
        hint = (
            "read the rank's own log: it ended without a Python exception (sys.exit, a crash "
            "in C++ code, or a signal from outside such as the OOM killer)"
        )
        return _alert("exited", "error", ranks, waiting, message, hint)
    assert first.error is not None
    signature = root.signature
    error = f"{first.error.type}: {_first_line(first.error.message)}".rstrip(": ")
    message = f"{who} crashed {_where(first)} with {error}"
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
    return _alert("crashed", "error", ranks, waiting, message, hint)


def _silent_alert(root: _Root, ranks: list[int], waiting: list[int], now: float) -> Alert:
    who = format_ranks(ranks)
    first = min(root.records, key=lambda r: (r.last_seen, r.rank))
    quiet = now - first.last_seen
    n = len(ranks)
    message = (
        f"{who} {_verb(n, 'has', 'have')} sent no heartbeat for {_seconds(quiet)}, last "
        f"{_where(first)}; {_verb(n, 'it was', 'they were')} probably killed (kill -9, the OOM "
        f"killer) or {_verb(n, 'is', 'are')} stuck in native code holding the GIL"
    )
    if waiting:
        message += f"; {format_ranks(waiting)} failed or wait because of it"
    where = f" on host {first.host}" if first.host else ""
    pid = f"py-spy dump --pid {first.pid}" if first.pid else "py-spy dump --pid PID"
    hint = (
        f"check the launcher's log and dmesg (OOM killer){where}; if the process still runs, "
        f"{pid} shows where it hangs"
    )
    return _alert("silent", "error", ranks, waiting, message, hint)


def _no_root_alerts(cascade: _Cascade, now: float, th: Thresholds) -> list[Alert]:
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
            f"{format_ranks(ranks)} {_verb(len(ranks), 'was', 'were')} stopped by "
            f"{', '.join(signals)} and no rank reported a failure before"
        )
        hint = (
            "something outside the job stopped it: the launcher (its log names the first "
            "failure), the scheduler (time limit, preemption) or Ctrl-C"
        )
        return [_alert("exited", "error", ranks, cascade.blocked, message, hint)]
    _, culprit_rank, culprit = min(events, key=lambda e: (e[0], e[1]))
    assert culprit.error is not None
    waiting = sorted({r.rank for _, _, r in events + stops} - {culprit_rank} | set(cascade.blocked))
    message = (
        f"rank {culprit_rank} failed first, {_where(culprit)}, with "
        f"{culprit.error.type}: {_first_line(culprit.error.message)}; the first failure was a "
        "lost connection and no rank reported another error"
    )
    if waiting:
        message += f"; {format_ranks(waiting)} failed after it"
    hint = (
        "a process died without reporting (kill -9, the OOM killer, a segfault) or the network "
        "between hosts failed: check dmesg and the launcher's log on every host"
    )
    return [_alert("crashed", "error", [culprit_rank], waiting, message, hint)]


def rule_cascade(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """Name the ranks that failed first; list everything that failed because of them."""
    f = facts or Facts(state, now, th)
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


def rule_clean_exit(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """A rank that finished while others still train: they hang in their next collective."""
    f = facts or Facts(state, now, th)
    exited = [
        r for r in f.records if r.exit_time is not None and r.error is None and _is_clean_exit(r)
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
        f"{_verb(len(live), 'runs', 'run')}; {_verb(len(live), 'it', 'they')} will hang in "
        f"{_verb(len(live), 'its', 'their')} next collective"
    )
    if stuck:
        worst = max(stuck, key=lambda r: r.collective_age(now) or 0.0)
        assert worst.collective is not None
        name = _collective_name(worst.collective.op, worst.collective.seq)
        message += (
            f"; {format_ranks(r.rank for r in stuck)} "
            f"{_verb(len(stuck), 'has', 'have')} waited in {name} for "
            f"{_seconds(worst.collective_age(now) or 0.0)}"
        )
    hint = (
        "the ranks ran different numbers of steps: give every rank the same number of "
        "batches (DistributedSampler with drop_last=True, or the DDP join() context manager)"
    )
    severity: Severity = "error" if stuck else "warning"
    return [_alert("exited", severity, ranks, [r.rank for r in stuck], message, hint)]


# --------------------------------------------------------------------------- collectives


@lru_cache(maxsize=1024)
def _normal_op(op: str) -> str:
    """One spelling per collective: "nccl:all_reduce", "ALLREDUCE", "_allreduce_base"."""
    name = op.rsplit(":", 1)[-1].lower()
    name = re.sub(r"[^a-z]", "", name)
    for suffix in ("intotensor", "coalesced", "base", "tensor"):
        if name.endswith(suffix) and len(name) > len(suffix):
            name = name[: -len(suffix)]
    return name


@dataclass
class _Straggle:
    """The collective most ranks wait in, and the live ranks that have not entered it."""

    op: str
    seq: int | None
    age: float
    waiting: list[RankRecord]
    culprits: list[RankRecord]


def _find_straggle(
    live: Sequence[RankRecord], now: float, limit: float, interval: float
) -> _Straggle | None:
    """The most-waited collective older than ``limit``, with who is missing from it."""
    groups: dict[tuple, list[RankRecord]] = defaultdict(list)
    for r in live:
        if r.collective is not None:
            c = r.collective
            groups[(c.seq,) if c.seq is not None else (_normal_op(c.op), None)].append(r)
    best: tuple[int, float, tuple] | None = None
    for key, members in groups.items():
        age = max(r.collective_age(now) or 0.0 for r in members)
        if age > limit and (best is None or (len(members), age) > best[:2]):
            best = (len(members), age, key)
    if best is None:
        return None
    _, age, key = best
    waiting = groups[key]
    seq = waiting[0].collective.seq if waiting[0].collective else None
    op = Counter(r.collective.op for r in waiting if r.collective).most_common(1)[0][0]
    reported = max(r.collective_seen or 0.0 for r in waiting)
    lag = max(0.0, now - reported) + interval  # how stale the waiters' view may be
    steps_in_lag = math.ceil(lag / (_median_step_time(live) or interval))
    max_step = max((r.step or 0) for r in waiting) + 1 + steps_in_lag
    culprits = [
        r for r in live if _has_not_entered(r, key, seq) and not _moved_on(r, reported, max_step)
    ]
    return _Straggle(op, seq, age, waiting, culprits)


def _moved_on(record: RankRecord, since: float, max_step: int) -> bool:
    """The rank stepped within the waiters' reporting lag: the collective is likely done.

    The waiters' next heartbeat will say so: without this, every recovery from a
    straggler (or a stopped rank) would briefly blame the ranks that went on
    first. A rank further ahead than heartbeats can explain (extra batches while
    the others wait) still counts as a culprit.
    """
    return record.last_step_at > since and (record.step or 0) <= max_step


def _has_not_entered(record: RankRecord, key: tuple, seq: int | None) -> bool:
    c = record.collective
    if c is None:
        return True
    if seq is not None and c.seq is not None:
        return c.seq < seq
    own = (c.seq,) if c.seq is not None else (_normal_op(c.op), None)
    return own != key


def rule_straggler(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """Ranks wait in a collective that a live rank has not entered: name that rank."""
    f = facts or Facts(state, now, th)
    found = f.straggle
    if found is None or f.cascade.roots:
        return []
    if not found.culprits:
        return _all_waiting(f, found)
    culprits = sorted(found.culprits, key=lambda r: r.rank)
    waiting = sorted(r.rank for r in found.waiting)
    name = _collective_name(found.op, found.seq)
    first = culprits[0]
    subject = "it is" if len(culprits) == 1 else f"rank {first.rank} is"
    detail = f"{subject} {_where(first)}"
    if first.collective is not None:
        detail += f", inside {_collective_name(first.collective.op, first.collective.seq)}"
    message = (
        f"{format_ranks(r.rank for r in culprits)} "
        f"{_verb(len(culprits), 'has', 'have')} not entered {name} that "
        f"{format_ranks(waiting)} {_verb(len(waiting), 'has', 'have')} waited in for "
        f"{_seconds(found.age)}; {detail}"
    )
    hint = (
        f"see where rank {first.rank} is (its stack in ddpwatch status --json): a rank-dependent "
        f"branch, slow data loading or I/O, or a collective that not every rank calls keeps it "
        f"from {name}"
    )
    severity: Severity = "error" if found.age >= f.stall_after else "warning"
    return [_alert("straggler", severity, [r.rank for r in culprits], waiting, message, hint)]


def _all_waiting(facts: Facts, found: _Straggle) -> list[Alert]:
    """Every rank is inside the same collective and it does not finish."""
    live = facts.live
    if len(found.waiting) != len(live) or not _world_complete(facts.state, live):
        return []
    if len({_normal_op(r.collective.op) for r in live if r.collective}) > 1:
        return []  # different collectives at one sequence number: collective_mismatch
    age = min(r.collective_age(facts.now) or 0.0 for r in live)  # all have waited this long
    if age <= facts.stall_after:
        return []
    ranks = sorted(r.rank for r in live)
    name = _collective_name(found.op, found.seq)
    message = (
        f"all {len(ranks)} ranks have waited in {name} for {_seconds(age)} and none is "
        "missing from it"
    )
    hint = (
        "the collective itself does not complete: check the network (NCCL_DEBUG=INFO), "
        "NCCL_SOCKET_IFNAME / InfiniBand settings, and whether its process group includes "
        "a process that ddpwatch does not see"
    )
    return [_alert("stalled", "error", ranks, [], message, hint)]


def rule_collective_mismatch(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """Ranks in different collectives at the same sequence number, or a mismatch crash."""
    f = facts or Facts(state, now, th)
    alerts = _mismatch_from_crashes(f)
    by_seq: dict[int, dict[str, list[RankRecord]]] = defaultdict(lambda: defaultdict(list))
    for r in f.live:
        c = r.collective
        if c is not None and c.seq is not None:
            by_seq[c.seq][_normal_op(c.op)].append(r)
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
    return _alert("collective_mismatch", "error", culprits, waiting, message, hint)


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
        f"{_first_line(first.error.message)} — the ranks called different collectives, or "
        "the same one with different sizes"
    )
    signature = facts.signatures.get(first.rank)
    hint = signature.hint if signature else ""
    return [_alert("collective_mismatch", "error", ranks, [], message, hint)]


# --------------------------------------------------------------------------- progress


def rule_stalled(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """A training rank that stopped making progress outside any collective."""
    f = facts or Facts(state, now, th)
    stall_after = f.stall_after
    candidates = [
        r
        for r in f.live
        if r.step is not None and r.collective is None and now - r.last_progress > stall_after
    ]
    if not candidates or f.cascade.roots:
        return []
    found = f.straggle
    excluded = {r.rank for r in found.culprits} if found else set()
    stalled = [r for r in candidates if r.rank not in excluded]
    if not stalled:
        return []
    worst = min(stalled, key=lambda r: (r.last_progress, r.rank))
    ranks = sorted(r.rank for r in stalled)
    quiet = _seconds(now - worst.last_progress)
    phase = f" in phase '{worst.phase}'" if worst.phase else ""
    loc = _record_location(worst)
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
        f"look at rank {worst.rank}'s stack (ddpwatch status --json) or run {pid}: it may "
        "wait on data loading, I/O, a lock or a GPU kernel"
    )
    return [_alert("stalled", "error", ranks, [], message, hint)]


def _phase_index(record: RankRecord) -> int:
    """Startup order of the rank's phase; ranks that train count as past startup."""
    index = _PHASE_ORDER.get(record.phase, len(STARTUP_PHASES)) if record.phase else 0
    return max(index, len(STARTUP_PHASES) - 1) if record.step is not None else index


_PHASE_HINTS = {
    "started": "the rank has not reached init_process_group: it may be downloading or "
    "preparing data while the others wait; prepare data beforehand or only on rank 0 "
    "followed by a barrier",
    "rendezvous": "the ranks wait for each other in init_process_group: check that every "
    "rank started, WORLD_SIZE, and that MASTER_ADDR:MASTER_PORT is reachable",
    "setup": "the process group exists but the rank has not wrapped its model: it may be "
    "loading data or a checkpoint, or in a branch that only some ranks take",
    "device": "setting up the GPU hangs: check the GPU with nvidia-smi and "
    "CUDA_VISIBLE_DEVICES on that host",
    "model_wrap": "DistributedDataParallel(...) broadcasts rank 0's parameters and checks "
    "shapes: a rank that never gets there, or builds a different model, hangs the others",
    "configure_model": "the rank is in Lightning's configure_model or loads ckpt_path's "
    "weights: a model built differently on some ranks, or a slow checkpoint read, keeps the "
    "others waiting",
    "strategy_setup": "Lightning moves the model to its device, wraps it (DDP broadcasts rank "
    "0's parameters) and builds the optimizers: every rank must build the same model",
    "deepspeed_init": "deepspeed.initialize broadcasts the parameters and builds the optimizer: "
    "every rank must call it with the same model and config",
    "zero_partition": "ZeRO partitions parameters, gradients and optimizer states across the "
    "ranks: a rank with a different model, or missing from the process group, hangs the others",
    "fit_start": "on_fit_start hooks and restoring the training state from ckpt_path: a slow or "
    "rank-dependent on_fit_start, or reading a large checkpoint, keeps the others waiting",
    "sanity_check": "Lightning's sanity check runs validation batches before training: a "
    "validation_step that syncs (sync_dist, all_gather) on some ranks only hangs; "
    "num_sanity_val_steps=0 tells",
    "first_step": "the first step compiles and allocates; if it lasts, a collective that only "
    "some ranks call or a rank-dependent branch keeps the ranks apart",
}


def rule_startup_hang(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """Ranks stuck before their first step: name the ones furthest behind.

    Only ranks in a startup phase count as starting: a rank in 'train' or in a phase
    of its own ('forward', 'eval') is past startup even before its first step.
    """
    f = facts or Facts(state, now, th)
    live = f.live
    train = len(STARTUP_PHASES) - 1
    starting = [r for r in live if r.step is None and _phase_index(r) < train]
    if not starting:
        return []
    longest = max(now - (r.phase_since or r.first_seen) for r in starting)
    if longest <= th.startup_after:
        return []
    earliest = min(_phase_index(r) for r in starting)
    behind = sorted((r for r in starting if _phase_index(r) == earliest), key=lambda r: r.rank)
    ahead = sorted(r.rank for r in live if _phase_index(r) > earliest)
    missing = _missing_ranks(f.state)
    if missing and not ahead:
        return [_waiting_for_missing(missing, behind, longest)]
    if not ahead and min(now - (r.phase_since or r.first_seen) for r in behind) <= th.startup_after:
        return []  # the last rank has just joined the others: the phase is about to end
    first = behind[0]
    phase = first.phase or "started"
    culprits = sorted({r.rank for r in behind} | set(missing))
    own = max(now - (r.phase_since or r.first_seen) for r in behind)
    loc = _record_location(first)
    message = (
        f"{format_ranks(r.rank for r in behind)} {_verb(len(behind), 'is', 'are')} still in "
        f"'{phase}' after {_seconds(own)}" + (f" ({loc})" if loc else "")
    )
    if missing:
        message += f" and {format_ranks(missing)} never connected"
    if ahead:
        ahead_phase = Counter(
            r.phase or "started" for r in live if _phase_index(r) > earliest
        ).most_common(1)[0][0]
        message += (
            f" while {format_ranks(ahead)} {_verb(len(ahead), 'waits', 'wait')} in '{ahead_phase}'"
        )
    hint = _PHASE_HINTS.get(phase, "look at the stacks of the ranks furthest behind")
    severity: Severity = "error" if longest > 2 * th.startup_after else "warning"
    return [_alert("startup_hang", severity, culprits, ahead, message, hint)]


def _waiting_for_missing(missing: list[int], behind: list[RankRecord], longest: float) -> Alert:
    phase = behind[0].phase or "started"
    message = (
        f"{format_ranks(missing)} never connected while {format_ranks(r.rank for r in behind)} "
        f"{_verb(len(behind), 'has', 'have')} waited in '{phase}' for {_seconds(longest)}"
    )
    hint = (
        "start the missing ranks or fix their launch (nnodes x nproc_per_node must equal "
        "WORLD_SIZE); their own logs say why they did not come up"
    )
    return _alert("startup_hang", "error", missing, [r.rank for r in behind], message, hint)


def _missing_ranks(state: ServerState) -> list[int]:
    """Ranks below the reported world size that never sent anything."""
    size = state.world_size
    if size is None:
        return []
    return [rank for rank in range(min(size, MAX_WORLD)) if rank not in state.ranks]


def rule_not_connected(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """Ranks of the world that never reported, some time after the first one did."""
    f = facts or Facts(state, now, th)
    if not f.records:
        return []
    elapsed = now - min(r.first_seen for r in f.records)
    if elapsed <= th.connect_after:
        return []
    missing = _missing_ranks(f.state)
    if not missing:
        return []
    size = state.world_size
    message = (
        f"{format_ranks(missing)} of {size} {_verb(len(missing), 'has', 'have')} not connected "
        f"{_seconds(elapsed)} after the first rank did"
    )
    hint = (
        "check that those ranks started (launcher log; nnodes x nproc_per_node = WORLD_SIZE), "
        "that they call ddpwatch.attach(), and that they can reach the ddpwatch server"
    )
    severity: Severity = "error" if elapsed > th.startup_after else "warning"
    waiting = [r.rank for r in f.live if r.step is None]
    return [_alert("not_connected", severity, missing, waiting, message, hint)]


def rule_step_skew(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """Training ranks far apart in step count: they are not really in lockstep."""
    f = facts or Facts(state, now, th)
    stall_after = f.stall_after
    ranks = [r for r in f.live if r.step is not None and now - r.last_progress <= stall_after]
    if len(ranks) < 2:
        return []
    # Heartbeats sample steps at different moments: allow what the fastest plausible step
    # rate covers in one interval. The latest step time, not only the average, because an
    # average still includes a pause the job has just recovered from.
    times = [
        t
        for t in (
            _median(r.step_time_s for r in ranks),
            _median(r.avg_step_time_s for r in ranks),
        )
        if t is not None
    ]
    if not times:
        return []
    allowed = 3 + (th.interval + 0.5) / min(times)
    lead = max(ranks, key=lambda r: (r.step or 0, -r.rank))
    top = lead.step or 0
    behind = sorted((r for r in ranks if (r.step or 0) < top - allowed), key=lambda r: r.rank)
    if not behind:
        return []
    last = min(behind, key=lambda r: (r.step or 0, r.rank))
    gap = top - (last.step or 0)
    who = format_ranks(r.rank for r in behind)
    message = (
        f"{who} {_verb(len(behind), 'is', 'are')} up to {gap} steps behind rank {lead.rank} "
        f"(step {last.step} against {top}); ranks in lockstep differ by at most {allowed:.0f}"
    )
    hint = (
        "DDP keeps ranks in lockstep, so a growing gap means they do not synchronise: check "
        "that the model is wrapped in DistributedDataParallel on every rank and that all "
        "ranks use the same process group"
    )
    return [_alert("step_skew", "warning", [r.rank for r in behind], [], message, hint)]


def rule_slow_rank(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """The rank the others wait for every step: its own collective wait is far shorter.

    Conservative on purpose: a healthy job must stay silent, so the slow rank must
    stand out clearly and collectives must be a real share of the step.
    """
    f = facts or Facts(state, now, th)
    stall_after = f.stall_after
    ranks = [
        r
        for r in f.live
        if r.avg_step_time_s is not None
        and r.collective_time_s is not None
        and (r.collective is not None or now - r.last_progress <= stall_after)
    ]
    if len(ranks) < 3:
        return []
    step = statistics.median(r.avg_step_time_s or 0.0 for r in ranks)
    wait = statistics.median(r.collective_time_s or 0.0 for r in ranks)
    if step <= 0 or wait < 0.2 * step or wait < 0.005:
        return []
    slow = sorted(
        (r for r in ranks if (r.collective_time_s or 0.0) < 0.25 * wait), key=lambda r: r.rank
    )
    if not slow or len(slow) > max(1, len(ranks) // 4):
        return []
    slowest = min(slow, key=lambda r: (r.collective_time_s or 0.0, r.rank))
    lost_ms = (wait - (slowest.collective_time_s or 0.0)) * 1000
    who = format_ranks(r.rank for r in slow)
    message = (
        f"{who} {_verb(len(slow), 'is', 'are')} the slowest: the other ranks wait "
        f"{lost_ms:.0f} ms per step for {_verb(len(slow), 'it', 'them')} in collectives"
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
    return [_alert("slow_rank", "warning", [r.rank for r in slow], [], message, hint)]


def rule_nan_loss(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """A loss that became nan or inf, and whether the other ranks are still finite."""
    f = facts or Facts(state, now, th)
    bad = sorted((r for r in f.records if r.nan_step is not None), key=lambda r: r.rank)
    if not bad:
        return []
    finite = [
        r.rank
        for r in f.records
        if r.nan_step is None and r.loss is not None and math.isfinite(r.loss)
    ]
    values = {
        "nan" if math.isnan(r.loss) else "inf"
        for r in bad
        if r.loss is not None and not math.isfinite(r.loss)
    }
    word = values.pop() if len(values) == 1 else "not finite"
    since = min(r.nan_step or 0 for r in bad)
    # DDP averages gradients, so one rank's nan reaches every rank a step later: the
    # ranks that went bad first are the culprits, the later ones only followed.
    first = [r.rank for r in bad if r.nan_step == since]
    later = [r for r in bad if r.nan_step != since]
    message = f"{format_ranks(first)} loss is {word} since step {since}"
    if later:
        then = min(r.nan_step or 0 for r in later)
        message += f" and {format_ranks(r.rank for r in later)} followed from step {then}"
    if finite:
        message += f" while {format_ranks(finite)} {_verb(len(finite), 'is', 'are')} finite"
    if finite or later:
        hint = (
            f"look for a bad sample or shard in the data of {format_ranks(first)} at step "
            f"{since}; torch.autograd.set_detect_anomaly(True) finds the first bad operation"
        )
    else:
        hint = (
            "lower the learning rate, clip gradients, check for log(0) or division by zero, "
            "or use torch.autograd.set_detect_anomaly(True) to find the first bad operation"
        )
    return [_alert("nan_loss", "error", first, [r.rank for r in later], message, hint)]


def rule_checkpoint_conflict(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """Several ranks writing the same checkpoint file overwrite each other."""
    f = facts or Facts(state, now, th)
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
    return [_alert("checkpoint_conflict", "warning", culprits, [], message, hint)]


# --------------------------------------------------------------------------- devices and memory


def _device_key(record: RankRecord) -> tuple | None:
    """The physical GPU a rank uses, as far as can be told, or None for CPU ranks."""
    if not record.host:
        return None
    if record.device_uuid:
        return (record.host, "uuid", record.device_uuid)
    device = record.device
    if not device or not device.startswith("cuda"):
        return None
    return (record.host, *_physical_gpu(device, record.device_index, record.cuda_visible_devices))


@lru_cache(maxsize=4096)
def _physical_gpu(device: str, index: int | None, visible_devices: str | None) -> tuple[str, str]:
    """Map a CUDA ordinal through CUDA_VISIBLE_DEVICES (cuda:0 under "1" is physical GPU 1)."""
    if index is None and ":" in device:
        tail = device.split(":", 1)[1]
        index = int(tail) if tail.isdigit() else None
    visible = [v.strip() for v in (visible_devices or "").split(",") if v.strip()]
    if index is not None and index < len(visible):
        return ("visible", visible[index])
    return ("device", device if index is None else f"cuda:{index}")


def _duplicate_groups(live: Sequence[RankRecord]) -> list[list[RankRecord]]:
    groups: dict[tuple, list[RankRecord]] = defaultdict(list)
    for r in live:
        if r.device_uuid or (r.device and r.device.startswith("cuda")):
            key = _device_key(r)
            if key is not None:
                groups[key].append(r)
    return [sorted(g, key=lambda r: r.rank) for g in groups.values() if len(g) > 1]


def _duplicate_culprits(group: list[RankRecord]) -> list[RankRecord]:
    """The members whose GPU is not cuda:<local rank>, when that tells them apart."""
    odd = [r for r in group if r.local_rank is not None and r.device_index != r.local_rank]
    return odd if 0 < len(odd) < len(group) else group


def rule_duplicate_device(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """Two or more ranks on one GPU (NCCL refuses it; with gloo it silently halves speed)."""
    f = facts or Facts(state, now, th)
    alerts = []
    groups = f.duplicate_groups
    if groups:
        culprits = sorted({r.rank for g in groups for r in _duplicate_culprits(g)})
        first = groups[0]
        gpu = first[0].device_uuid or first[0].device or "one GPU"
        message = f"{format_ranks(r.rank for r in first)} share GPU {gpu} on host {first[0].host}"
        if len(groups) > 1:
            message += f", and {len(groups) - 1} more GPUs are shared by several ranks"
        alerts.append(_alert("duplicate_device", "error", culprits, [], message, _DUP_HINT))
    crashed = f.crashes_of_kind("duplicate_device")
    if crashed:
        ranks = {r.rank for r in crashed}
        for r in crashed:
            assert r.error is not None
            for a, b in _DUPLICATE_PAIR.findall(r.error.message):
                ranks.update((int(a), int(b)))
        error = crashed[0].error
        assert error is not None
        pair = _DUPLICATE_PAIR.search(error.message)
        message = f"{format_ranks(ranks)} use the same GPU: NCCL reported " + (
            f"'{pair.group(0)}'" if pair else f"'{_first_line(error.message)}'"
        )
        alerts.append(_alert("duplicate_device", "error", sorted(ranks), [], message, _DUP_HINT))
    return alerts


_DUP_HINT = (
    "call torch.cuda.set_device(local_rank) before init_process_group (LOCAL_RANK from the "
    "environment) and check CUDA_VISIBLE_DEVICES: each rank needs its own GPU"
)


def _ordinal_suspects(live: Sequence[RankRecord]) -> list[RankRecord]:
    """Live ranks that use their global rank as the CUDA index where that is wrong."""
    found = []
    for r in live:
        if not (r.device or "").startswith("cuda") or r.local_rank is None:
            continue
        if r.device_index != r.rank or r.rank == r.local_rank:
            continue
        multi_node = bool(r.world_size and r.local_world_size and r.world_size > r.local_world_size)
        if multi_node or (r.device_count is not None and r.rank >= r.device_count):
            found.append(r)
    return found


def _local_rank_clause(records: list[RankRecord]) -> str:
    known = [r for r in records if r.local_rank is not None]
    if not known:
        return "LOCAL_RANK from the environment"
    if len(records) == 1:
        return f"LOCAL_RANK is {known[0].local_rank} on this rank"
    listed = ", ".join(f"{r.local_rank} on rank {r.rank}" for r in known[:3])
    return f"LOCAL_RANK is {listed}" + (", …" if len(known) > 3 else "")


def rule_device_ordinal(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """The global rank used as a CUDA device index: crashes on the second node."""
    f = facts or Facts(state, now, th)
    crashed = f.crashes_of_kind("device_ordinal")
    suspects = f.ordinal_suspects
    records = sorted({r.rank: r for r in crashed + suspects}.values(), key=lambda r: r.rank)
    if not records:
        return []
    parts = []
    if crashed:
        first = crashed[0]
        assert first.error is not None
        parts.append(
            f"{format_ranks(r.rank for r in crashed)} crashed with {first.error.type}: "
            f"{_first_line(first.error.message)} — the global rank was used as the CUDA "
            f"device index{_gpus_on(first)}"
        )
    live = [r for r in suspects if r.error is None]
    if live:
        first = live[0]
        parts.append(
            f"{format_ranks(r.rank for r in live)} {_verb(len(live), 'uses', 'use')} the global "
            f"rank as the CUDA device (rank {first.rank} on cuda:{first.device_index} with "
            f"local rank {first.local_rank}){_gpus_on(first)}"
        )
    message = "; ".join(parts)
    hint = (
        f"use torch.cuda.set_device(local_rank) — {_local_rank_clause(records)} — "
        "not the global rank"
    )
    return [_alert("device_ordinal", "error", [r.rank for r in records], [], message, hint)]


def _gpus_on(record: RankRecord) -> str:
    if record.device_count is None:
        return ""
    return f"; host {record.host or '?'} has {record.device_count} GPUs"


def rule_local_rank_mismatch(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """A rank on a GPU other than cuda:<local rank> (often all ranks on cuda:0)."""
    f = facts or Facts(state, now, th)
    flagged = {r.rank for g in f.duplicate_groups for r in _duplicate_culprits(g)}
    flagged |= {r.rank for r in f.ordinal_suspects}
    odd = sorted(
        (
            r
            for r in f.live
            if (r.device or "").startswith("cuda")
            and (r.device_count or 0) > 1
            and r.local_rank is not None
            and r.device_index is not None
            and r.device_index != r.local_rank
            and r.rank not in flagged
        ),
        key=lambda r: r.rank,
    )
    if not odd:
        return []
    first = odd[0]
    message = (
        f"{format_ranks(r.rank for r in odd)} {_verb(len(odd), 'uses', 'use')} a GPU other than "
        f"cuda:<local rank> (rank {first.rank} is on cuda:{first.device_index} with local "
        f"rank {first.local_rank})"
    )
    hint = (
        "call torch.cuda.set_device(local_rank) before creating tensors or the model; if the "
        "mapping is intended, ignore this"
    )
    return [_alert("local_rank_mismatch", "warning", [r.rank for r in odd], [], message, hint)]


def rule_uneven_memory(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """A rank that uses far more GPU memory than the others (often rank 0)."""
    f = facts or Facts(state, now, th)
    live = f.live
    used = [(r, r.gpu_mem_used_bytes) for r in live if r.gpu_mem_used_bytes is not None]
    if not used:
        used = [(r, r.mem_reserved_bytes) for r in live if r.mem_reserved_bytes is not None]
    if len(used) < 2:
        return []
    median = statistics.median(float(v or 0) for _, v in used)
    heavy = sorted(
        (
            (r, float(v or 0))
            for r, v in used
            if (v or 0) > 1.5 * median and (v or 0) - median >= GIB
        ),
        key=lambda item: item[0].rank,
    )
    if not heavy:
        return []
    top, value = max(heavy, key=lambda item: (item[1], -item[0].rank))
    ratio = f"{value / median:.1f}x" if median > 0 else "far above"
    if len(heavy) == 1:
        amount = f"rank {top.rank} uses {_gib(value)} of GPU memory"
    else:
        who = format_ranks(r.rank for r, _ in heavy)
        amount = f"{who} use up to {_gib(value)} of GPU memory (rank {top.rank})"
    message = f"{amount}, {ratio} the median {_gib(median)}"
    hint = (
        "the heavy rank holds extra tensors (metrics, evaluation, gathered outputs, checkpoint "
        "state) or other ranks create a CUDA context on its GPU: call "
        "torch.cuda.set_device(local_rank) early and use map_location when loading checkpoints"
    )
    return [_alert("uneven_memory", "warning", [r.rank for r, _ in heavy], [], message, hint)]


def rule_foreign_memory(
    state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
) -> list[Alert]:
    """Processes that are not ranks of this job hold memory on a rank's GPU."""
    f = facts or Facts(state, now, th)
    pids: dict[str, set[int]] = defaultdict(set)
    for r in f.records:
        if r.host and r.pid is not None:
            pids[r.host].add(r.pid)
    reporting = [r for r in f.live if r.host and r.gpu_pids]
    # Inside containers NVML may report host pids that never match the ranks' own pids;
    # only judge hosts where at least one rank finds itself in its GPU's list.
    comparable = {r.host for r in reporting if r.pid is not None and r.pid in (r.gpu_pids or [])}
    culprits: list[RankRecord] = []
    foreign: set[int] = set()
    for r in reporting:
        known = pids[r.host or ""]
        if r.host not in comparable or known.issuperset(r.gpu_pids or ()):
            continue
        culprits.append(r)
        foreign.update(p for p in r.gpu_pids or () if p not in known)
    if not culprits:
        return []
    culprits.sort(key=lambda r: r.rank)
    listed = ", ".join(str(p) for p in sorted(foreign)[:MAX_LISTED])
    if len(foreign) > MAX_LISTED:
        listed += f" and {len(foreign) - MAX_LISTED} more"
    owner = (
        f"the GPU of rank {culprits[0].rank} ({culprits[0].device or 'cuda'} on {culprits[0].host})"
        if len(culprits) == 1
        else f"the GPUs of {format_ranks(r.rank for r in culprits)}"
    )
    message = (
        f"{owner} also {_verb(len(culprits), 'holds', 'hold')} "
        f"{_verb(len(foreign), 'process', 'processes')} {listed} that "
        f"{_verb(len(foreign), 'is not a rank', 'are not ranks')} of this job"
    )
    hint = (
        "another job or a leftover process (an earlier run, a notebook) holds memory on this "
        "GPU: check nvidia-smi and stop it or use other GPUs; note that pids inside "
        "containers differ from the host's"
    )
    return [_alert("foreign_memory", "warning", [r.rank for r in culprits], [], message, hint)]


# --------------------------------------------------------------------------- entry point


def _alert(
    kind: str,
    severity: Severity,
    ranks: Iterable[int],
    waiting: Iterable[int],
    message: str,
    hint: str,
) -> Alert:
    culprits = tuple(sorted(set(ranks)))
    return Alert(
        kind=kind,
        severity=severity,
        ranks=culprits,
        waiting=tuple(sorted(set(waiting) - set(culprits))),
        message=message,
        hint=hint,
    )


RULES: tuple[Rule, ...] = (
    rule_cascade,
    rule_clean_exit,
    rule_straggler,
    rule_collective_mismatch,
    rule_stalled,
    rule_startup_hang,
    rule_not_connected,
    rule_duplicate_device,
    rule_device_ordinal,
    rule_local_rank_mismatch,
    rule_uneven_memory,
    rule_foreign_memory,
    rule_step_skew,
    rule_nan_loss,
    rule_checkpoint_conflict,
    rule_slow_rank,
)


def _sort_key(alert: Alert) -> tuple[int, str, tuple[int, ...]]:
    return (_SEVERITY_ORDER.get(alert.severity, 3), alert.kind, alert.ranks)


def diagnose(state: ServerState, now: float, th: Thresholds) -> list[Alert]:
    """Every rule's alerts, one per (kind, culprits), most severe first."""
    facts = Facts(state, now, th)
    alerts = sorted((a for rule in RULES for a in rule(state, now, th, facts)), key=_sort_key)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    unique = []
    for alert in alerts:
        if alert.key not in seen:
            seen.add(alert.key)
            unique.append(alert)
    return unique
