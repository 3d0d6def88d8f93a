"""Framework integrations, imported lazily: ddpwatch never requires Lightning, DeepSpeed or HF.

``adapt(watcher, obj)`` is called by ``Watcher.add_model`` for every object given to
``attach``/``add_model``. Objects are recognised by the names of their classes, so nothing
here imports a framework the training script has not imported itself.

``install(watcher)`` adds post-import hooks for what happens before any object exists:
the phases of ``deepspeed.initialize`` and a ``DDPWatchCallback`` in every Lightning
``Trainer``.
"""

from __future__ import annotations

import contextlib
import logging
import time
import weakref
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpwatch.agent.progress import Progress
    from ddpwatch.agent.watcher import Watcher

log = logging.getLogger("ddpwatch")

# (module prefix, class name) somewhere in the object's class hierarchy -> framework
_KINDS = (
    ("deepspeed.", "DeepSpeedEngine", "deepspeed"),
    ("lightning.pytorch.", "Trainer", "lightning_trainer"),
    ("pytorch_lightning.", "Trainer", "lightning_trainer"),
    ("lightning.pytorch.", "LightningModule", "lightning_module"),
    ("pytorch_lightning.", "LightningModule", "lightning_module"),
    ("transformers.", "Trainer", "hf_trainer"),
    ("accelerate.", "Accelerator", "accelerator"),
)


def framework_of(obj: Any) -> str | None:
    """Which integration handles ``obj`` (by class names, importing nothing), or None."""
    try:
        mro = type(obj).__mro__
    except Exception:
        return None
    for cls in mro:
        module = getattr(cls, "__module__", "") or ""
        for prefix, name, kind in _KINDS:
            if cls.__name__ == name and module.startswith(prefix):
                return kind
    return None


def adapt(watcher: Watcher, obj: Any) -> bool:
    """Hook ``obj`` if it is a framework object an integration handles.

    True: handled, nothing more to do. False: a plain module, or a framework module that
    should get forward hooks as well (a DeepSpeed engine is an ``nn.Module``: its forward
    hooks count forward passes and measure data loading time; steps come from the engine).
    """
    kind = framework_of(obj)
    if kind is None:
        return False
    try:
        if kind == "deepspeed":
            from ddpwatch.integrations.deepspeed import attach_engine

            attach_engine(watcher, obj)
            return False
        if kind == "lightning_trainer":
            from ddpwatch.integrations.lightning import add_callback

            add_callback(obj)
            return True
        if kind == "lightning_module":
            from ddpwatch.integrations.lightning import attach_module

            attach_module(obj)
            return True
        if kind == "hf_trainer":
            from ddpwatch.integrations.huggingface import attach_trainer

            attach_trainer(watcher, obj)
            return True
        if kind == "accelerator":
            from ddpwatch.integrations.huggingface import attach_accelerator

            attach_accelerator(watcher, obj)
            return True
    except Exception as exc:
        log.warning("ddpwatch: could not hook %s, watching it as a plain module: %r", kind, exc)
    return False


def install(watcher: Watcher) -> None:
    """Post-import hooks for frameworks; meant to be called once from ``Watcher.start``."""
    from ddpwatch.agent.auto import after_import
    from ddpwatch.integrations.deepspeed import hook_initialize
    from ddpwatch.integrations.lightning import install_auto_callback

    after_import("deepspeed", lambda module: hook_initialize(watcher, module))
    install_auto_callback()


# --------------------------------------------------------------------------- helpers


def note_forward(progress: Progress) -> None:
    """Count an evaluation batch as progress (the server's ``stalled`` rule reads it)."""
    progress.forwards += 1
    progress.last_progress = time.perf_counter()


_step_owners: weakref.WeakKeyDictionary[Any, weakref.ref[Any]] = weakref.WeakKeyDictionary()


def claim_steps(watcher: Watcher, owner: Any) -> bool:
    """Whether ``owner`` counts this watcher's steps: the first integration to ask does.

    Lightning's DeepSpeed strategy drives a DeepSpeed engine, HF's Trainer may too: both
    would count every step. The one that asks first (the Lightning callback's ``setup``,
    or the engine, created before HF's ``on_train_begin``) keeps counting until it is gone
    or calls ``release_steps``; the other only hands over losses.
    """
    try:
        ref = _step_owners.get(watcher)
        current = ref() if ref is not None else None
        if current is None:
            _step_owners[watcher] = weakref.ref(owner)
            return True
        return current is owner
    except TypeError:  # not weak-referenceable: let it count
        return True


def release_steps(watcher: Watcher, owner: Any) -> None:
    with contextlib.suppress(Exception):
        ref = _step_owners.get(watcher)
        if ref is not None and ref() is owner:
            del _step_owners[watcher]


def count_steps_explicitly(progress: Progress) -> None:
    """From now on steps come from ``watcher.step()``: the global optimizer hook and the
    forward hooks stop counting (what the first explicit ``step()`` does, set before it)."""
    progress.step_mode = "explicit"


class PhaseStack:
    """Phases a callback opens in one hook and closes in another (``on_*_start``/``_end``)."""

    def __init__(self) -> None:
        self._open: list[tuple[str, Any]] = []

    def push(self, watcher: Watcher, name: str) -> None:
        context = watcher.phase(name)
        try:
            context.__enter__()
        except Exception:
            return
        self._open.append((name, context))

    def pop(self, name: str) -> None:
        """Close phase ``name`` (and any left open inside it)."""
        if not any(open_name == name for open_name, _ in self._open):
            return
        while self._open:
            open_name, context = self._open.pop()
            with contextlib.suppress(Exception):
                context.__exit__(None, None, None)
            if open_name == name:
                return

    def top(self) -> str | None:
        return self._open[-1][0] if self._open else None

    def close_all(self) -> None:
        while self._open:
            _, context = self._open.pop()
            with contextlib.suppress(Exception):
                context.__exit__(None, None, None)
