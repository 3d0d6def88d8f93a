"""The dashboard's source under ``ddpwatch demo``: the local server, the job it runs (whose
end the dashboard reports), and a line saying which scripted fault is under way and which
comes next (``note``, shown in the header)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol

from ddpwatch.demo.script import STEP_TIME_S, demo_note
from ddpwatch.status.provider import StatusProvider
from ddpwatch.status.schema import StatusDocument
from ddpwatch.tui.data.sources import LocalSource, exit_description

SLOWEST_STEP_S = 1.0
"""A step seen to take longer than this was held by a fault: it does not count to the pace."""


class Job(Protocol):
    def poll(self) -> int | None: ...


class DemoSource(LocalSource):
    """``LocalSource`` plus the demo's job and its fault script."""

    def __init__(
        self,
        server: StatusProvider,
        job: Job,
        world: int,
        *,
        faults: bool = True,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        super().__init__(server)
        self._job = job  # not ``job``: that would make q offer to detach from it
        self.world = world
        self.faults = faults
        self.clock = clock
        self.note: str | None = None
        """The header's demo line (None without faults, and once the job ended)."""
        self._server_label = self.label
        self._step: int | None = None
        self._moved = clock()  # when the newest step last changed
        self._step_time = STEP_TIME_S * 1.2
        self._update_label()

    @property
    def ended(self) -> bool:
        """The demo's job has ended (the dashboard then shows the run's story)."""
        return self._job.poll() is not None

    def fetch(self) -> StatusDocument | None:
        document = super().fetch()
        self._update_label()
        if document is not None:
            self._follow(document)
        return document

    def _update_label(self) -> None:
        self.label = f"demo {self._server_label}  job {exit_description(self._job.poll())}"

    def _follow(self, document: StatusDocument) -> None:
        """Track the job's newest step and its pace; say what the script does next."""
        steps = [row.step for row in document.ranks if not row.simulated and row.step is not None]
        step = max(steps, default=None)
        now = self.clock()
        if step != self._step:
            if self._step is not None and step is not None and step > self._step:
                per_step = (now - self._moved) / (step - self._step)
                if per_step < SLOWEST_STEP_S:
                    self._step_time = 0.7 * self._step_time + 0.3 * max(STEP_TIME_S, per_step)
            self._step, self._moved = step, now
        if not self.faults or self.ended:
            self.note = None
        else:
            self.note = demo_note(step, self._step_time, now - self._moved, self.world)
