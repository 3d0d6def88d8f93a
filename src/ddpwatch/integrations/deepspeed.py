"""DeepSpeed: ``ddpwatch.attach(engine)`` counts the engine's steps and reads its loss.

The engine is recognised by class name (``DeepSpeedEngine`` and its subclasses, such as
``PipelineEngine``), so ddpwatch never imports DeepSpeed. On the engine instance:

* ``backward(loss)`` hands ``loss`` to the agent (read later, without a GPU sync);
* ``step()`` counts a step when the engine's ``global_steps`` moved, i.e. once per
  optimizer step, not per micro-batch of gradient accumulation;
* ``train_batch()`` (pipeline engines) counts a step with the loss it returns.

The engine also gets forward hooks (forward passes, data loading time). With ``install``
(``ddpwatch.integrations.install``), ``deepspeed.initialize`` runs in the startup phase
``deepspeed_init``, the ZeRO optimizer's construction (partitioning) in ``zero_partition``,
and the engine it returns is attached without any call in the training script.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import TYPE_CHECKING, Any

from ddpwatch.agent.patches import Patches
from ddpwatch.integrations import (
    claim_steps,
    count_steps_explicitly,
    framework_of,
    note_forward,
)

if TYPE_CHECKING:
    from ddpwatch.agent.watcher import Watcher

_engines: weakref.WeakKeyDictionary[Any, EngineHooks] = weakref.WeakKeyDictionary()
_fallback_patches = Patches()


def _patches(watcher: Watcher) -> Any:
    """The watcher's own patches (undone by ``detach``), else ours."""
    return getattr(watcher, "_patches", None) or _fallback_patches


def _global_steps(engine: Any) -> int | None:
    try:
        return int(engine.global_steps)
    except Exception:
        return None


class EngineHooks:
    """What ddpwatch wraps on one engine instance."""

    def __init__(self, watcher: Watcher, engine: Any) -> None:
        self.watcher = watcher
        self._engine = weakref.ref(engine)
        self.loss: Any = None
        self.seen = _global_steps(engine)

    def install(self, engine: Any) -> None:
        patches = _patches(self.watcher)
        patches.wrap(engine, "backward", before=self.before_backward)
        patches.wrap(engine, "step", after=self.after_step)
        if hasattr(engine, "train_batch"):
            patches.wrap(engine, "train_batch", after=self.after_train_batch)
        if hasattr(engine, "eval_batch"):
            patches.wrap(engine, "eval_batch", after=self.after_eval_batch)

    def before_backward(self, loss: Any = None, *args: Any, **kwargs: Any) -> None:
        if loss is not None:
            self.loss = loss
            self.watcher.progress.loss.submit(loss)

    def after_step(self, result: Any, *args: Any, **kwargs: Any) -> None:
        self._count(self.loss)

    def after_train_batch(self, result: Any, *args: Any, **kwargs: Any) -> None:
        self._count(result if hasattr(result, "detach") else self.loss)

    def after_eval_batch(self, result: Any, *args: Any, **kwargs: Any) -> None:
        note_forward(self.watcher.progress)

    def _count(self, loss: Any) -> None:
        engine = self._engine()
        if engine is None:
            return
        steps = _global_steps(engine)
        if steps == self.seen:
            return  # a micro-batch of gradient accumulation: no optimizer step yet
        self.seen = steps
        if claim_steps(self.watcher, self):
            self.watcher.step(loss)
        elif loss is not None:
            self.watcher.progress.loss.submit(loss)


def is_engine(obj: Any) -> bool:
    return framework_of(obj) == "deepspeed"


def attach_engine(watcher: Watcher, engine: Any) -> EngineHooks:
    """Count ``engine``'s steps and read its loss; once per engine."""
    hooks = _engines.get(engine)
    if hooks is None or hooks.watcher is not watcher:
        hooks = EngineHooks(watcher, engine)
        hooks.install(engine)
        _engines[engine] = hooks
    count_steps_explicitly(watcher.progress)
    return hooks


def hook_initialize(watcher: Watcher, deepspeed: Any) -> None:
    """Phases around ``deepspeed.initialize`` and automatic attach of its engine."""
    patches = _patches(watcher)
    patches.wrap(
        deepspeed,
        "initialize",
        before=lambda *_, **__: _startup(watcher, "deepspeed_init"),
        after=lambda result, *_, **__: _initialized(watcher, result),
    )
    engine_class = getattr(deepspeed, "DeepSpeedEngine", None)
    if engine_class is not None:
        patches.wrap(
            engine_class,
            "_configure_zero_optimizer",
            before=lambda *_, **__: _startup(watcher, "zero_partition"),
        )


def _startup(watcher: Watcher, name: str) -> None:
    if watcher.progress.step is None:
        watcher.set_phase(name)


def _initialized(watcher: Watcher, result: Any) -> None:
    engine = result[0] if isinstance(result, (tuple, list)) and result else result
    with contextlib.suppress(Exception):
        if is_engine(engine):
            watcher.add_model(engine)
    _startup(watcher, "first_step")
