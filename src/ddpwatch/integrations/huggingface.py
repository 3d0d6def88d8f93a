"""Hugging Face: a ``TrainerCallback`` for ``transformers.Trainer``, and Accelerate.

``ddpwatch.attach(trainer)`` adds ``DDPWatchTrainerCallback`` to a ``transformers.Trainer``
and takes each micro-batch's loss from ``trainer.training_step``; the callback alone
(``Trainer(..., callbacks=[DDPWatchTrainerCallback()])``) counts the same steps and takes
the loss from the logs (every ``logging_steps``). One step per ``on_step_end`` (an
optimizer step; ``on_substep_end`` is a micro-batch of gradient accumulation), evaluation
in phase ``evaluation``, checkpoint directories reported from the ranks that write them
(``args.should_save``).

``ddpwatch.attach(accelerator)`` takes the loss from ``accelerator.backward(loss)``; steps
come from the optimizer (``AcceleratedOptimizer`` steps the real optimizer only when
gradients are synchronised). ``accelerate launch`` starts its ranks through torch's elastic
agent: they carry torchrun's variables and ``ddpwatch run`` recognises the launcher.

Importing this module imports neither transformers nor accelerate.
"""

from __future__ import annotations

import contextlib
import os
from typing import TYPE_CHECKING, Any

from ddpwatch.agent import session
from ddpwatch.agent.api import WatcherSurface
from ddpwatch.agent.patches import Patches
from ddpwatch.agent.registry import Integration, Kind, register
from ddpwatch.core.vocabulary import Phase
from ddpwatch.integrations.shared import (
    LazyClass,
    PhaseStack,
    current_watcher,
    hand_over,
    module_getattr,
    training_starts,
)

if TYPE_CHECKING:
    DDPWatchTrainerCallback: type  # built lazily by __getattr__

CHECKPOINT_PREFIX = "checkpoint"  # transformers.trainer_utils.PREFIX_CHECKPOINT_DIR
_patches = Patches()  # per-trainer and per-accelerator wrappers live as long as they do


class TrainerCallbackLogic:
    """The methods of ``DDPWatchTrainerCallback``, free of any transformers import.

    Each takes ``(args, state, control, **kwargs)`` as ``TrainerCallback`` documents; only
    ``state.global_step``, ``args.output_dir`` and ``args.should_save`` are read.
    """

    def __init__(self, watcher: WatcherSurface | None = None, attach: bool = True) -> None:
        super().__init__()
        self.attach = attach
        self._watcher = watcher
        self._phases = PhaseStack()
        self._seen_step: int | None = None
        self._loss: Any = None

    @property
    def watcher(self) -> WatcherSurface | None:
        return current_watcher(self._watcher)

    def on_train_begin(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        watcher = self.watcher
        if watcher is None and self.attach:
            watcher = session.attach()
        if watcher is None:
            return
        watcher.claim_steps(self)
        self._seen_step = getattr(state, "global_step", None)
        training_starts(watcher)

    def on_step_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        watcher = self.watcher
        if watcher is None:
            return
        step = getattr(state, "global_step", None)
        loss, self._loss = self._loss, None
        if hand_over(watcher, self, step != self._seen_step, loss):
            self._seen_step = step

    def on_log(
        self, args: Any, state: Any, control: Any, logs: dict[str, Any] | None = None, **kw: Any
    ) -> None:
        watcher = self.watcher
        loss = (logs or {}).get("loss")
        if watcher is not None and isinstance(loss, (int, float)):
            watcher.submit_loss(float(loss))

    def on_prediction_step(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        watcher = self.watcher
        if watcher is None:
            return
        if self._phases.top() != Phase.EVALUATION:
            self._phases.push(watcher, Phase.EVALUATION)
        with contextlib.suppress(Exception):
            watcher.note_forward()

    def on_evaluate(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.pop(Phase.EVALUATION)

    def on_predict(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.pop(Phase.EVALUATION)

    def on_save(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        watcher = self.watcher
        if watcher is None or not getattr(args, "should_save", True):
            return
        folder = f"{CHECKPOINT_PREFIX}-{getattr(state, 'global_step', 0)}"
        watcher.checkpoint(os.path.abspath(os.path.join(str(args.output_dir), folder)))

    def on_train_end(self, args: Any, state: Any, control: Any, **kwargs: Any) -> None:
        self._phases.close_all()
        watcher = self.watcher
        if watcher is not None:
            watcher.release_steps(self)

    def add_loss(self, loss: Any) -> None:
        """A micro-batch's loss (``training_step``'s return, already divided by the
        accumulation steps): the step's loss is their sum."""
        if loss is None:
            return
        self._loss = loss if self._loss is None else self._loss + loss


_CALLBACK = LazyClass(
    "DDPWatchTrainerCallback",
    TrainerCallbackLogic,
    "transformers:TrainerCallback",
    __name__,
    TrainerCallbackLogic.__doc__,
)


def callback_class() -> type:
    """``DDPWatchTrainerCallback``, a ``transformers.TrainerCallback`` (imports transformers)."""
    return _CALLBACK.get()


__getattr__ = module_getattr(__name__, {"DDPWatchTrainerCallback": callback_class})


def attach_trainer(watcher: WatcherSurface, trainer: Any) -> Any:
    """Add the callback to a ``transformers.Trainer`` and read losses from ``training_step``."""
    handler = getattr(trainer, "callback_handler", None)
    callbacks = getattr(handler, "callbacks", [])
    callback = next((c for c in callbacks if isinstance(c, TrainerCallbackLogic)), None)
    if callback is None:
        callback = callback_class()(watcher=watcher, attach=False)
        trainer.add_callback(callback)
    _patches.wrap(trainer, "training_step", after=lambda loss, *_, **__: callback.add_loss(loss))
    return callback


def attach_accelerator(watcher: WatcherSurface, accelerator: Any) -> None:
    """Read the loss from ``accelerator.backward(loss)``; the optimizer hook counts steps."""

    def before_backward(loss: Any = None, *args: Any, **kwargs: Any) -> None:
        if loss is not None:
            watcher.submit_loss(loss)

    _patches.wrap(accelerator, "backward", before=before_backward)


def _adapt_trainer(watcher: WatcherSurface, trainer: Any) -> bool:
    attach_trainer(watcher, trainer)
    return True


def _adapt_accelerator(watcher: WatcherSurface, accelerator: Any) -> bool:
    attach_accelerator(watcher, accelerator)
    return True


register(
    Integration(
        "huggingface",
        kinds=(
            Kind("hf_trainer", (("transformers.", "Trainer"),), _adapt_trainer),
            Kind("accelerator", (("accelerate.", "Accelerator"),), _adapt_accelerator),
        ),
    )
)
