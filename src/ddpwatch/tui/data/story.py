"""What the dashboard remembers of a run: whether the job ended, the alerts that came and went,
and the verdict once it is over.

Pure functions of the status document (its ``history``, ``docs/status.md`` "The timeline"), so
the alerts panel keeps telling the story after the ranks are gone.

When a job has *ended*:

- under ``ddpwatch run --tui`` and ``ddpwatch demo``, the job process ended (the source's
  ``ended``: ``JobSource``, ``DemoSource``);
- under ``serve`` and ``top`` (no job process to watch), every rank seen has finished: each one
  that reported is ``crashed``, ``exited`` or ``stopped`` (``ranks_finished``). A rank that never
  connected does not hold it open, and one that is ``silent`` does (it may come back).
"""

from __future__ import annotations

from ddpwatch.core.vocabulary import HistoryEvent, RankState
from ddpwatch.status.schema import AlertEntry, HistoryEntry, StatusDocument, SummaryReply

FINISHED_STATES = frozenset({RankState.CRASHED, RankState.EXITED, RankState.STOPPED})
"""A rank in one of these will not report again: a job whose ranks all are has ended."""
RECENT_S = 60.0
"""While the job runs, the alerts panel keeps an alert that cleared this long (job seconds)."""
PAST_LISTED = 50
"""At most this many cleared alerts are listed (the timeline, ``t``, has them all)."""


def ranks_finished(document: StatusDocument) -> bool:
    """Every rank that reported has finished (crashed, exited or stopped), and one did."""
    if isinstance(document, SummaryReply):
        counts = document.summary.states
        states = {s for s, n in counts.items() if n and s != RankState.NOT_CONNECTED}
    else:
        states = {row.state for row in document.ranks if row.state != RankState.NOT_CONNECTED}
    return bool(states) and states <= FINISHED_STATES


def _key(alert: AlertEntry) -> tuple[str, tuple[int, ...]]:
    return alert.kind, tuple(alert.ranks)


def job_elapsed(document: StatusDocument) -> float | None:
    """Seconds since ``job_started`` by the server's clock (what ``elapsed_s`` counts)."""
    started = document.job_started
    return None if started is None else float(document.server_time - started)


def cleared_alerts(document: StatusDocument, everything: bool) -> list[HistoryEntry]:
    """The ``cleared`` entries of the history whose alert is not open again, oldest first:
    all of them (``everything``: the job ended), else those that cleared in the last
    ``RECENT_S`` seconds of the job; at most ``PAST_LISTED``, the newest."""
    open_now = {_key(a) for a in document.alerts}
    since = None
    if not everything:
        elapsed = job_elapsed(document)
        if elapsed is None:  # no job clock to tell recent from old
            return []
        since = elapsed - RECENT_S
    found = [
        entry
        for entry in document.history
        if entry.event == HistoryEvent.CLEARED
        and _key(entry.alert) not in open_now
        and (since is None or entry.elapsed_s >= since)
    ]
    return found[-PAST_LISTED:]


def alerts_raised(document: StatusDocument) -> int:
    """How many alerts the run raised (an escalation is the same alert)."""
    return sum(1 for entry in document.history if entry.event == HistoryEvent.RAISED)


def ended_banner(document: StatusDocument) -> str:
    """The alerts panel's first line once the job ended: how many alerts, and the verdict
    (``outputs.summary.verdict``, what the end-of-run summary says); a large job's summary
    reply holds no verdict (it is judged over every rank): the line says where it is."""
    from ddpwatch.outputs.summary import verdict

    if not any(row.state != RankState.NOT_CONNECTED for row in document.ranks) and not isinstance(
        document, SummaryReply
    ):
        return "the job ended before any rank reported: its own output says why"
    count = alerts_raised(document)
    alerts = f"{count} alert{'s' if count != 1 else ''}" if count else "no alerts"
    ran = "" if isinstance(document, SummaryReply) else _ran(document)
    said = verdict(document) if document.verdict is not None else "ddpwatch status gives it"
    return f"the job finished{ran}: {alerts} in its run · verdict: {said}"


def _ran(document: StatusDocument) -> str:
    """" after 2 min 9 s": how long the run lasted, the summary's figure (``figures``)."""
    from ddpwatch.outputs.summary import run_seconds
    from ddpwatch.status.fmt import duration

    run_s = run_seconds(document)
    return "" if run_s is None else f" after {duration(run_s)}"
