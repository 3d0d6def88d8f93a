"""A run's figures, worked out once: how long it ran, each rank's median step, who waited and
the time lost. The end-of-run summary, the verdict, ``ddpwatch status``, the report and the
dashboard's end state all quote these, so a user who pastes any of them into a bug report
pastes the same numbers (#33: "ran 2 min 9 s" in the summary, "ran 2 min 50 s" in the report).

A pure function of the status document:

- the run lasts from the first report (``job_started``) to its last rank's end where every
  rank that reported has ended (or fell silent while the others ended: the last word heard
  from it), else to the document's time: a watch that outlived its job does not lengthen
  the run;
- a rank's median step is the server's (``median_step_s``: every step it timed, one step one
  vote, not one heartbeat one vote);
- the time lost is what the waiting ranks waited for a culprit: while it straggled, stalled or
  was frozen (``straggler``, ``stalled``, and a ``silent`` it came back from: their spells
  merged, so one stop that raised both is counted once), and while it was slower than them
  every step (``slow_rank``: its episode's length times the share of their step they waited,
  ``lost_share``).
"""

from __future__ import annotations

import math
import statistics
from collections.abc import Sequence
from dataclasses import dataclass, field

from ddpwatch.core.vocabulary import AlertKind, RankState
from ddpwatch.diagnosis.episodes import Episode, episodes
from ddpwatch.diagnosis.text import format_ranks
from ddpwatch.status.fmt import duration
from ddpwatch.status.order import median_steps
from ddpwatch.status.schema import StatusDocument, TimeLost

HOLDING = frozenset(
    {
        AlertKind.STRAGGLER,
        AlertKind.STALLED,
        AlertKind.CONFIG_MISMATCH,
        AlertKind.SEND_RECV_DEADLOCK,
    }
)
"""Alert kinds whose culprit holds the ``waiting`` ranks up (a rank whose rendezvous values
differ holds the others in ``init_process_group``; one whose send is missing, the rank blocked
in its receive and every rank in the collective that one must enter)."""
SLOWING = frozenset({AlertKind.SLOW_RANK})
"""Warning kinds whose culprit the others waited for every step, the job running on."""


@dataclass(frozen=True)
class Lost:
    """One culprit's account (several ranks for a ``slow_rank`` about several): how often and
    how long the others waited for it."""

    ranks: tuple[int, ...]
    waiting: tuple[int, ...]
    times: int  # the spells it held them up (0: it was only slow)
    held_s: float  # they waited while it straggled, stalled or was frozen
    phases: tuple[str, ...] = ()
    stopped: bool = False  # at least once it stopped making progress (``stalled``)
    slow_s: float = 0.0  # how long it was slower than them every step
    slowed_s: float | None = None  # what that cost them; None where no alert said

    @property
    def rank(self) -> int:
        return self.ranks[0]

    @property
    def seconds(self) -> float:
        """Every second the others waited for it."""
        return self.held_s + (self.slowed_s or 0.0)

    def entry(self, run_s: float | None) -> TimeLost:
        """The account as the status document and the report write it, in words too
        (``lost_text``: its share of a run of ``run_s``)."""
        return TimeLost(
            ranks=list(self.ranks),
            waiting=list(self.waiting),
            times=self.times,
            held_s=self.held_s,
            phases=list(self.phases),
            stopped=self.stopped,
            slow_s=self.slow_s,
            slowed_s=self.slowed_s,
            rank=self.rank,
            seconds=self.seconds,
            text=lost_text(self, run_s),
        )


def time_lost(found: Sequence[Episode], end_s: float) -> list[Lost]:
    """Per culprit, what the others waited for it, most first (see the module's words)."""
    spells: dict[int, list[tuple[float, float, Episode]]] = {}
    slow: dict[tuple[int, ...], list[Episode]] = {}
    for e in found:
        if e.kind in SLOWING and e.ranks:
            slow.setdefault(e.ranks, []).append(e)
        elif len(e.ranks) == 1 and e.waiting:
            span = _spell(e, end_s)
            if span is not None:
                spells.setdefault(e.ranks[0], []).append((*span, e))
    accounts: dict[tuple[int, ...], Lost] = {}
    for rank, found_spells in spells.items():
        held = [e for *_, e in found_spells if e.kind in HOLDING]
        merged = _merged([(start, end) for start, end, _ in found_spells])
        accounts[(rank,)] = Lost(
            ranks=(rank,),
            waiting=tuple(sorted({r for *_, e in found_spells for r in e.waiting})),
            times=_holds(found_spells),
            held_s=sum(end - start for start, end in merged),
            phases=tuple(dict.fromkeys(e.phase for e in held if e.phase)),
            stopped=any(AlertKind.STALLED in (e.kind, e.first_kind) for e in held),
        )
    for ranks, slow_episodes in slow.items():
        up = sum(e.duration_s(end_s) for e in slow_episodes)
        costs = [e.duration_s(end_s) * e.lost_share for e in slow_episodes if e.lost_share]
        waiting = {r for e in slow_episodes for r in e.waiting}
        before = accounts.get(ranks) or Lost(ranks, (), 0, 0.0)
        accounts[ranks] = Lost(
            ranks=ranks,
            waiting=tuple(sorted(waiting | set(before.waiting))),
            times=before.times,
            held_s=before.held_s,
            phases=before.phases,
            stopped=before.stopped,
            slow_s=up,
            slowed_s=sum(costs) if costs else None,
        )
    return sorted(accounts.values(), key=lambda a: (-a.seconds, a.ranks))


def _spell(e: Episode, end_s: float) -> tuple[float, float] | None:
    """When the waiting ranks waited in one episode (job seconds): a hold's last measured
    wait, carried on to its end; a silence the rank came back from, while it lasted."""
    end = e.cleared_s if e.cleared_s is not None else end_s
    if e.kind in HOLDING:
        return (end - e.wait_s(end_s), end)
    if e.kind == AlertKind.SILENT and e.cleared_s is not None and e.closed_by is None:
        return (e.raised_s, e.cleared_s)
    return None


def _holds(spells: list[tuple[float, float, Episode]]) -> int:
    """How many times a rank held the others up: its spells, overlapping ones of different
    kinds as one (a frozen rank raises ``silent`` and then ``straggler``: one hold). Two
    episodes of one kind are two holds even where their spans touch: the tracker keeps a
    hold that goes on as one episode, and a wait measured only to a heartbeat's half second
    runs into the next when the rank lets the others go for less than that (seen: three
    evaluations 0.3 s apart counted as two)."""
    count, end, kinds = 0, -math.inf, set[str]()
    for start, stop, e in sorted(spells, key=lambda spell: spell[:2]):
        if start <= end and e.kind not in kinds:
            kinds.add(e.kind)
            end = max(end, stop)
        else:
            count, end, kinds = count + 1, stop, {e.kind}
    return count


def _merged(spans: list[tuple[float, float]]) -> list[tuple[float, float]]:
    """Overlapping spans as one: a frozen rank raises ``silent`` and then ``straggler``."""
    out: list[tuple[float, float]] = []
    for start, end in sorted(spans):
        if out and start <= out[-1][1]:
            out[-1] = (out[-1][0], max(out[-1][1], end))
        else:
            out.append((start, end))
    return out


def lost_text(account: Lost, run_s: float | None) -> str:
    """One culprit's account in words: "rank 0 held ranks 1, 2 up 3 times, 1 min 25 s in all
    (87 % of a 1 min 38 s run), in 'eval'"; "rank 2 was slower than ranks 0, 1 for 2 min:
    they waited for it every step, 50.0 s in all (39 % of a 2 min 9 s run) (slow_rank)"."""
    parts = []
    them = format_ranks(account.waiting) if account.waiting else "the others"
    if account.times:
        times = "once" if account.times == 1 else f"{account.times} times"
        text = f"rank {account.rank} held {them} up {times}, "
        text += f"{duration(account.held_s)}{' in all' if account.times > 1 else ''}"
        text += _share(account.held_s, run_s)
        if account.phases:
            text += ", in " + ", ".join(f"'{p}'" for p in account.phases)
        if account.stopped:
            text += "; it stopped making progress"
        parts.append(text)
    if account.slow_s:
        one = len(account.ranks) == 1
        text = (
            f"{format_ranks(account.ranks)} {'was' if one else 'were'} slower than {them} for "
            f"{duration(account.slow_s)}: they waited for {'it' if one else 'them'} every step"
        )
        if account.slowed_s is not None:
            text += f", {duration(account.slowed_s)} in all{_share(account.slowed_s, run_s)}"
        parts.append(f"{text} ({AlertKind.SLOW_RANK})")
    return "; ".join(parts)


def _share(seconds: float, run_s: float | None) -> str:
    if not run_s:
        return ""
    return f" ({min(100.0, 100.0 * seconds / run_s):.0f} % of a {duration(run_s)} run)"


# ------------------------------------------------------------------------------ a document


@dataclass(frozen=True)
class Figures:
    """A run's figures, as every output quotes them."""

    run_s: float | None  # how long it ran; None without a job clock
    end_s: float  # where open episodes end (job seconds): ``run_s``, else the last raise
    medians: dict[int, float]  # each rank's median step (seconds), ranks that timed one
    lost: tuple[Lost, ...]  # per culprit, most first
    episodes: tuple[Episode, ...] = field(repr=False, default=())

    @property
    def median_step_s(self) -> float | None:
        """The job's median step: the ranks' medians' median (DDP evens them out)."""
        return statistics.median(self.medians.values()) if self.medians else None

    @property
    def lost_s(self) -> float:
        """Every second lost waiting, added up over the culprits."""
        return sum(a.seconds for a in self.lost)

    @property
    def waited(self) -> tuple[int, ...]:
        """Every rank that waited for a culprit."""
        return tuple(sorted({r for a in self.lost for r in a.waiting}))


def figures(document: StatusDocument) -> Figures:
    """The figures of the run a status document tells."""
    started = math.nan if document.job_started is None else document.job_started
    end = run_end(document)
    run_s = end - started if math.isfinite(started) and math.isfinite(end) else None
    now_s = document.server_time - started if math.isfinite(started) else None
    found = episodes(document.history, document.alerts, now_s)
    end_s = run_s if run_s is not None else max((e.raised_s for e in found), default=0.0)
    medians = median_steps(document.ranks)
    return Figures(run_s, end_s, medians, tuple(time_lost(found, end_s)), tuple(found))


def run_end(document: StatusDocument) -> float:
    """When the run ended (unix seconds): where every rank that reported has ended, or fell
    silent while others ended (killed: no word of its end can come), the last end or the
    last word heard from a silent one; else the document's time (the watch ended with ranks
    still running, or all of them silent: they may come back)."""
    seen = [r for r in document.ranks if r.state != RankState.NOT_CONNECTED]
    ended = [r.ended_at for r in seen if r.ended_at is not None]
    if not ended:
        return document.server_time
    for r in seen:
        if r.ended_at is not None:
            continue
        if r.state != RankState.SILENT or r.last_seen_s is None:
            return document.server_time
        ended.append(document.server_time - r.last_seen_s)
    return max(ended)
