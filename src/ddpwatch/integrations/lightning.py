"""Lightning: ``DDPWatchCallback`` counts steps, reads the loss and names Lightning's phases.

Use it explicitly::

    from ddpwatch.integrations.lightning import DDPWatchCallback
    trainer = Trainer(..., callbacks=[DDPWatchCallback()])

or let ``ddpwatch run`` (``install_auto_callback``) or ``ddpwatch.attach(trainer)`` /
``ddpwatch.attach(lightning_module)`` add it. Works with ``lightning.pytorch`` and with the
older ``pytorch_lightning`` package; importing this module imports neither: the callback
class is built on first use.

Phases, in the order a ``fit`` goes through them (``rendezvous`` and ``model_wrap`` come
from the watcher's own hooks, inside Lightning's strategy):

``setup`` (prepare_data and the setup hooks) -> ``configure_model`` (this rank's setup
hooks are done: the barrier after them, ``configure_model``, loading ``ckpt_path`` weights)
-> ``strategy_setup`` (moving and wrapping the model, optimizers) -> ``fit_start``
(``on_fit_start`` hooks, restoring the training state) -> ``sanity_check`` ->
``first_step`` -> ``train``; and, when they happen, ``validation``, ``test``, ``predict``,
``checkpoint``.
"""

from __future__ import annotations

import contextlib
import functools
import os
from typing import TYPE_CHECKING, Any

from ddpwatch.agent import session
from ddpwatch.agent.api import WatcherSurface
from ddpwatch.agent.auto import after_import
from ddpwatch.agent.loss import find_loss
from ddpwatch.agent.patches import Patches
from ddpwatch.agent.registry import Integration, Kind, register
from ddpwatch.core.vocabulary import Phase
from ddpwatch.integrations.shared import (
    LazyClass,
    PhaseStack,
    hand_over,
    module_getattr,
    startup_phase,
    training_starts,
)

if TYPE_CHECKING:
    DDPWatchCallback: type  # built lazily by __getattr__

_CLASS_NAMES = {"lightning.pytorch": "DDPWatchCallback", "pytorch_lightning": "PLDDPWatchCallback"}
_TRAINER_MODULES = {
    "lightning.pytorch": "lightning.pytorch.trainer.trainer",
    "pytorch_lightning": "pytorch_lightning.trainer.trainer",
}
_ENTRY_POINTS = ("fit", "validate", "test", "predict")
_auto_installed = False


class CallbackLogic:
    """The hooks of ``DDPWatchCallback``, free of any Lightning import (see the module doc).

    ``watcher``: the watcher to report to; default: the process's current one.
    ``attach``: attach ddpwatch in ``setup`` when no watcher is active yet (True for a
    callback a user adds; the automatic one only reports to a watcher that exists).
    """

    def __init__(self, watcher: WatcherSurface | None = None, attach: bool = True) -> None:
        super().__init__()
        self.attach = attach
        self._watcher = watcher
        self._transient()

    def _transient(self) -> None:
        self._patches = Patches()
        self._phases = PhaseStack()
        self._primary = True
        self._seen_step: int | None = None

    # pickled with the Trainer by ddp_spawn: the watcher and the wrappers stay behind
    def __getstate__(self) -> dict[str, Any]:
        state = dict(self.__dict__)
        for name in ("_watcher", "_patches", "_phases", "_primary", "_seen_step"):
            state.pop(name, None)
        return state

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._watcher = None
        self._transient()

    @property
    def watcher(self) -> WatcherSurface | None:
        """The active watcher this callback reports to, if any."""
        watcher = self._watcher
        if watcher is not None and watcher.active:
            return watcher
        if not self._primary:
            return None
        return session.current()

    def _resolve(self) -> WatcherSurface | None:
        watcher = self.watcher
        if watcher is None and self.attach and self._primary:
            watcher = session.attach()
        return watcher

    # setup and teardown ---------------------------------------------------------------
    def setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        with contextlib.suppress(Exception):  # never break the user's fit
            self._setup(trainer, pl_module, stage)

    def _setup(self, trainer: Any, pl_module: Any, stage: str) -> None:
        first = next((c for c in trainer.callbacks if isinstance(c, CallbackLogic)), self)
        self._primary = first is self  # two of them (user + automatic): one reports
        watcher = self._resolve()
        if watcher is None:
            return
        self._watcher = watcher  # the hooks below run per batch: no lookup there
        if _stage(stage) == "fit":
            watcher.count_steps_explicitly()
            watcher.claim_steps(self)
        self._seen_step = _global_step(trainer)
        startup_phase(watcher, Phase.SETUP)
        patches = self._patches
        patches.restore()  # a second fit/validate on the same objects
        # Callbacks' setup runs before the LightningModule's: when it returns this rank is
        # done with the setup hooks and waits for the others in Lightning's barrier.
        patches.wrap(
            pl_module, "setup", after=lambda *_, **__: self._startup(Phase.CONFIGURE_MODEL)
        )
        strategy = trainer.strategy
        patches.wrap(
            strategy,
            "setup",
            before=lambda *_, **__: self._startup(Phase.STRATEGY_SETUP),
            after=lambda *_, **__: self._after_strategy_setup(trainer),
        )
        patches.wrap(
            trainer, "save_checkpoint", around=lambda *_, **__: watcher.phase(Phase.CHECKPOINT)
        )
        checkpoint_io = getattr(strategy, "checkpoint_io", None)
        if checkpoint_io is not None:
            patches.wrap(checkpoint_io, "save_checkpoint", before=self._writes_checkpoint)

    def teardown(self, trainer: Any, pl_module: Any, stage: str) -> None:
        self._phases.close_all()
        self._patches.restore()
        watcher = self.watcher
        if watcher is not None:
            watcher.release_steps(self)

    def on_exception(self, trainer: Any, pl_module: Any, exception: BaseException) -> None:
        self._phases.close_all()

    def _startup(self, name: str) -> None:
        watcher = self.watcher
        if watcher is not None:
            startup_phase(watcher, name)

    def _after_strategy_setup(self, trainer: Any) -> None:
        if _stage(getattr(trainer.state, "fn", None)) == "fit":
            self._startup(Phase.FIT_START)

    def _writes_checkpoint(self, checkpoint: Any, path: Any, *args: Any, **kwargs: Any) -> None:
        """The checkpoint IO's save: only ranks that really write get here (rank 0 with DDP)."""
        watcher = self.watcher
        if watcher is None:
            return
        text = os.fspath(path) if isinstance(path, os.PathLike) else str(path)
        watcher.checkpoint(text if "://" in text else os.path.abspath(text))

    # training --------------------------------------------------------------------------
    def on_sanity_check_start(self, trainer: Any, pl_module: Any) -> None:
        watcher = self.watcher
        if watcher is not None:
            self._phases.push(watcher, Phase.SANITY_CHECK)

    def on_sanity_check_end(self, trainer: Any, pl_module: Any) -> None:
        self._phases.pop(Phase.SANITY_CHECK)

    def on_train_start(self, trainer: Any, pl_module: Any) -> None:
        watcher = self.watcher
        if watcher is None:
            return
        self._seen_step = _global_step(trainer)
        training_starts(watcher)

    def on_train_batch_end(
        self, trainer: Any, pl_module: Any, outputs: Any, batch: Any, batch_idx: int, *args: Any
    ) -> None:
        """One step per optimizer step: a batch that only accumulates gradients is none."""
        watcher = self.watcher
        if watcher is None:
            return
        try:
            loss = _unscaled_loss(trainer, pl_module, find_loss(outputs))
            step = _global_step(trainer)
            if hand_over(watcher, self, step != self._seen_step, loss):
                self._seen_step = step
        except Exception:
            pass

    # evaluation ------------------------------------------------------------------------
    def on_validation_start(self, trainer: Any, pl_module: Any) -> None:
        watcher = self.watcher
        if watcher is not None and not getattr(trainer, "sanity_checking", False):
            self._phases.push(watcher, Phase.VALIDATION)

    def on_validation_end(self, trainer: Any, pl_module: Any) -> None:
        self._phases.pop(Phase.VALIDATION)

    def on_test_start(self, trainer: Any, pl_module: Any) -> None:
        watcher = self.watcher
        if watcher is not None:
            self._phases.push(watcher, Phase.TEST)

    def on_test_end(self, trainer: Any, pl_module: Any) -> None:
        self._phases.pop(Phase.TEST)

    def on_predict_start(self, trainer: Any, pl_module: Any) -> None:
        watcher = self.watcher
        if watcher is not None:
            self._phases.push(watcher, Phase.PREDICT)

    def on_predict_end(self, trainer: Any, pl_module: Any) -> None:
        self._phases.pop(Phase.PREDICT)

    def on_validation_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kw: Any) -> None:
        self._evaluated()

    def on_test_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kw: Any) -> None:
        self._evaluated()

    def on_predict_batch_end(self, trainer: Any, pl_module: Any, *args: Any, **kw: Any) -> None:
        self._evaluated()

    def _evaluated(self) -> None:
        watcher = self.watcher
        if watcher is not None:
            with contextlib.suppress(Exception):
                watcher.note_forward()


def _stage(fn: Any) -> str:
    """The stage's name, e.g. ``fit`` for ``TrainerFn.FITTING`` or for the string."""
    return str(getattr(fn, "value", fn))


def _global_step(trainer: Any) -> int | None:
    try:
        return int(trainer.global_step)
    except Exception:
        return None


def _unscaled_loss(trainer: Any, pl_module: Any, loss: Any) -> Any:
    """Lightning divides the step output's loss by ``accumulate_grad_batches``: undo it."""
    if loss is None or not getattr(pl_module, "automatic_optimization", True):
        return loss
    factor = getattr(trainer, "accumulate_grad_batches", 1)
    return loss * factor if isinstance(factor, int) and factor > 1 else loss


# --------------------------------------------------------------------------- the class


_DOC = """Reports a Lightning run to ddpwatch: steps, loss, phases, checkpoint writes.

``DDPWatchCallback(watcher=None, attach=True)``; see ``ddpwatch.integrations.lightning``.
"""
_CLASSES = {
    package: LazyClass(name, CallbackLogic, f"{package}:Callback", __name__, _DOC)
    for package, name in _CLASS_NAMES.items()
}


def callback_class(package: str = "lightning.pytorch") -> type:
    """``DDPWatchCallback`` built on ``package``'s ``Callback`` (imports Lightning)."""
    return _CLASSES[package].get()


def _default_class() -> type:
    try:
        return callback_class("lightning.pytorch")
    except ImportError:
        return callback_class("pytorch_lightning")


__getattr__ = module_getattr(
    __name__,
    {
        "DDPWatchCallback": _default_class,
        **{
            name: functools.partial(callback_class, package)
            for package, name in _CLASS_NAMES.items()
        },
    },
)


def _package_of(obj: Any) -> str:
    for cls in type(obj).__mro__:
        module = cls.__module__ or ""
        if module.startswith("pytorch_lightning"):
            return "pytorch_lightning"
        if module.startswith("lightning.pytorch"):
            return "lightning.pytorch"
    return "lightning.pytorch"


def add_callback(trainer: Any, attach: bool = False) -> Any:
    """Put a ``DDPWatchCallback`` first in ``trainer.callbacks`` unless one is there."""
    callbacks = trainer.callbacks
    existing = next((c for c in callbacks if isinstance(c, CallbackLogic)), None)
    if existing is not None:
        return existing
    callback = callback_class(_package_of(trainer))(attach=attach)
    callbacks.insert(0, callback)  # first: its step count is current when others run
    return callback


def attach_module(module: Any) -> None:
    """``ddpwatch.attach(lightning_module)``: its Trainer, now or later, gets the callback."""
    install_auto_callback()
    trainer = getattr(module, "_trainer", None)
    if trainer is not None:
        add_callback(trainer)


def install_auto_callback() -> None:
    """Give every Lightning ``Trainer`` of this process a ``DDPWatchCallback``.

    A post-import hook on ``lightning.pytorch.trainer.trainer`` and
    ``pytorch_lightning.trainer.trainer`` (run at once if already imported) wraps
    ``Trainer.__init__`` and its entry points (``fit``, ``validate``, ``test``, ``predict``):
    each adds the callback unless the trainer has one. The callback reports only to an
    active watcher (``ddpwatch run`` attaches Lightning's ranks at ``init_process_group``).
    Idempotent; imports nothing itself.
    """
    global _auto_installed
    if _auto_installed:
        return
    _auto_installed = True
    for package, module_name in _TRAINER_MODULES.items():
        after_import(module_name, functools.partial(_hook_trainer, package=package))


_class_patches = Patches()  # process-wide, never undone: the callback idles without a watcher


def _hook_trainer(module: Any, package: str) -> None:
    trainer_class = getattr(module, "Trainer", None)
    if trainer_class is None:
        return
    _class_patches.wrap(
        trainer_class, "__init__", after=lambda _, trainer, *a, **k: add_callback(trainer)
    )
    for name in _ENTRY_POINTS:
        _class_patches.wrap(
            trainer_class, name, before=lambda trainer, *a, **k: add_callback(trainer)
        )


def _adapt_trainer(watcher: WatcherSurface, trainer: Any) -> bool:
    add_callback(trainer)
    return True


def _adapt_module(watcher: WatcherSurface, module: Any) -> bool:
    attach_module(module)
    return True


register(
    Integration(
        "lightning",
        kinds=(
            Kind(
                "lightning_trainer",
                (("lightning.pytorch.", "Trainer"), ("pytorch_lightning.", "Trainer")),
                _adapt_trainer,
            ),
            Kind(
                "lightning_module",
                (
                    ("lightning.pytorch.", "LightningModule"),
                    ("pytorch_lightning.", "LightningModule"),
                ),
                _adapt_module,
            ),
        ),
        install=lambda watcher: install_auto_callback(),
        boot=install_auto_callback,
    )
)
