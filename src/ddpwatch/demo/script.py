"""The demo's fault script, without torch: what ``demo/job.py`` plays, and what the dashboard
says is coming next (``demo/source.py``).

Each fault is held long enough to read, and the next one starts at least ``READ_S`` seconds
after the server raised the alert of the one before, however fast the steps go (a step takes
at least ``STEP_TIME_S``): ``tests/demo/test_demo.py`` checks that from ``fault_starts``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

STEP_TIME_S = 0.1
"""The job's sleep per step (``--step-time``): no step is shorter."""
READ_S = 10.0
"""The least time between one fault's alert and the next fault."""

STRAGGLER, NAN, STOP, CRASH = "straggler", "nan", "stop", "crash"


@dataclass(frozen=True)
class Fault:
    step: int
    """The step (counted from 1, as ``ddpwatch.step`` reports it) the fault happens in."""
    kind: str
    rank: int
    """The rank it happens on (the last rank, if the job is smaller)."""
    arg: float | str
    """A straggler's sleep and a stop's length in seconds; how many steps a loss stays NaN;
    a crash's message."""

    def target(self, world: int) -> int:
        return min(self.rank, world - 1)

    @property
    def begins_after(self) -> int:
        """The last step the ranks report before it begins: a straggler sleeps in, and a NaN
        is the loss of, step ``step``; a stop and a crash come once it is reported."""
        return self.step - 1 if self.kind in (STRAGGLER, NAN) else self.step

    @property
    def hold_s(self) -> float:
        """How long no step moves while it lasts (a straggler's sleep, a stop)."""
        return float(self.arg) if self.kind in (STRAGGLER, STOP) else 0.0

    def active(self, step: int, frozen_s: float) -> bool:
        """Under way when the ranks' newest step is ``step`` and has not moved for
        ``frozen_s`` seconds."""
        if self.kind == NAN:
            return self.step <= step < self.step + int(self.arg)
        if self.kind == CRASH:
            return step >= self.step
        return step == self.begins_after and frozen_s < self.hold_s + 3.0

    def what(self, world: int) -> str:
        """``rank 3 stops (SIGSTOP) for 14 s``."""
        rank = self.target(world)
        if self.kind == STRAGGLER:
            return f"rank {rank} straggles: sleeps {float(self.arg):.0f} s while the others wait"
        if self.kind == NAN:
            return f"rank {rank}'s loss turns NaN for {int(self.arg)} steps"
        if self.kind == STOP:
            return f"rank {rank} stops (SIGSTOP) for {float(self.arg):.0f} s"
        return f"rank {rank} crashes ({self.arg})"


SCRIPT: tuple[Fault, ...] = (
    Fault(20, STRAGGLER, 1, 8.0),  # under the stall threshold (10 s): a straggler, not a hang
    Fault(70, NAN, 2, 100),
    Fault(200, STOP, 3, 14.0),
    Fault(230, CRASH, 3, "CUDA error: invalid device ordinal"),
)
BY_STEP = {fault.step: fault for fault in SCRIPT}

ALERT_AFTER_S = {STRAGGLER: 2.5, NAN: 0.5, STOP: 3.5, CRASH: 0.5}
"""About how long after a fault begins the server raises its alert: a wait in a collective is
suspicious after 2 s, a rank silent after 2.5 s; a heartbeat (0.5 s) on top."""


def fault_starts(step_time: float = STEP_TIME_S) -> list[float]:
    """When each fault of ``SCRIPT`` begins, in seconds after the first step, with steps of
    ``step_time`` and the faults' holds."""
    starts: list[float] = []
    held = 0.0
    for fault in SCRIPT:
        starts.append(fault.begins_after * step_time + held)
        held += fault.hold_s
    return starts


def demo_note(step: int | None, step_time: float, frozen_s: float, world: int) -> str:
    """What the demo says on screen: the fault under way, and which comes next and about when.

    ``step``: the newest step of the job's ranks (None before the first); ``step_time``: the
    seconds a step takes now; ``frozen_s``: how long ``step`` has not moved."""
    if step is None:
        first = SCRIPT[0].what(world)
        return f"demo: {len(SCRIPT)} faults to come once the ranks train · first — {first}"
    now = [fault for fault in SCRIPT if fault.active(step, frozen_s)]
    coming = [fault for fault in SCRIPT if fault.step > step and fault not in now]
    parts = [f"now — {now[0].what(world)}"] if now else []
    if coming:
        nearest = coming[0]
        wait = (nearest.begins_after - step) * step_time
        wait += sum(max(0.0, fault.hold_s - frozen_s) for fault in now)
        parts.append(f"next — {nearest.what(world)} in ~{max(1, math.ceil(wait))} s")
    elif not now:
        parts.append("every fault has played")
    return "demo: " + " · ".join(parts)
