"""How a run ended, as one true account: what ended the job, which ranks finished, who held
the others up and for how long. The summary, the report and the dashboard's end state all
read it, so they tell the same story.

A pure function of the status document: its ``history`` (every alert episode in time order,
``diagnosis/history.py``), how each rank ended (``ranks``: ``state``, ``exit_code``,
``ended_at``, ...), the attempts its launcher restarted it after (``attempts``) and what the
``ddpwatch run`` that launched it knew of its end (``job_end``, ``job_end.py``): a job the user
stopped is judged up to the stop, and a job that never started says why. It judges
from the whole run, not from the last state: an alert that cleared still happened, a rank
that exited 0 after its work finished (it did not fail), and the failure that ended the job
is the first rank to fail, in time, that the live diagnosis named as a cause, not the first
alert raised (a NaN loss an hour earlier did not end it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

from ddpwatch.core.protocol import ErrorInfo
from ddpwatch.core.vocabulary import AlertKind, RankState, Severity
from ddpwatch.diagnosis.episodes import Episode as Episode  # the outputs read it here
from ddpwatch.diagnosis.figures import (
    HOLDING,
    SLOWING,
    Figures,
    Lost,
    figures,
    lost_text,
    time_lost,
)
from ddpwatch.diagnosis.job_end import Stop, not_started_of, stop_of
from ddpwatch.diagnosis.knowledge import WAIT_NAMES, explain_error
from ddpwatch.diagnosis.text import format_ranks
from ddpwatch.status.fmt import duration, elapsed
from ddpwatch.status.order import severity_level
from ddpwatch.status.schema import (
    AttemptVerdict,
    RankEntry,
    RankError,
    StatusDocument,
    Verdict,
)

ENDINGS = frozenset({AlertKind.CRASHED, AlertKind.EXITED, AlertKind.SILENT})
"""Alert kinds that name a rank whose process failed: the candidates for what ended a job."""
CAUSES = ENDINGS | {AlertKind.COLLECTIVE_MISMATCH}
"""Error kinds whose culprit, once it failed, is the cause of the failures after it."""
ABSENCES = frozenset({AlertKind.NOT_CONNECTED, AlertKind.STARTUP_HANG})
"""Error kinds about a rank that never came: the others' failures waiting for it are its."""
_TERM_SIGNALS = frozenset({"SIGTERM", "SIGINT", "SIGHUP"})


HeldUp = Lost
"""One culprit's account of the time lost (``figures.Lost``: holds and slow steps)."""
held_up = time_lost
held_up_text = lost_text


# ------------------------------------------------------------------------------ the verdict


class Outcome(NamedTuple):
    """How one rank's process ended, in words, and whether that is a failure (a tuple: one
    is made per rank each time a document is judged, 65,536 at a time)."""

    rank: int
    word: str  # finished, crashed, exited, killed, stopped, silent, running, absent, held,
    # interrupted (it ended, or ran on, after the user stopped the job: the stop's doing)
    failed: bool
    ended_at: float | None
    text: str  # "crashed with RuntimeError (boom)", "exited with code 3", ...
    waited: bool = False  # its error only says it waited for, or lost, another rank
    mismatched: bool = False  # its error says a collective's calls did not match


def outcome(rank: RankEntry) -> Outcome:
    """What a rank entry of the status document says about how its process ended."""
    number, state, ended_at = rank.rank, rank.state, rank.ended_at
    code, signal = rank.exit_code, rank.exit_signal
    if state == RankState.CRASHED:
        error = rank.error or RankError(type="")
        text = f"crashed with {error.type}" if error.type else "crashed"
        message = " ".join(error.message.split())
        if message:
            text += f" ({message[:120]}{'…' if len(message) > 120 else ''})"
        found = explain_error(ErrorInfo(error.type, error.message, error.traceback))
        waited = found is not None and (found.peer_failure or found.name in WAIT_NAMES)
        mismatched = found is not None and found.family == AlertKind.COLLECTIVE_MISMATCH
        return Outcome(number, "crashed", True, ended_at, text, waited, mismatched)
    if state == RankState.STOPPED:
        how = signal or (f"code {code}" if code is not None else "a signal")
        return Outcome(number, "stopped", False, ended_at, f"was stopped ({how})")
    if state == RankState.EXITED:
        if signal and signal not in _TERM_SIGNALS:
            return Outcome(number, "killed", True, ended_at, f"was killed by {signal}")
        if code not in (0, None):
            return Outcome(number, "exited", True, ended_at, f"exited with code {code}")
        return Outcome(number, "finished", False, ended_at, "finished (exit 0)")
    if state == RankState.SILENT:
        return Outcome(number, "silent", True, ended_at, "fell silent")
    if state == RankState.NOT_CONNECTED:
        return Outcome(number, "absent", False, None, "never reported")
    return Outcome(number, "running", False, None, "was still running")


@dataclass(frozen=True)
class Account:
    """One attempt of the job, judged: the sentence and what it rests on."""

    attempt: int
    text: str
    ending: Outcome | None  # the failure that ended it, if one did
    held: tuple[HeldUp, ...]
    episodes: tuple[Episode, ...]

    @property
    def named(self) -> frozenset[int]:
        """Every rank the verdict blames for something: the one whose failure ended the job,
        the ones that held the others up, the culprits of its other errors."""
        ranks = {r for a in self.held for r in a.ranks}
        ranks.update(
            r
            for e in self.episodes
            if e.severity == Severity.ERROR or e.kind in SLOWING
            for r in e.ranks
        )
        if self.ending is not None:
            ranks.add(self.ending.rank)
        return frozenset(ranks)


def judge(
    ranks: Sequence[RankEntry],
    found: Sequence[Episode],
    run_s: float | None,
    end_s: float,
    attempt: int = 1,
    *,
    stop: Stop | None = None,
    not_started: str | None = None,
    live: bool = False,
) -> Account:
    """One attempt's verdict from its ranks' endings and its alert episodes. ``stop``: the
    user stopped the job (``job_end.py``): what ended and what was raised after it is the
    stop's doing. ``not_started``: why the job never started, where no rank reported.
    ``live``: judged while the watch goes on (the status document's own ``verdict``), so a
    rank still running "is running", not "was still running when the watch ended"."""
    outcomes = {o.rank: o for o in map(outcome, ranks)}
    if stop is not None:
        found = [e for e in found if stop.at_s is None or e.raised_s < stop.at_s]
        outcomes = {r: _under_stop(o, stop, found) for r, o in outcomes.items()}
    seen = [o for o in outcomes.values() if o.word != "absent"]
    held = held_up(found, end_s)
    if not seen:
        text = f"the job did not start: {not_started}" if not_started else "no rank reported"
        return Account(attempt, text, None, tuple(held), tuple(found))
    ending = _what_ended(outcomes, found)
    parts: list[str] = []
    if ending is not None:
        parts.append(_ending_text(ending, outcomes, found, ranks, stop))
    else:
        parts.append(_no_failure_text(seen, found, stop, live))
    steps = {r.rank: _first_bad(r) for r in ranks}
    before = _other_problems(found, held, ending, run_s, end_s, steps)
    if before:
        parts.append(("before that: " if ending is not None else "") + "; ".join(before))
    elif ending is None:
        parts.append("no problems seen")
    return Account(attempt, "; ".join(parts), ending, tuple(held), tuple(found))


def _under_stop(o: Outcome, stop: Stop, found: Sequence[Episode]) -> Outcome:
    """A rank's outcome once the user stopped the job: one that ended after the stop, or
    never said it ended, was stopped by it (a ``KeyboardInterrupt``, a SIGTERM, a lost peer),
    unless it had finished, or fell silent before the stop (its failure is its own)."""
    if o.word in ("finished", "absent"):
        return o
    if o.ended_at is not None and o.ended_at < stop.at:
        return o
    if o.word == "silent" and o.rank in _named(found, frozenset({AlertKind.SILENT})):
        return o
    return Outcome(o.rank, "interrupted", False, o.ended_at, "was stopped with the job")


def _what_ended(outcomes: dict[int, Outcome], found: Sequence[Episode]) -> Outcome | None:
    """What ended the job, None when no rank failed. In order of evidence:

    1. the first failure, in time, of a rank an error named as a cause (a crash, an exit, a
       kill, silence, a collective the others did not call), whose own error is not only a
       victim's (a timeout waiting for others, a lost peer);
    2. a rank that never reported, named by an alert (a warning will do), when others failed
       (they waited for it);
    3. the first failure of a rank an error named; 4. the first failure that is not only a
       victim's; 5. the first failure.

    A rank that exited 0 fails only where an ending error named it: it left while the others
    still needed it (so does one stopped from outside, alone, that the others waited for)."""
    named = _named(found, CAUSES)
    failed = [o for o in outcomes.values() if o.failed]
    early = [
        Outcome(o.rank, o.word, True, o.ended_at, f"{_early[o.word]} while the others needed it")
        for o in outcomes.values()
        if o.word in _early and o.rank in _named(found, ENDINGS)
    ]
    failures = failed + early
    if not failures:
        return None
    holder = _held_until_timeout(outcomes, failed, found) or _mismatch_ended(outcomes, found)
    if holder is not None:
        return holder
    never = {o.rank for o in outcomes.values() if o.word == "absent"}
    absent = sorted(_named(found, ABSENCES, Severity.WARNING) & never)
    for causes in (
        [o for o in failures if o.rank in named and not o.waited],
        [Outcome(r, "absent", True, None, _NEVER) for r in absent],
        [o for o in failures if o.rank in named],
        [o for o in failures if not o.waited],
        failures,
    ):
        if causes:
            return min(causes, key=lambda o: (*_when(o, found), o.rank))
    return None


def _held_until_timeout(
    outcomes: dict[int, Outcome], failed: list[Outcome], found: Sequence[Episode]
) -> Outcome | None:
    """Every failure only a victim's (timed out waiting), all of them ranks a straggler
    alert still up at the end said waited for one rank that did not fail itself: that rank
    ended the job (LLaMA-Factory #2424: rank 0 saves past the process group's timeout), not
    the first rank to time out, as the launcher's "Root Cause" says. That rank may fail too,
    with a victim's words, after them: it came to the collective once they had gone."""
    if not failed or not all(o.waited for o in failed):
        return None
    for e in found:
        if not (
            e.kind in HOLDING
            and e.severity == Severity.ERROR
            and e.cleared_s is None
            and len(e.ranks) == 1
        ):
            continue
        rank = e.ranks[0]
        victims = [o for o in failed if o.rank != rank]
        if not victims or not {o.rank for o in victims} <= set(e.waiting):
            continue
        own = outcomes.get(rank)
        when = min((o.ended_at for o in victims if o.ended_at is not None), default=None)
        # a deadlocked rank waits too (in the collective the blocked rank must enter): its own
        # timeout, before theirs or after, is one more consequence
        deadlocked = e.kind == AlertKind.SEND_RECV_DEADLOCK and own is not None and own.waited
        if own is None or (own.failed and not deadlocked and not _failed_after(own, when)):
            return None
        where = f" in '{e.phase}'" if e.phase else ""
        names = format_ranks(sorted(o.rank for o in victims))
        text = f"kept {names} waiting{where} until they timed out"
        return Outcome(rank, "held", True, when, text)
    return None


def _mismatch_ended(outcomes: dict[int, Outcome], found: Sequence[Episode]) -> Outcome | None:
    """A collective mismatch error named one rank, and every failure after it was a victim's:
    a rank gloo aborted from C++ (SIGABRT: it reports nothing, it fell silent) or one that
    lost its peers, or one killed by SIGABRT (its black box, read on its host, says so). The
    culprit itself was then stopped by the launcher, or failed only as a
    victim: the mismatch ended the job, not the silent rank (Lightning #7773 with 4 ranks:
    whether the odd rank's own socket broke before torchrun's SIGTERM is a race, and when it
    did not, the verdict named its aborted neighbour, 1 run in 2)."""
    named = {
        e.ranks
        for e in found
        if e.kind == AlertKind.COLLECTIVE_MISMATCH and e.severity == Severity.ERROR and e.ranks
    }
    if len(named) != 1:
        return None
    (culprits,) = named
    if len(culprits) != 1 or culprits[0] not in outcomes:
        return None
    own = outcomes[culprits[0]]
    if own.failed and not own.waited:
        return None  # a failure of its own: the general order tells it
    victims = [o for o in outcomes.values() if o.failed and o.rank != own.rank]
    if not victims or not all(o.word == "silent" or o.waited or _aborted(o) for o in victims):
        return None
    return Outcome(own.rank, "mismatched", True, own.ended_at, _DID[AlertKind.COLLECTIVE_MISMATCH])


def _aborted(o: Outcome) -> bool:
    """Killed by SIGABRT, or crashed with the backend's words for a collective mismatch
    ("Received data size doesn't match expected size", read from the job's output): how
    gloo ends, from C++, the rank a mismatched collective's data reaches (its black box told
    the server, where it would otherwise have fallen silent)."""
    return (o.word == "killed" and o.text.endswith("SIGABRT")) or o.mismatched


def _failed_after(own: Outcome, victims_ended: float | None) -> bool:
    """A victim's failure (a lost peer) after the victims had ended: a consequence."""
    ended = own.ended_at
    return own.waited and ended is not None and victims_ended is not None and ended > victims_ended


_NEVER = "never reported (it did not start, or could not reach ddpwatch or the other ranks)"


def _named(
    found: Sequence[Episode], kinds: frozenset[str], least: str = Severity.ERROR
) -> set[int]:
    """The culprits of the episodes of these kinds, ``least`` as severe at least (a rank
    that never came is one while the others time out waiting for it, warning or error)."""
    floor = severity_level(least)
    return {
        r for e in found if e.kind in kinds and severity_level(e.severity) >= floor for r in e.ranks
    }


_early = {"finished": "exited (code 0)", "stopped": "was stopped from outside"}


def _when(o: Outcome, found: Sequence[Episode]) -> tuple[bool, float]:
    """When a failure happened: its process's end; a silent rank (no end known) after every
    dated one, ordered by when an alert first said so."""
    if o.ended_at is not None:
        return (False, o.ended_at)
    raised = [e.raised_s for e in found if o.rank in e.ranks and e.kind in ENDINGS]
    return (True, min(raised, default=math.inf))


def _ending_text(
    ending: Outcome,
    outcomes: dict[int, Outcome],
    found: Sequence[Episode],
    ranks: Sequence[RankEntry],
    stop: Stop | None = None,
) -> str:
    step = next((r.step for r in ranks if r.rank == ending.rank), None)
    reasons = {  # what else the rank did, told beside its end (``_is_the_ending``)
        _DID[e.kind]: None
        for e in found
        if e.ranks == (ending.rank,)
        and e.cleared_s is None
        and e.kind in _DID
        and e.kind not in ABSENCES
    }
    text = f"rank {ending.rank} " + " and ".join(
        [*(r for r in reasons if r != ending.text), ending.text]
    )
    if step is not None:
        text += f" at step {step}"
    text += ", which ended the job"
    others = [o for o in outcomes.values() if o.rank != ending.rank and o.word != "absent"]
    failed = [o.rank for o in others if o.failed]
    stopped = [o.rank for o in others if o.word == "stopped"]
    running = [o.rank for o in others if o.word == "running"]
    if failed:
        text += f"; {format_ranks(failed)} failed because of it"
    if stopped:
        text += f"; {format_ranks(stopped)} {_were(stopped)} stopped because of it"
    if running:
        text += f"; {format_ranks(running)} {_were(running)} still waiting for it"
    interrupted = [o.rank for o in others if o.word == "interrupted"]
    if interrupted and stop is not None:
        text += (
            f"; {format_ranks(interrupted)} {_were(interrupted)} still running when {stop.clause}"
        )
    finished = [o.rank for o in others if o.word == "finished"]
    if finished:
        text += f"; {format_ranks(finished)} had finished"
    return text


def _were(ranks: list[int]) -> str:
    return "was" if len(ranks) == 1 else "were"


def _no_failure_text(
    seen: list[Outcome], found: Sequence[Episode], stop: Stop | None, live: bool = False
) -> str:
    words = {o.word for o in seen}
    if "interrupted" in words and stop is not None:
        text = stop.passive
        finished = [o.rank for o in seen if o.word == "finished"]
        if finished:
            text += f"; {format_ranks(finished)} had finished"
        return text
    if words == {"finished"}:
        return "the job finished: every rank exited 0" if len(seen) > 1 else "the job finished"
    if "running" in words:
        running = [o.rank for o in seen if o.word == "running"]
        if live:
            if len(running) == len(seen):
                return "the job is running"
            return f"{format_ranks(running)} {'is' if len(running) == 1 else 'are'} running"
        if len(running) == len(seen):
            return "the job was still running when the watch ended"
        return f"{format_ranks(running)} {_were(running)} still running when the watch ended"
    stopped = [o.rank for o in seen if o.word == "stopped"]
    text = f"the job was stopped from outside ({format_ranks(stopped)})"
    finished = [o.rank for o in seen if o.word == "finished"]
    if finished:
        text += f"; {format_ranks(finished)} had finished"
    return text


def _other_problems(
    found: Sequence[Episode],
    held: Sequence[HeldUp],
    ending: Outcome | None,
    run_s: float | None,
    end_s: float,
    nan_steps: dict[int, Any],
) -> list[str]:
    """Everything else worth a line: the time lost, per culprit, most first (who held the
    others up, who they waited for every step: ``figures.time_lost``), then each other error
    episode in time order, then how many other warnings."""
    problems = [held_up_text(account, run_s) for account in held]
    holders = {a.rank for a in held if a.times}
    said: set[tuple[str, tuple[int, ...]]] = set()
    warnings: list[str] = []
    for e in found:
        if e.kind in HOLDING and len(e.ranks) == 1 and e.ranks[0] in holders:
            continue  # added up above
        if e.kind in SLOWING and e.severity != Severity.ERROR:
            continue  # added up above
        if ending is not None and _is_the_ending(e, ending, found):
            continue
        if e.severity != Severity.ERROR:
            warnings.append(e.kind)
            continue
        if (e.kind, e.ranks) in said:
            continue
        said.add((e.kind, e.ranks))
        problems.append(_episode_text(e, end_s, nan_steps))
    if warnings:
        kinds = ", ".join(dict.fromkeys(warnings))
        problems.append(f"{len(warnings)} warning{'s' if len(warnings) > 1 else ''} ({kinds})")
    return problems


def _is_the_ending(e: Episode, ending: Outcome, found: Sequence[Episode]) -> bool:
    """An alert about the failure that ended the job (told already), unless it is a silence
    of that rank which cleared (it reported again) before a later ending alert: a frozen
    spell it came back from is a story of its own. An error about that rank alone still up
    at the end (``device_ordinal`` beside its crash) tells the same failure."""
    if ending.rank not in e.ranks:
        return False
    if e.ranks == (ending.rank,) and e.cleared_s is None and e.kind not in HOLDING:
        return True
    if ending.word == "absent":
        return e.kind in ABSENCES
    if e.kind not in ENDINGS:
        return False
    if e.kind != AlertKind.SILENT or e.cleared_s is None or e.closed_by is not None:
        return True
    ends = [x.raised_s for x in found if x.kind in ENDINGS and ending.rank in x.ranks]
    return e.cleared_s >= max(ends)  # ``e`` is among them: true when none came after it


def _first_bad(rank: RankEntry) -> tuple[int | None, str]:
    """A rank's first non-finite step and what went bad: its own gradients (before DDP's
    all-reduce) when they did before its loss, else its loss."""
    loss, grads = rank.nan_step, rank.grad_nan_step
    if grads is not None and not (loss is not None and loss <= grads):
        return grads, "gradients"
    return loss, "loss"


def _episode_text(e: Episode, end_s: float, nan_steps: dict[int, tuple[int | None, str]]) -> str:
    who = format_ranks(e.ranks) if e.ranks else "no single rank"
    if e.kind == AlertKind.NAN_LOSS:
        step, what = nan_steps.get(e.ranks[0], (None, "loss")) if e.ranks else (None, "loss")
        when = f"at step {step}" if isinstance(step, int) else f"at {elapsed(e.raised_s)}"
        return f"{who} produced the first non-finite {what} {when}"
    if e.kind == AlertKind.SILENT and e.cleared_s is not None:
        return f"{who} fell silent for {duration(e.duration_s(end_s))} and came back"
    if e.kind == AlertKind.STALLED:
        return f"{who} stopped making progress for {duration(e.duration_s(end_s))}"
    if not e.ranks:
        return f"{e.kind}: {e.message}"
    did = _DID.get(e.kind)
    if did is not None:
        return f"{who} {did} ({elapsed(e.raised_s)})"
    return f"{e.kind} about {who} ({elapsed(e.raised_s)}, {duration(e.duration_s(end_s))})"


_DID: dict[str, str] = {
    AlertKind.COLLECTIVE_MISMATCH: "made collective calls that did not match the others'",
    AlertKind.NOT_CONNECTED: "never reported",
    AlertKind.STARTUP_HANG: "hung while starting",
    AlertKind.DUPLICATE_DEVICE: "shared one GPU",
    AlertKind.DEVICE_ORDINAL: "asked for a GPU index it does not have",
    AlertKind.LOCAL_RANK_MISMATCH: "computed on another GPU than its local rank",
    AlertKind.CHECKPOINT_CONFLICT: "wrote the same checkpoint file",
    AlertKind.STEP_SKEW: "fell out of step with the others",
}
"""What an error episode's culprits did, in words, where the kind alone says it."""


# ------------------------------------------------------------------------------ a document


@dataclass(frozen=True)
class Run:
    """A whole run as the document tells it: each attempt's account, oldest first."""

    accounts: tuple[Account, ...]
    run_s: float | None
    episodes: tuple[Episode, ...]
    figures: Figures  # how long, the median steps, the time lost: what every output quotes

    @property
    def text(self) -> str:
        """The verdict in one line (each attempt's, when the launcher restarted the job)."""
        if len(self.accounts) == 1:
            return self.accounts[0].text
        total = len(self.accounts)
        return " · ".join(f"attempt {a.attempt} of {total}: {a.text}" for a in self.accounts)


def verdict_entry(run: Run, *, final: bool = False) -> Verdict:
    """The run judged, as the status document's ``verdict`` writes it; ``final``: the run
    was judged as the watch ended (``read_run``'s ``live`` false)."""
    told = run.figures
    return Verdict(
        text=run.text,
        named=sorted(run.accounts[-1].named),
        attempts=[AttemptVerdict(a.attempt, a.text, sorted(a.named)) for a in run.accounts],
        run_s=None if told.run_s is None else round(told.run_s, 3),
        median_step_s=told.median_step_s,
        time_lost=[lost.entry(told.run_s) for lost in told.lost],
        final=final,
        episodes=[episode.entry(told.end_s) for episode in run.episodes],
    )


def judged(document: StatusDocument, *, final: bool = False) -> Verdict:
    """The document's ``verdict``: its run judged as of the document (``final``: as the watch
    ended)."""
    return verdict_entry(read_run(document, live=not final), final=final)


def read_run(document: StatusDocument, *, live: bool = False) -> Run:
    """Judge every attempt the document holds (the current one from ``ranks``); ``live``:
    as of the document, the watch going on (``judge``)."""
    told = figures(document)
    found, run_s, end_s = list(told.episodes), told.run_s, told.end_s
    started = math.nan if document.job_started is None else document.job_started
    ranks = document.ranks
    pasts = document.attempts
    current = document.attempt or 1
    accounts = []
    for past in pasts:
        number = past.attempt or 1
        mine = [e for e in found if e.attempt == number]
        ended = past.ended - started
        ended = ended if math.isfinite(ended) else end_s
        accounts.append(judge(past.ranks, mine, run_s, ended, number))
    mine = [e for e in found if e.attempt == current] if pasts else found
    accounts.append(
        judge(
            ranks,
            mine,
            run_s,
            end_s,
            current,
            stop=stop_of(document),
            not_started=not_started_of(document),
            live=live,
        )
    )
    return Run(tuple(accounts), run_s, tuple(found), told)
