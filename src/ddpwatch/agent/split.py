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
a stream wait, not a CPU one): models with parameters on a GPU are not hooked, and the rank
reports no gradient wait and no compute time (the input wait, a CPU wait, still holds).
"""

from __future__ import annotations

import time
import weakref
from collections import deque
from collections.abc import Callable
from typing import Any

from ddpwatch.agent.progress import Progress

LEARN_BACKWARDS = 8
"""Backwards with every parameter hooked, to learn which gradients are ready last."""
KEEP_LAST = 2
"""Per learning backward, how many of the last hooks to fire keep their hook."""


class GradReady:
    """Post-accumulate-grad hooks on DDP models' parameters and the end of each backward."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._models: list[int] = []
        self._params: list[weakref.ref[Any]] = []  # every parameter hooked at first, by index
        self._handles: dict[int, Any] = {}  # index -> hook handle, while hooked
        self._order: deque[int] = deque(maxlen=KEEP_LAST)  # the last hooks fired, learning
        self._learning = 0  # learning backwards left
        self._kept: set[int] = set()
        self.faults = 0
        self.cuda = False  # a model on a GPU was seen: CPU timing says nothing there

    # training thread -------------------------------------------------------
    def add_model(self, model: Any) -> None:
        """Hook a ``DistributedDataParallel`` model's parameters (once per model)."""
        try:
            if id(model) in self._models or not _is_ddp(model):
                return
            self._models.append(id(model))
            params = [p for p in model.parameters() if getattr(p, "requires_grad", False)]
            if any(getattr(p, "is_cuda", False) for p in params):
                self.cuda = True
                return
            if not params or not hasattr(params[0], "register_post_accumulate_grad_hook"):
                return
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
            if self._learning and self._order:
                self._learn()
        except Exception:
            self.faults += 1

    def remove(self) -> None:
        self._unhook()
        self._params.clear()
        self._models.clear()
        try:
            self._progress.grad_hooked = False
        except Exception:
            self.faults += 1

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
                progress.grad_ready_at = time.perf_counter()
                if self._learning:
                    order.append(index)
            except Exception:
                self.faults += 1

        return ready

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
    """Times a DataLoader iterator's ``__next__`` (the ``around`` of a ``Patches.wrap``): one
    object serves every call; a DataLoader read inside another one counts once."""

    __slots__ = ("_depth", "_iterator", "_progress", "_start", "faults")

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._depth = 0
        self._start = 0.0
        self._iterator = 0
        self.faults = 0

    def __call__(self, *args: Any, **kwargs: Any) -> InputTimer:
        if self._depth == 0 and args:
            self._iterator = id(args[0])  # the iterator whose ``__next__`` this is
        return self

    def __enter__(self) -> None:
        self._depth += 1
        if self._depth == 1:
            self._start = time.perf_counter()

    def __exit__(self, *exc: object) -> None:
        try:
            self._depth -= 1
            if self._depth == 0:
                progress = self._progress
                progress.input_time_step += time.perf_counter() - self._start
                progress.input_seen = True
                if exc[0] is None:  # a batch came (not StopIteration, not an error)
                    progress.note_draw(self._iterator)
        except Exception:
            self.faults += 1


def _is_ddp(model: Any) -> bool:
    """A ``DistributedDataParallel`` (or a subclass), without importing torch here."""
    return any(
        cls.__name__ == "DistributedDataParallel" and cls.__module__.startswith("torch.")
        for cls in type(model).__mro__
    )
