"""Losses handed from the training thread to the publisher: the latest value, and the exact
first step of the current run of non-finite losses.

The training thread only appends a reference (detached when it carries a graph) to a
bounded ring, tagged with the step the loss belongs to. The publisher thread reads them at
each heartbeat: CPU values at once; CUDA tensors are stacked and copied to the host
asynchronously, and read at a later heartbeat once the copy's event has completed. Neither
thread ever waits for the device, so a NaN at step 17 of 200 steps between two heartbeats
is still found at step 17.

The same ring carries each step's gradient check (``agent/grads.py``: one scalar, not finite
when this rank's own gradients were not), read with the losses in one copy: a heartbeat that
reports the loss of step N has read the gradients of every step before it.
"""

from __future__ import annotations

import math
import numbers
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Protocol

MAX_PENDING = 1024
"""Losses kept between two reads: at 2 Hz, one loss per step, exact for steps of 0.5 ms and
up (1 ms with a gradient check: one more value a step). When it overflows the oldest go
(counted in ``dropped``), and a run of non-finite losses that may have begun among them is
reported as unknown rather than at a wrong step."""


def find_loss(output: Any) -> Any:
    """The loss in a model's output: a scalar tensor, or a ``loss`` key or attribute. A
    tensor of more dimensions has no ``loss``: not looked for (a failed attribute lookup
    raises inside ``getattr``, dearer than the rest of a forward hook)."""
    ndim = getattr(output, "ndim", None)
    if ndim is not None:
        return output if ndim == 0 else None
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", None)


class StepSource(Protocol):
    """What the reader needs of ``Progress`` to tag a loss with its step."""

    step: int | None
    step_mode: str | None


class Grads:
    """A step's gradient check in the ring, told apart from a loss: ``value`` is a scalar
    tensor that is not finite when the step's own gradients were not."""

    __slots__ = ("value",)

    def __init__(self, value: Any) -> None:
        self.value = value


@dataclass
class _Batch:
    """Losses taken from the ring in one read, in submission order; CUDA ones still copying."""

    steps: list[int | None]
    values: list[float | None]
    gap: bool  # losses were dropped just before this batch
    grads: list[bool] = field(default_factory=list)  # which values are gradient checks
    copies: list[tuple[list[int], Any, Any]] = field(default_factory=list)  # indices, host, event
    held: list[Any] = field(default_factory=list)  # the device losses, alive until copied

    def ready(self) -> bool:
        return all(event.query() for _, _, event in self.copies)

    def fill(self) -> None:
        for indices, host, _ in self.copies:
            for index, value in zip(indices, host.tolist(), strict=True):
                self.values[index] = float(value)
        self.copies.clear()
        self.held.clear()


class LossReader:
    """Hands losses to the publisher without a device sync on the training thread.

    ``value`` is the latest loss read; ``nan_step`` the first step of the current run of
    non-finite losses (None when the latest loss is finite, or when that step is unknown
    because the ring overflowed at the wrong moment); ``grad_nan_step`` the same for the
    steps whose own gradients were not finite (``submit_grads``).
    """

    def __init__(self, progress: StepSource | None = None, size: int = MAX_PENDING) -> None:
        self._progress = progress
        self._pending: deque[tuple[int | None, Any]] = deque(maxlen=size)
        self._batch: _Batch | None = None  # the one CUDA batch being copied, if any
        self._dropped_seen = 0
        self._unknown_run = False  # in a non-finite run whose first step was lost
        self._handed_step: int | None = None  # the last step a loss was handed over for
        self.dropped = 0
        self.value: float | None = None
        self.nan_step: int | None = None
        self.grad_nan_step: int | None = None
        self._grad_unknown_run = False

    # training thread ---------------------------------------------------------
    def submit(self, loss: Any, step: int | None = None, fallback: bool = False) -> None:
        """Keep ``loss`` for the publisher; ``step`` defaults to the step in progress.

        ``fallback``: a guess (the tensor ``backward()`` runs on, perhaps divided for
        gradient accumulation), kept only when nothing handed over a loss for that step.
        """
        if step is None:
            step = self.step_in_progress()
        if fallback:
            if step == self._handed_step and step is not None:
                return
        else:
            self._handed_step = step
        if getattr(loss, "requires_grad", False):
            loss = loss.detach()  # holding it must not keep the autograd graph alive
        pending = self._pending
        if len(pending) == pending.maxlen:
            self.dropped += 1
        pending.append((step, loss))

    def submit_grads(self, check: Any, step: int | None) -> None:
        """Keep a step's gradient check (a scalar tensor) for the publisher."""
        pending = self._pending
        if len(pending) == pending.maxlen:
            self.dropped += 1
        pending.append((step, Grads(check)))

    def step_in_progress(self) -> int | None:
        """The step a loss seen now belongs to: the one that ends next. Counting by forward
        passes ends the step at the forward, so there the loss is the counted step's."""
        progress = self._progress
        if progress is None:
            return None
        step = progress.step or 0
        return step if step and progress.step_mode == "forward" else step + 1

    # publisher thread --------------------------------------------------------
    def poll(self) -> float | None:
        """Fold in every loss readable without waiting; return the latest value."""
        batch = self._batch
        if batch is not None:
            try:
                if not batch.ready():
                    return self.value  # one copy at a time keeps the losses in order
                batch.fill()
            except Exception:  # a failed device: its losses are lost, later ones still count
                batch.copies.clear()
                batch.held.clear()
                batch.gap = True
            self._batch = None
            self._fold(batch)
        batch = self._take()
        if batch is not None:
            if batch.copies:
                self._batch = batch
            else:
                self._fold(batch)
        return self.value

    def _take(self) -> _Batch | None:
        """Empty the ring: read what is on the host, start the copies of what is not."""
        entries = _drain(self._pending)
        if not entries:
            return None  # a drop seen now still marks the next batch
        dropped = self.dropped
        gap, self._dropped_seen = dropped != self._dropped_seen, dropped
        steps = [step for step, _ in entries]
        values: list[float | None] = [None] * len(entries)
        grads = [False] * len(entries)
        on_device: dict[Any, list[int]] = {}
        for index, (step, loss) in enumerate(entries):
            if isinstance(loss, Grads):
                grads[index] = True
                loss = loss.value
                entries[index] = (step, loss)
            if isinstance(loss, numbers.Real):
                values[index] = float(loss)
            elif getattr(loss, "is_cuda", False):
                if loss.numel() == 1 and loss.is_floating_point():
                    on_device.setdefault(loss.device, []).append(index)
            elif hasattr(loss, "detach"):
                values[index] = _as_float(loss)
        batch = _Batch(steps, values, gap, grads)
        for device, indices in on_device.items():
            try:
                tensors = [entries[i][1] for i in indices]
                batch.copies.append(_start_copy(device, tensors, indices))
            except Exception:  # a device in a bad state: these losses stay unread
                continue
            batch.held.extend(tensors)  # their memory must not be reused before the copy ran
        return batch

    def _fold(self, batch: _Batch) -> None:
        """Walk the losses in order: the latest value, and where the current bad run began."""
        gap = grad_gap = batch.gap
        kinds = batch.grads or [False] * len(batch.steps)
        for step, value, grads in zip(batch.steps, batch.values, kinds, strict=True):
            if value is None:
                continue  # a non-scalar "loss": leaves the last good value
            if grads:
                self._fold_grads(step, value, grad_gap)
                grad_gap = False
                continue
            self.value = value
            if math.isfinite(value):
                self.nan_step, self._unknown_run = None, False
            elif gap and self.nan_step is None and not self._unknown_run:
                self._unknown_run = True  # it may have begun among the dropped losses
            elif self.nan_step is None and not self._unknown_run:
                if step is None:
                    self._unknown_run = True
                else:
                    self.nan_step = step
            gap = False

    def _fold_grads(self, step: int | None, value: float, gap: bool) -> None:
        """The gradients' run, as ``_fold`` keeps the losses' one."""
        if math.isfinite(value):
            self.grad_nan_step, self._grad_unknown_run = None, False
        elif self.grad_nan_step is None and not self._grad_unknown_run:
            if gap or step is None:
                self._grad_unknown_run = True  # it may have begun among the dropped values
            else:
                self.grad_nan_step = step


def _drain(pending: deque[tuple[int | None, Any]]) -> list[tuple[int | None, Any]]:
    """Pop every entry of ``pending``, oldest first, one at a time: the training thread may
    append meanwhile (``popleft`` is atomic; copying then clearing could lose an entry)."""
    entries = []
    while True:
        try:
            entries.append(pending.popleft())
        except IndexError:
            return entries


def _start_copy(device: Any, tensors: list[Any], indices: list[int]) -> tuple[list[int], Any, Any]:
    """One stacked, non-blocking device-to-host copy and the event that says it is done."""
    import torch

    with torch.cuda.device(device):
        stacked = torch.stack([t.reshape(()) for t in tensors])
        host = stacked.to("cpu", non_blocking=True)
        event = torch.cuda.Event()  # type: ignore[no-untyped-call]
        event.record()
    return indices, host, event


def _as_float(tensor: Any) -> float | None:
    """A one-element tensor's value (on the publisher thread: it may sync there)."""
    try:
        if tensor.numel() != 1:
            return None
        return float(tensor.detach().item())
    except (RuntimeError, ValueError, TypeError):
        return None
