"""What the framework callbacks share: the step/loss hand-off, phases held across hooks, the
callback class built on a framework's base class on first use.

Everything here talks to the agent through ``WatcherSurface`` only, and imports no framework.
"""

from __future__ import annotations

import contextlib
import importlib
from collections.abc import Callable
from typing import Any

from ddpwatch.agent import session
from ddpwatch.agent.api import WatcherSurface
from ddpwatch.core.vocabulary import Phase


def current_watcher(watcher: WatcherSurface | None) -> WatcherSurface | None:
    """``watcher`` while it is active, else the process's current one (if any)."""
    if watcher is not None and watcher.active:
        return watcher
    return session.current()


def startup_phase(watcher: WatcherSurface, name: str) -> None:
    """Enter startup phase ``name``, unless the rank has counted a step already."""
    if watcher.in_startup:
        watcher.set_phase(name)


def training_starts(watcher: WatcherSurface) -> None:
    """The training loop begins: steps come from the integration from now on."""
    watcher.count_steps_explicitly()
    watcher.set_phase(Phase.FIRST_STEP if watcher.in_startup else Phase.TRAIN)


def hand_over(watcher: WatcherSurface, owner: Any, moved: bool, loss: Any) -> bool:
    """One step with ``loss`` when the framework's step counter ``moved`` and ``owner`` counts
    this watcher's steps (``claim_steps``); else only the loss, if any. True: a step counted.

    A framework counts optimizer steps: a micro-batch of gradient accumulation leaves its
    counter where it was, and its loss is the step's latest.
    """
    if moved and watcher.claim_steps(owner):
        watcher.step(loss)
        return True
    if loss is not None:
        watcher.submit_loss(loss)
    return False


class PhaseStack:
    """Phases a callback opens in one hook and closes in another (``on_*_start``/``_end``)."""

    def __init__(self) -> None:
        self._open: list[tuple[str, Any]] = []

    def push(self, watcher: WatcherSurface, name: str) -> None:
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


class LazyClass:
    """A class made of ``logic`` (free of any framework import) and a framework's base class
    (``"package:Name"``), built on first use: importing the integration imports nothing.

    The class names ``module`` as its own, whose ``__getattr__`` (``module_getattr``) builds
    it: pickle finds it there (Lightning's ``ddp_spawn`` pickles the callbacks).
    """

    def __init__(self, name: str, logic: type, base: str, module: str, doc: str | None) -> None:
        self.name = name
        self.logic = logic
        self.base = base
        self.module = module
        self.doc = doc
        self._class: type | None = None

    def get(self) -> type:
        cls = self._class
        if cls is None:
            package, _, attribute = self.base.partition(":")
            base = getattr(importlib.import_module(package), attribute)
            cls = type(
                self.name, (self.logic, base), {"__module__": self.module, "__doc__": self.doc}
            )
            cls.__qualname__ = self.name
            self._class = cls
        return cls


def module_getattr(module: str, lazy: dict[str, Callable[[], Any]]) -> Callable[[str], Any]:
    """A module ``__getattr__`` that builds the attributes in ``lazy`` on first access."""

    def __getattr__(name: str) -> Any:
        build = lazy.get(name)
        if build is None:
            raise AttributeError(f"module {module!r} has no attribute {name!r}")
        return build()

    return __getattr__
