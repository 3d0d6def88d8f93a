"""How a job ``ddpwatch run`` launched ended, as only ``run`` can tell: what asked it to stop
and when (Ctrl-C, a SIGTERM, the dashboard's "Stop the job"), how its launcher exited, and
why it never started (``failure.py``, from the launcher's last lines).

``run`` tells the server (``Server.end_job``) before its final diagnosis, so the last status
document carries it (``job_end``) and the recording keeps it: the summary, ``ddpwatch report``
and a replay say the same thing, where the live run once said it only in its own summary.
The alert stream (``ChangePrinter``) stops naming the server once the job has ended.
"""

from __future__ import annotations

import shlex
import signal
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from ddpwatch.core.port_holder import holder_of
from ddpwatch.core.vocabulary import HistoryEvent, JobStop
from ddpwatch.diagnosis.history import AlertChange, describe
from ddpwatch.diagnosis.job_end import Stop
from ddpwatch.jobs.emphasis import emphasize_for
from ddpwatch.jobs.failure import not_started_reason
from ddpwatch.status.fmt import hint_pointing_at
from ddpwatch.status.schema import JobEnd


@dataclass(frozen=True)
class StopAsked:
    """Something asked the job to stop, at ``at`` (the server's clock, unix seconds)."""

    by: JobStop
    at: float


class Stops:
    """What asked the job to stop, in order (appended from signal handlers and the main
    thread; read once the job has ended)."""

    def __init__(self, clock: Callable[[], float] = time.time) -> None:
        self.asked: list[StopAsked] = []
        self._clock = clock

    def ask(self, by: JobStop) -> None:
        self.asked.append(StopAsked(by, self._clock()))

    @property
    def first(self) -> StopAsked | None:
        return self.asked[0] if self.asked else None


def job_end(
    returncode: int | None,
    started: bool,
    lines: Sequence[str],
    stops: Stops,
    at: float,
) -> JobEnd:
    """How the job ended: its launcher's code or signal, the first stop asked, and, where
    the launcher failed before any rank reported (``started`` false), why, in its words."""
    first, code = stops.first, returncode
    return JobEnd(
        at=at,
        exit_code=code if code is None or code >= 0 else None,
        exit_signal=_signal_name(-code) if code is not None and code < 0 else None,
        stopped_by=None if first is None else first.by,
        stopped_at=None if first is None else first.at,
        not_started=None if started else not_started(returncode, lines, first),
    )


def not_started(
    returncode: int | None, lines: Sequence[str], first: StopAsked | None = None
) -> str | None:
    """Why the job did not start, when it did not: the launcher failed (a non-zero code)
    and no rank ever reported. A job that ended well without ranks is not called that."""
    if not returncode:
        return None
    if first is not None:
        return f"it was stopped {Stop(first.by, first.at, None).how} before any rank reported"
    return not_started_reason(lines, returncode, holder_of=holder_of)


def _signal_name(number: int) -> str:
    try:
        return signal.Signals(number).name
    except ValueError:
        return f"signal {number}"


class ChangePrinter:
    """The alert stream of ``ddpwatch run`` on stderr. Once the job has ended (``job_over``)
    its server is about to go: a hint that sends the reader to it for a rank's stack sends
    them to the recording instead (``ddpwatch report FILE``)."""

    def __init__(self, recording: str | None) -> None:
        self.recording = recording
        self.over = False

    def job_over(self) -> None:
        self.over = True

    def __call__(self, change: AlertChange) -> None:
        cleared = change.event == HistoryEvent.CLEARED
        text = describe(change)
        if self.over:
            text = hint_pointing_at(text, after_the_run(self.recording))
        severity = None if cleared else change.alert.severity
        print(emphasize_for(sys.stderr, text, severity), file=sys.stderr, flush=True)


def after_the_run(recording: str | None) -> str:
    """Where a rank's stack and traceback are once the run has ended: its recording."""
    if recording is None:
        return "a recording (this run kept none: --no-record)"
    return f"ddpwatch report {shlex.quote(recording)}"
