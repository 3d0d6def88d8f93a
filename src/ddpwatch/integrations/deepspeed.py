"""DeepSpeed: ``ddpwatch.attach(engine)`` counts the engine's steps and reads its loss.

The engine is recognised by class name (``DeepSpeedEngine`` and its subclasses, such as
``PipelineEngine``), so ddpwatch never imports DeepSpeed. On the engine instance:

* ``backward(loss)`` hands ``loss`` to the agent (read later, without a GPU sync);
* ``step()`` counts a step when the engine's ``global_steps`` moved, i.e. once per
  optimizer step, not per micro-batch of gradient accumulation;
* ``train_batch()`` (pipeline engines) counts a step with the loss it returns.

The engine also gets forward hooks (forward passes, data loading time). When a watcher
starts (``install``), ``deepspeed.initialize`` runs in the startup phase ``deepspeed_init``,
the ZeRO optimizer's construction (partitioning) in ``zero_partition``, and the engine it
returns is attached without any call in the training script.
"""

from __future__ import annotations

import contextlib
import weakref
from typing import Any

from ddpwatch.agent.api import WatcherSurface
from ddpwatch.agent.auto import after_import
from ddpwatch.agent.registry import Integration, Kind, framework_of, register
from ddpwatch.core.vocabulary import Phase
from ddpwatch.integrations.shared import hand_over, startup_phase

_engines: weakref.WeakKeyDictionary[Any, EngineHooks] = weakref.WeakKeyDictionary()


def _global_steps(engine: Any) -> int | None:
    try:
        return int(engine.global_steps)
    except Exception:
        return None


class EngineHooks:
    """What ddpwatch wraps on one engine instance."""

    def __init__(self, watcher: WatcherSurface, engine: Any) -> None:
        self.watcher = watcher
        self._engine = weakref.ref(engine)
        self.loss: Any = None
        self.seen = _global_steps(engine)

    def install(self, engine: Any) -> None:
        patches = self.watcher.patches
        patches.wrap(engine, "backward", before=self.before_backward)
        patches.wrap(engine, "step", after=self.after_step)
        if hasattr(engine, "train_batch"):
            patches.wrap(engine, "train_batch", after=self.after_train_batch)
        if hasattr(engine, "eval_batch"):
            patches.wrap(engine, "eval_batch", after=self.after_eval_batch)

    def before_backward(self, loss: Any = None, *args: Any, **kwargs: Any) -> None:
        if loss is not None:
            self.loss = loss
            self.watcher.submit_loss(loss)

    def after_step(self, result: Any, *args: Any, **kwargs: Any) -> None:
        self._count(self.loss)

    def after_train_batch(self, result: Any, *args: Any, **kwargs: Any) -> None:
        self._count(result if hasattr(result, "detach") else self.loss)

    def after_eval_batch(self, result: Any, *args: Any, **kwargs: Any) -> None:
        self.watcher.note_forward()

    def _count(self, loss: Any) -> None:
        engine = self._engine()
        if engine is None:
            return
        steps = _global_steps(engine)
        if steps == self.seen:
            return  # a micro-batch of gradient accumulation: no optimizer step yet
        self.seen = steps
        hand_over(self.watcher, self, True, loss)


def is_engine(obj: Any) -> bool:
    return framework_of(obj) == "deepspeed"


def attach_engine(watcher: WatcherSurface, engine: Any) -> EngineHooks:
    """Count ``engine``'s steps and read its loss; once per engine."""
    hooks = _engines.get(engine)
    if hooks is None or hooks.watcher is not watcher:
        hooks = EngineHooks(watcher, engine)
        hooks.install(engine)
        _engines[engine] = hooks
    watcher.count_steps_explicitly()
    return hooks


def _adapt(watcher: WatcherSurface, engine: Any) -> bool:
    attach_engine(watcher, engine)
    return False  # an nn.Module: forward hooks as well


def hook_initialize(watcher: WatcherSurface, deepspeed: Any) -> None:
    """Phases around ``deepspeed.initialize`` and automatic attach of its engine."""
    patches = watcher.patches
    patches.wrap(
        deepspeed,
        "initialize",
        before=lambda *_, **__: startup_phase(watcher, Phase.DEEPSPEED_INIT),
        after=lambda result, *_, **__: _initialized(watcher, result),
    )
    engine_class = getattr(deepspeed, "DeepSpeedEngine", None)
    if engine_class is not None:
        patches.wrap(
            engine_class,
            "_configure_zero_optimizer",
            before=lambda *_, **__: startup_phase(watcher, Phase.ZERO_PARTITION),
        )


def _initialized(watcher: WatcherSurface, result: Any) -> None:
    engine = result[0] if isinstance(result, (tuple, list)) and result else result
    with contextlib.suppress(Exception):
        if is_engine(engine):
            watcher.add_model(engine)
    startup_phase(watcher, Phase.FIRST_STEP)


def install(watcher: WatcherSurface) -> None:
    """Hook ``deepspeed.initialize`` once DeepSpeed is imported (at once if it is)."""
    after_import("deepspeed", lambda module: hook_initialize(watcher, module))


register(
    Integration(
        "deepspeed",
        kinds=(Kind("deepspeed", (("deepspeed.", "DeepSpeedEngine"),), _adapt),),
        install=install,
    )
)
