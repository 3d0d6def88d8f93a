"""Whether this rank's own gradients were finite, step by step, before DDP averages them.

DDP's reducer averages every rank's gradients, so one rank's inf or NaN gradient reaches every
rank in the same step, and every rank's loss is NaN from the next step on: the losses alone
cannot tell where it came from. The rank it came from is the one whose *own* gradients went
bad first. A hook on each parameter run once its gradient is accumulated into ``.grad``
(``Tensor.register_post_accumulate_grad_hook``) reads it before DDP's reducer does: the
reducer's own hook is a post hook of the same accumulation, which runs after it, so the
parameter's bucket is not reduced yet (checked under gloo, torch 2.13, with and without
``gradient_as_bucket_view``: each rank's hook sees its own gradient, ``.grad`` ends
averaged). DDP's one communication-hook slot is left to the user.

Why after accumulation rather than on the incoming gradient (``Tensor.register_hook``): a
parameter hooked once keeps torch's Python wrapper for its hooks after the hook is removed,
and torch calls it every backward. For an incoming-gradient hook that wrapper makes a Python
object of the gradient each time: ~3.7k instructions a parameter a step, every parameter
the learning steps below hooked, for the rest of the run (``docs/performance.md``,
section 1). The accumulation hooks share one wrapper a parameter with the step split's
(``agent/split.py``), which hooks the same parameters: the check adds no wrapper of its own.

Only the gradient that arrives last is kept checked: a non-finite gradient anywhere flows
down to every earlier layer's, and the first layer's arrive last (its weight's and its bias's
alike: a non-finite output gradient makes both non-finite). For its first ``LEARN_STEPS``
steps every parameter is hooked and the order they arrive in is noted; then only the last
``KEPT`` of each of those steps stay hooked (every parameter of a 400-tensor model cost a
third of a 7 ms step; each kept one is a Python hook, a view and a sum every step: on a small
model's 1.1 ms step, two kept ones were 0.08 M of the agent's 0.14 M instructions a step,
counted by callgrind, ``docs/performance.md`` section 1). A bad value born in
one late layer's weight gradient alone (an overflow in its product, what GradScaler skips) is
not seen; the loss check still is.

Each hook sums the gradient on its device (one reduction, queued, never read on the training
thread: any inf or NaN makes the sum non-finite). A large gradient is sampled, so that the
check reads a bounded part of it: at most ``SAMPLED`` elements, but at least one of every
slice along its first dimension (a row of a ``Linear`` weight, an output channel of a
convolution, an embedding row), which is how a bad gradient spreads: one non-finite value
in the gradient of a layer's output fills that layer's weight row and every earlier layer's
gradient. When the step ends, the step's sums are
stacked and summed into one scalar handed to the loss ring (``LossReader.submit_grads``),
which the publisher thread reads with the losses, without a device sync: ``grad_nan_step``
is the exact first step of the current run of steps whose own gradients were not finite.
Importing this module does not import torch.
"""

from __future__ import annotations

import functools
import os
import weakref
from typing import Any

from ddpwatch.agent.loss import LossReader

ENV = "DDPWATCH_GRAD_CHECK"
"""``0`` turns the check off (no hooks)."""
SAMPLED = 16384
"""Elements a gradient's check reads at most, unless it has more slices along its first
dimension (then one of each). Below it the whole gradient is summed: making the strided view
is an op of its own, which costs more than summing 16k floats (callgrind, a 64x64 weight:
``docs/performance.md`` section 1)."""
LEARN_STEPS = 4
"""Steps every parameter is checked in, to learn which gradients arrive last."""
KEPT = 1
"""Of each learning step's gradients, the last this many to arrive stay checked."""


class GradCheck:
    """Finite-gradient hooks on watched models' parameters, one check handed over per step."""

    def __init__(self, reader: LossReader) -> None:
        self._reader = reader
        self._hooked: dict[int, weakref.ref[Any]] = {}  # id -> parameter, hooked once each
        self._handles: dict[int, Any] = {}  # id -> its hook's handle
        self._arrived: list[int] = []  # the ids of this step's gradients, in arrival order
        self._last: set[int] = set()  # the last ``KEPT`` of each learning step
        self._learning = LEARN_STEPS
        self._step: int | None = None  # the step the sums below belong to
        self._sums: list[Any] = []
        self._torch: Any = None
        self._tensor: Any = None  # torch.Tensor
        self.enabled = True  # ``DDPWATCH_PROBES=-grads`` (``agent/switches.py``): no hooks
        self.faults = 0

    # training thread -------------------------------------------------------
    def watch(self, model: Any) -> list[Any]:
        """Hook the gradients of a module's (or DDP model's) parameters; the hook handles.

        Plain tensors only: a ``DTensor`` (FSDP2, tensor parallel) is skipped, as its sum
        could need a collective."""
        if not self.enabled or os.environ.get(ENV, "1") == "0":
            return []
        if not hasattr(model, "parameters"):
            return []
        if _is_fsdp(model):
            return []
        import torch

        self._torch, self._tensor = torch, torch.Tensor
        handles = []
        for param in model.parameters():
            if (
                not param.requires_grad
                or not param.is_floating_point()
                or type(param.data) is not torch.Tensor
            ):
                continue
            ref = self._hooked.get(id(param))
            if ref is not None and ref() is param:
                continue
            self._hooked[id(param)] = weakref.ref(param)
            check = functools.partial(self._check, id(param), _stride(param), _sum_dtype(param))
            handle = param.register_post_accumulate_grad_hook(check)
            _run_first(param, handle)
            self._handles[id(param)] = handle
            handles.append(handle)
        self._learning = LEARN_STEPS  # new parameters: learn their order again
        return handles

    def _check(self, key: int, stride: int, dtype: Any, param: Any) -> None:
        """A gradient was accumulated into ``param.grad`` (the autograd thread; the training
        thread waits in backward). Under gradient accumulation ``.grad`` holds the step's
        micro-batches so far: a non-finite one stays non-finite."""
        try:
            grad = param.grad
            if type(grad) is not self._tensor:
                return  # a tensor subclass: its sum might not be a plain local sum
            step = self._reader.step_in_progress()
            if step != self._step:
                if self._sums or self._arrived:
                    self.close()
                self._step = step
            if self._learning:
                self._arrived.append(key)
            if stride > 1 and grad.is_contiguous():  # one view, not a flat one and a slice
                grad = grad.as_strided((-(-grad.numel() // stride),), (stride,))
            self._sums.append(grad.sum() if dtype is None else grad.sum(dtype=dtype))
        except Exception:
            self.faults += 1

    def close(self) -> None:
        """Hand the open step's check over (at the end of a step, or a new step's first
        gradient): one stack and one sum, queued on the device."""
        if self._learning and self._arrived:
            self._learned()
        sums = self._sums
        if not sums:
            return
        self._sums = []
        try:
            total = sums[0] if len(sums) == 1 else _stacked_sum(self._torch, sums)
            self._reader.submit_grads(total, self._step)
        except Exception:
            self.faults += 1

    def _learned(self) -> None:
        """One step's order noted; after ``LEARN_STEPS`` of them, unhook all but the last."""
        self._last.update(self._arrived[-KEPT:])
        self._arrived = []
        self._learning -= 1
        if self._learning:
            return
        for key, handle in list(self._handles.items()):
            if key not in self._last:
                handle.remove()  # removing twice (the model's own detach) is harmless
                del self._handles[key]

    def forget(self) -> None:
        """After the hooks were removed: hook again if the same model is watched again."""
        self._hooked.clear()
        self._handles.clear()
        self._last.clear()
        self._arrived = []
        self._learning = LEARN_STEPS
        self._sums = []


def _run_first(param: Any, handle: Any) -> None:
    """Move the check before the parameter's other accumulation hooks: DeepSpeed's ZeRO
    stages and optimizer-in-backward code register theirs first, and take ``.grad`` away
    (reduced into a bucket, stepped, set to None) before a hook after theirs could read it."""
    hooks = getattr(param, "_post_accumulate_grad_hooks", None)
    if not isinstance(hooks, dict) or len(hooks) < 2:
        return
    # each other hook taken out and put back behind ours, not ``move_to_end``: torch walks
    # the dictionary as a dict, in the order its keys went in, which ``move_to_end`` keeps
    for key in [key for key in hooks if key != handle.id]:
        hooks[key] = hooks.pop(key)


def _stride(param: Any) -> int:
    """Every how many elements a gradient like ``param`` is read (``SAMPLED``)."""
    count = int(param.numel())
    if count <= SAMPLED or param.dim() == 0:
        return 1
    rows = int(param.shape[0])
    return max(1, min(-(-count // SAMPLED), count // max(1, rows)))


def _sum_dtype(param: Any) -> Any:
    """The dtype a gradient like ``param``'s is summed in, float32 at least (a half-precision
    sum of finite values may overflow); None for its own dtype (no ``dtype`` argument: parsing
    it costs a third of a small sum)."""
    import torch

    if param.dtype in (torch.float32, torch.float64):
        return None
    return torch.float32


def _stacked_sum(torch: Any, sums: list[Any]) -> Any:
    """One scalar, not finite when any of ``sums`` is not: two added (one op instead of a
    stack and a sum), more stacked (gradient accumulation: one a backward)."""
    try:
        if len(sums) <= 2:
            total = sums[0]
            for value in sums[1:]:
                total = total + value
            return total
        return torch.stack(sums).sum()
    except RuntimeError:  # parameters on several devices: gather the sums on the first one
        device = sums[0].device
        return torch.stack([s.to(device, non_blocking=True) for s in sums]).sum()


def _is_fsdp(model: Any) -> bool:
    """FSDP shards its parameters and reduces their gradients itself: not checked here."""
    return any(cls.__name__.startswith("FullyShard") for cls in type(model).__mro__)
