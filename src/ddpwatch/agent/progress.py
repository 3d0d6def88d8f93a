"""What the training thread records and the publisher thread reads.

The training thread only assigns attributes and reads ``perf_counter``: no
locks, no I/O, no device synchronisation. Single attribute writes are atomic
under the GIL, and the publisher tolerates reading a step that is half-updated
(it reports it on the next heartbeat).
"""

from __future__ import annotations

import contextlib
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ddpwatch.agent.loss import LossReader
from ddpwatch.protocol import MARK_EVERY, Collective
from ddpwatch.vocabulary import Phase

EMA_WEIGHT = 0.1
MARKS_KEPT = 16  # 128 steps of marks between two heartbeats: enough for 4 ms steps


class Progress:
    """Step, loss, phase and collective timing of one rank."""

    def __init__(self) -> None:
        now = time.perf_counter()
        self.step: int | None = None
        self.forwards = 0
        self.step_mode: str | None = None  # "explicit", "optimizer" or "forward"
        self.last_step_end: float | None = None
        self.step_time_s: float | None = None
        self.avg_step_time_s: float | None = None
        self.data_wait_s: float | None = None
        self.phase: str = Phase.STARTED
        self.pinned = 0  # depth of user phase() blocks
        self.phase_changed = now
        self.last_progress = now
        self.collective_op: str | None = None
        self.collective_seq = 0
        self.collective_start = 0.0
        self.collective_depth = 0
        self.collective_counted = True
        self.collective_tensor: Any = None
        self.marks: deque[tuple[int, int]] = deque(maxlen=MARKS_KEPT)
        self.collective_time_step = 0.0
        self.collective_time_s: float | None = None
        self.failed_collective: Collective | None = None  # the collective an exception left
        self.waiting_for_data = False
        self.loss = LossReader(self)
        self.on_step: Callable[[], object] | None = None  # e.g. note the CUDA device, now and then
        self._step_owner: weakref.ref[Any] | None = None  # the integration that counts steps

    # training thread -------------------------------------------------------
    def set_phase(self, name: str) -> None:
        if name != self.phase:
            self.phase = name
            self.phase_changed = time.perf_counter()

    def auto_phase(self, name: str) -> None:
        """A phase set by hooks (forward, backward, ...); a user's ``phase()`` block wins."""
        if not self.pinned and name != self.phase:
            self.phase = name
            self.phase_changed = time.perf_counter()

    def end_step(self, loss: Any = None, mode: str = "explicit") -> None:
        """Count one step. The first mode seen wins, so hooks don't double count."""
        if self.step_mode is None:
            self.step_mode = mode
        elif mode != self.step_mode:
            if mode != "explicit":
                return
            self.step_mode = mode  # an explicit call overrides counting by hooks,
            if self.step:  # and ends the step they counted already: step(loss) N is step N
                self.step -= 1
        if loss is not None:
            # first: a heartbeat never pairs step N with loss N-1; it is the ending step's
            self.loss.submit(loss, 1 if self.step is None else self.step + 1)
        now = time.perf_counter()
        if self.last_step_end is not None:
            elapsed = now - self.last_step_end
            self.step_time_s = elapsed
            avg = self.avg_step_time_s
            self.avg_step_time_s = elapsed if avg is None else avg + EMA_WEIGHT * (elapsed - avg)
        self.step = 1 if self.step is None else self.step + 1
        self.last_step_end = now
        self.last_progress = now
        self.collective_time_s = self.collective_time_step
        self.collective_time_step = 0.0
        if self.step % MARK_EVERY == 0 and self.step_mode != "forward":
            # forward passes are no step count to compare ranks by (evaluation on one rank)
            self.marks.append((self.step, self.collective_seq))  # one append: atomic
        self.waiting_for_data = True
        if self.on_step is not None and self.step % 64 == 1:
            with contextlib.suppress(Exception):
                self.on_step()

    def count_steps_explicitly(self) -> None:
        """From now on steps come from ``end_step(mode="explicit")``: the optimizer and
        forward hooks stop counting (what the first explicit step does, set before it)."""
        self.step_mode = "explicit"

    def prefer_optimizer_steps(self) -> None:
        """An optimizer step after steps were counted by forward passes: optimizer steps
        are the better count, and the step the last forward pass ended is this one."""
        if self.step_mode == "forward":
            self.step_mode = None
            self.step = None if self.step is None else self.step - 1

    def claim_steps(self, owner: Any) -> bool:
        """Whether ``owner`` counts the steps: the first to ask does, until it is gone or
        calls ``release_steps``. Not weak-referenceable: it counts."""
        try:
            ref = self._step_owner
            current = ref() if ref is not None else None
            if current is None:
                self._step_owner = weakref.ref(owner)
                return True
            return current is owner
        except TypeError:
            return True

    def release_steps(self, owner: Any) -> None:
        ref = self._step_owner
        if ref is not None and ref() is owner:
            self._step_owner = None

    def note_forward(self) -> None:
        """Count a forward pass that is no training step (an evaluation batch) as progress:
        the server's ``stalled`` rule reads it."""
        self.forwards += 1
        self.last_progress = time.perf_counter()

    def forward_started(self) -> None:
        """Count a forward pass (progress even without steps, as in evaluation) and
        measure the time since the end of the last step: data loading."""
        now = time.perf_counter()
        self.forwards += 1
        self.last_progress = now
        if self.waiting_for_data and self.last_step_end is not None:
            self.data_wait_s = now - self.last_step_end
            self.waiting_for_data = False
        self.auto_phase(Phase.FORWARD)

    def enter_collective(self, op: str, tensor: Any = None, counted: bool = True) -> None:
        """Enter a Python-level collective. ``tensor``: what this rank contributes (its shape
        and dtype are read later, off the training thread); ``counted``: it runs on the
        default group, so its number compares across ranks."""
        self.collective_depth += 1
        if self.collective_depth == 1:
            if counted:
                self.collective_seq += 1
            self.collective_counted = counted
            self.collective_op = op
            self.collective_tensor = tensor
            self.collective_start = time.perf_counter()

    def exit_collective(self, failed: bool = False) -> None:
        if failed and self.collective_depth == 1 and self.failed_collective is None:
            self.failed_collective = self.in_flight()
        self.collective_depth -= 1
        if self.collective_depth == 0:
            self.collective_time_step += time.perf_counter() - self.collective_start
            self.collective_op = None
            self.collective_tensor = None

    # publisher thread ------------------------------------------------------
    def in_flight(self) -> Collective | None:
        """The Python-level collective the training thread is inside, if any."""
        op = self.collective_op
        if op is None:
            return None
        shape, dtype = _describe(self.collective_tensor)
        return Collective(
            op=op,
            seq=self.collective_seq if self.collective_counted else None,
            since_s=time.perf_counter() - self.collective_start,
            source="py",
            shape=shape,
            dtype=dtype,
        )

    def idle_for(self) -> float:
        """Seconds since the rank last moved: a step ended or its phase changed."""
        return time.perf_counter() - max(self.last_progress, self.phase_changed)


def _describe(tensor: Any) -> tuple[list[int] | None, str | None]:
    """Shape and dtype of a tensor a collective was given; (None, None) for anything else."""
    try:
        return [int(n) for n in tensor.shape], str(tensor.dtype).removeprefix("torch.")
    except Exception:
        return None, None
