"""What the ``ddpwatch run`` that launched a job knew of its end, which no rank can report:
who stopped it, and why it never started (the status document's ``job_end``).

The verdict (``verdict.py``) reads it so that a job the user stopped is "stopped by you", not
a job "still running when the watch ended" or one whose ranks "crashed" with the
``KeyboardInterrupt`` the stop raised in them; and so that a job that never started says why
in the launcher's own words wherever its run is told again (``ddpwatch report``, ``status``).
"""

from __future__ import annotations

from dataclasses import dataclass

from ddpwatch.core.vocabulary import JobStop
from ddpwatch.status.fmt import elapsed
from ddpwatch.status.schema import UNSET, JobEnd, StatusDocument

_BY_YOU: dict[str, tuple[str, str]] = {
    JobStop.DASHBOARD: (
        "by you from the dashboard (Stop the job)",
        "you stopped the job from the dashboard",
    ),
    JobStop.CTRL_C: ("by you (Ctrl-C)", "you stopped the job (Ctrl-C)"),
    JobStop.SIGTERM: ("by a SIGTERM to ddpwatch run", "a SIGTERM to ddpwatch run stopped the job"),
}
"""Per ``JobStop``: how the job was stopped (after "the job was stopped"), and who stopped it
as a clause ("… still running when you stopped the job")."""


@dataclass(frozen=True)
class Stop:
    """The job was asked to stop at ``at`` (unix seconds; ``at_s`` since the job's start):
    from then on a rank's end is the stop's doing, not a failure."""

    by: str
    at: float
    at_s: float | None

    @property
    def when(self) -> str:
        return f" at {elapsed(self.at_s)}" if self.at_s is not None else ""

    @property
    def how(self) -> str:
        """In words, after "stopped": "by you (Ctrl-C)"."""
        return _BY_YOU.get(self.by, (f"({self.by})", ""))[0]

    @property
    def passive(self) -> str:
        """The stop as a sentence: "the job was stopped by you (Ctrl-C) at +42.1 s"."""
        return f"the job was stopped {self.how}{self.when}"

    @property
    def clause(self) -> str:
        """The stop as a clause: "you stopped the job (Ctrl-C) at +42.1 s"."""
        who = _BY_YOU.get(self.by, ("", f"the job was stopped ({self.by})"))[1]
        return f"{who}{self.when}"


def job_end_of(document: StatusDocument) -> JobEnd | None:
    """The document's ``job_end``; None where no ``ddpwatch run`` said how the job ended."""
    found = document.job_end
    return None if found is UNSET else found


def stop_of(document: StatusDocument) -> Stop | None:
    """The stop ``ddpwatch run`` was asked for (Ctrl-C, the dashboard, a SIGTERM), if any."""
    job_end = job_end_of(document)
    if job_end is None or job_end.stopped_by is None:
        return None
    at = job_end.stopped_at if job_end.stopped_at is not None else job_end.at
    started = document.job_started
    at_s = max(0.0, at - started) if started is not None else None
    return Stop(job_end.stopped_by, at, at_s)


def not_started_of(document: StatusDocument) -> str | None:
    """Why the job never started, in the launcher's own words (``jobs/failure.py``)."""
    job_end = job_end_of(document)
    return None if job_end is None else job_end.not_started
