"""Where a rank's step goes: waiting for input, computing, waiting in DDP's gradient all-reduce.

DDP's all-reduce runs in C++ (the reducer) inside ``backward()``, where no Python wrapper of
``torch.distributed`` sees it, and it evens out every rank's step time: a rank slower in its
backward or its input makes the others wait there, and only that wait tells the ranks apart
(TraceML issue 252). So, per backward:

* *own gradients ready*: a ``register_post_accumulate_grad_hook`` on the parameters of each
  DDP model, the last to fire (it fires before the reducer marks the gradient ready, and so
  before the reducer's wait at the end of backward; checked under gloo, torch 2.13: the rank
  slowed by 200 ms sees 1 to 6 ms from it to the end of backward, its peers ~200 ms);
* *backward returned*: a wrapper of ``torch.autograd.backward`` (``Tensor.backward`` calls
  it), else the next optimizer step (its pre-hook).

The wait is the time between the two. To keep the cost low, every parameter is hooked for the
first ``LEARN_BACKWARDS`` backwards, then only those that were among the last ``KEEP_LAST`` to
fire in one of them stay hooked (a model's readiness order is fixed by its graph). DDP's
single communication-hook slot is left to the user.

Time in a DataLoader iterator's ``__next__`` is the input wait. The training thread only
reads ``perf_counter`` and assigns attributes (``Progress``); every hook swallows its own
faults and counts them (``faults``).

On CUDA the CPU sees only when work was queued, not when it ran (the reducer's wait there is
a stream wait, not a CPU one), so the two moments are marks on the device's stream instead,
through an ``EventClock`` (``CudaClock``: a timing ``torch.cuda.Event`` recorded on the
current stream, queued, never waited for): one at this rank's last own gradient, one when
backward returns (DDP has made the stream wait for the all-reduce by then, so that mark
completes only after it). The pairs wait in a small queue (``PAIRS_KEPT``; the oldest dropped
if the publisher falls behind, their wait estimated from the others'); the publisher thread
(``collect``, from ``SplitReader.read`` every heartbeat) takes those the device has passed
(``query``, which does not block) and adds the time between the two marks to the gradient
wait; the others wait for the next heartbeat. Nothing ever synchronises the device. Any fault
of the device clock (no CUDA, an API change, a CUDA graph being captured) turns it off and is
counted: the rank then reports no gradient wait and no compute, as before. The input wait, a
CPU wait, holds on either.
"""

from __future__ import annotations

import itertools
import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any, Protocol

from ddpwatch.agent.progress import Progress

LEARN_BACKWARDS = 8
"""Backwards with every parameter hooked, to learn which gradients are ready last."""
KEEP_LAST = 1
"""Per learning backward, how many of the last hooks to fire keep their hook: one; where the
order varies between backwards, each backward's last one is kept (a Python hook a step each)."""
PAIRS_KEPT = 64
"""Device marks (own gradients ready, backward returned) kept for the publisher: a heartbeat's
backwards at 8 ms steps; past it the oldest are dropped (``GradReady.dropped``)."""
POOL_KEPT = 2 * PAIRS_KEPT + 8
"""CUDA events a ``CudaClock`` keeps for reuse: every mark the queue can hold, and a few."""


class EventClock(Protocol):
    """Marks on a device's stream and the time between them, without waiting for the device."""

    def record(self) -> Any:
        """A mark on the current stream, queued behind the work queued so far."""

    def done(self, mark: Any) -> bool:
        """Whether the device has passed ``mark`` (never blocks)."""

    def seconds(self, start: Any, end: Any) -> float:
        """Seconds between two marks the device has passed (``done``)."""

    def release(self, mark: Any) -> None:
        """``mark`` is no longer read: it may be recorded again."""


class CudaClock:
    """``EventClock`` of one CUDA device: timing events, reused from a small pool."""

    def __init__(self, device: Any, cuda: Any = None) -> None:
        if cuda is None:
            import torch

            cuda = torch.cuda
        self._cuda = cuda
        self._device = device
        self._free: deque[Any] = deque()

    def record(self) -> Any:
        cuda = self._cuda
        if cuda.is_current_stream_capturing():
            raise RuntimeError("a CUDA graph is being captured: no timing events in it")
        try:
            event = self._free.pop()
        except IndexError:
            event = cuda.Event(enable_timing=True)
        event.record(cuda.current_stream(self._device))
        return event

    def done(self, mark: Any) -> bool:
        with self._cuda.device(self._device):  # no context made on another device's behalf
            return bool(mark.query())

    def seconds(self, start: Any, end: Any) -> float:
        with self._cuda.device(self._device):
            return float(start.elapsed_time(end)) / 1000.0  # both done: does not block

    def release(self, mark: Any) -> None:
        if len(self._free) < POOL_KEPT:
            self._free.append(mark)


def cuda_clock(device: Any) -> EventClock | None:
    """The clock of a model's device: ``CudaClock`` on a GPU, none (``perf_counter``) else."""
    if getattr(device, "type", None) != "cuda":
        return None
    return CudaClock(device)


class GradReady:
    """Post-accumulate-grad hooks on DDP models' parameters and the end of each backward.

    ``clock`` gives the clock of a model's device, or None where ``perf_counter`` times it
    (the CPU); the models hooked are timed by one of the two, the first model's."""

    def __init__(
        self, progress: Progress, clock: Callable[[Any], EventClock | None] = cuda_clock
    ) -> None:
        self._progress = progress
        self._clock_for = clock
        self._models: list[int] = []
        self._params: list[weakref.ref[Any]] = []  # every parameter hooked at first, by index
        self._handles: dict[int, Any] = {}  # index -> hook handle, while hooked
        self._order: deque[int] = deque(maxlen=KEEP_LAST)  # the last hooks fired, learning
        self._learning = 0  # learning backwards left
        self._kept: set[int] = set()
        self._device: str | None = None  # the device of the models hooked
        self._on_device = False  # they are timed by a device clock (on or turned off)
        self._clock: EventClock | None = None  # that clock, until a fault turns it off
        self._mark: Any = None  # this backward's last own gradient, on the device
        self._pairs: deque[tuple[Any, Any]] = deque()  # (ready, end) marks, oldest first
        self.dropped = 0  # pairs dropped unread (training thread only)
        self._dropped_read = 0  # of those, accounted for by ``collect``
        self.faults = 0
        self.cuda = False  # a model on a GPU was seen

    # training thread -------------------------------------------------------
    def add_model(self, model: Any) -> None:
        """Hook a ``DistributedDataParallel`` model's parameters (once per model)."""
        try:
            if id(model) in self._models or not is_ddp(model):
                return
            self._models.append(id(model))
            params = [p for p in model.parameters() if getattr(p, "requires_grad", False)]
            if any(getattr(p, "is_cuda", False) for p in params):
                self.cuda = True
            if not params or not hasattr(params[0], "register_post_accumulate_grad_hook"):
                return
            devices = {str(getattr(p, "device", "")) for p in params}
            if len(devices) != 1 or self._device not in (None, *devices):
                return  # one model over several devices, or another device than the first's
            if self._device is None:
                clock = self._clock_for(getattr(params[0], "device", None))  # may fail: no CUDA
                self._clock, self._on_device = clock, clock is not None
                self._device = devices.pop()
            elif self._on_device and self._clock is None:
                return  # the device clock was turned off
            self._unhook()  # learn again, over every model's parameters
            self._params.extend(weakref.ref(p) for p in params)
            self._kept.clear()
            for index in range(len(self._params)):
                self._hook(index)
            self._learning = LEARN_BACKWARDS
            self._progress.grad_hooked = True  # the split is whole from here on
        except Exception:
            self.faults += 1

    def backward_ended(self, *args: Any, **kwargs: Any) -> None:
        """After ``torch.autograd.backward``: the wait since this rank's last gradient."""
        try:
            progress = self._progress
            ready = progress.grad_ready_at
            if ready:
                progress.grad_ready_at = 0.0
                progress.grad_wait_step += time.perf_counter() - ready
            mark = self._mark
            if mark is not None:
                self._mark = None
                self._ended(mark)
            elif self._on_device and self._clock is None and self._handles:
                self._unhook()  # turned off (on the publisher's thread, perhaps): no hooks left
            if self._learning and self._order:
                self._learn()
        except Exception:
            self.faults += 1

    def remove(self) -> None:
        self._unhook()
        self._params.clear()
        self._models.clear()
        self._device, self._on_device, self._clock = None, False, None
        self._mark = None
        self._pairs.clear()
        try:
            self._progress.grad_hooked = False
        except Exception:
            self.faults += 1

    # publisher thread --------------------------------------------------------
    def collect(self) -> float:
        """Seconds of gradient wait measured on the device since the last call: the pairs
        whose marks the device has passed, in order (the rest wait for the next call), with
        the pairs dropped unread counted at the mean of those read. Never waits."""
        clock = self._clock
        if clock is None:
            return 0.0
        pairs = self._pairs
        total, read = 0.0, 0
        try:
            while True:
                try:
                    pair = pairs.popleft()  # the pair is this thread's while it holds it
                except IndexError:
                    break
                ready, end = pair
                if not (clock.done(end) and clock.done(ready)):
                    pairs.appendleft(pair)  # still the oldest: the training thread only appends
                    break
                total += max(0.0, clock.seconds(ready, end))
                read += 1
                clock.release(ready)
                clock.release(end)
        except Exception:
            self._turn_off()
            return 0.0
        if not read:
            return 0.0
        dropped = self.dropped - self._dropped_read
        self._dropped_read += dropped
        return total * (read + dropped) / read

    # the hooks ---------------------------------------------------------------
    def _hook(self, index: int) -> None:
        param = self._params[index]()
        if param is not None and index not in self._handles:
            self._handles[index] = param.register_post_accumulate_grad_hook(self._ready(index))

    def _ready(self, index: int) -> Callable[[Any], None]:
        progress = self._progress
        order = self._order

        def ready(_param: Any) -> None:
            try:
                clock = self._clock
                if clock is not None:
                    self._marked(clock)
                elif not self._on_device:
                    progress.grad_ready_at = time.perf_counter()
                if self._learning:
                    order.append(index)
            except Exception:
                self.faults += 1

        return ready

    def _marked(self, clock: EventClock) -> None:
        """A gradient ready, on the device: the last one of the backward is the one kept."""
        try:
            mark, before = clock.record(), self._mark
            self._mark = mark
            if before is not None:
                clock.release(before)
        except Exception:
            self._turn_off()

    def _ended(self, ready: Any) -> None:
        """Backward returned: queue the pair of marks for the publisher (bounded)."""
        clock = self._clock
        if clock is None:
            return
        try:
            if self._progress.last_step_end is None:
                clock.release(ready)  # the first step is not in the split (as on the CPU)
                return
            pairs = self._pairs
            pairs.append((ready, clock.record()))
            while len(pairs) > PAIRS_KEPT:
                try:
                    old_ready, old_end = pairs.popleft()
                except IndexError:  # the publisher took them meanwhile
                    break
                clock.release(old_ready)
                clock.release(old_end)
                self.dropped += 1
        except Exception:
            self._turn_off()

    def _turn_off(self) -> None:
        """A fault of the device clock: stop timing on the device (either thread)."""
        self.faults += 1
        self._clock = None
        self._mark = None
        try:
            self._progress.grad_hooked = False  # no gradient wait, no compute from here on
        except Exception:
            self.faults += 1

    def _learn(self) -> None:
        """One more backward seen: keep its last hooks; after enough, drop the others."""
        self._kept.update(self._order)
        self._order.clear()
        self._learning -= 1
        if self._learning:
            return
        for index in [i for i in self._handles if i not in self._kept]:
            self._handles.pop(index).remove()

    def _unhook(self) -> None:
        for handle in self._handles.values():
            try:
                handle.remove()
            except Exception:
                self.faults += 1
        self._handles.clear()
        self._order.clear()


class InputTimer:
    """Times a DataLoader iterator's ``__next__`` (``wrap`` makes the replacement): one object
    serves every call; a DataLoader read inside another one counts once.

    ``timing``: the input wait (the step split); ``counting``: the batches drawn per iterator
    (the batch marks). Either may be switched off alone (``agent/switches.py``). Runs once a
    batch: one Python call of its own, no context manager."""

    __slots__ = ("_counting", "_depth", "_progress", "_timing", "faults")

    def __init__(self, progress: Progress, timing: bool = True, counting: bool = True) -> None:
        self._progress = progress
        self._timing = timing
        self._counting = counting
        self._depth = 0
        self.faults = 0

    def wrap(self, original: Callable[..., Any]) -> Callable[..., Any]:
        """``original`` (an iterator's ``__next__``), timed and counted: a batch that came
        counts for its iterator; an exception (``StopIteration`` at an epoch's end) counts
        none, and its time is input wait all the same."""
        timer = self
        progress = self._progress
        clock = time.perf_counter

        def timed_next(iterator: Any, *args: Any, **kwargs: Any) -> Any:
            if timer._depth:
                return original(iterator, *args, **kwargs)
            timer._depth = 1
            start = clock()
            try:
                batch = original(iterator, *args, **kwargs)
            except BaseException:
                timer._depth = 0
                timer._waited(start)
                raise
            timer._depth = 0
            try:
                if timer._timing:
                    progress.input_time_step += clock() - start
                    progress.input_seen = True
                if timer._counting:
                    key = getattr(iterator, SERIAL_ATTR, None)
                    progress.note_draw(iterator_key(iterator) if key is None else key)
            except Exception:
                timer.faults += 1
            return batch

        return timed_next

    def _waited(self, start: float) -> None:
        try:
            if self._timing:
                self._progress.input_time_step += time.perf_counter() - start
                self._progress.input_seen = True
        except Exception:
            self.faults += 1


_SERIALS = itertools.count(1)
SERIAL_ATTR = "_ddpwatch_serial"


def iterator_key(iterator: Any) -> int:
    """A DataLoader iterator's own number, given at its first batch. Not ``id()``: a new
    epoch's iterator often takes the freed address of the last one on one rank and not on
    another, and its batches then counted on from the last epoch's there (a false
    ``step_skew``, "8 against 265", at the first epoch's end). ``id()`` only where the
    iterator takes no attribute."""
    key = getattr(iterator, SERIAL_ATTR, None)
    if key is None:
        key = next(_SERIALS)
        try:
            setattr(iterator, SERIAL_ATTR, key)
        except Exception:
            return -id(iterator)
    return int(key)


def is_ddp(model: Any) -> bool:
    """A ``DistributedDataParallel`` (or a subclass), without importing torch here."""
    return ddp_class(model) is not None


def ddp_class(model: Any) -> Any:
    """torch's ``DistributedDataParallel`` if ``model`` is one (or of a subclass), else None."""
    for cls in type(model).__mro__:
        if cls.__name__ == "DistributedDataParallel" and cls.__module__.startswith("torch."):
            return cls
    return None
