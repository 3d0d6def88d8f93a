"""The frameworks the agent can hook, as the integrations register them.

Each module of ``ddpwatch.integrations`` registers an ``Integration`` when it is imported:
what it recognises (``Kind``: class names, so nothing here imports a framework the training
script has not imported itself) and how it attaches. ``ddpwatch.attach`` and the
``ddpwatch run`` boot hook import that package; the watcher only asks this registry, so the
agent imports no integration.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddpwatch.agent.api import WatcherSurface

log = logging.getLogger("ddpwatch")


@dataclass(frozen=True)
class Kind:
    """Framework objects one integration hooks.

    ``classes``: (module prefix, class name) pairs, one of which must be somewhere in an
    object's class hierarchy. ``adapt(watcher, obj)`` hooks it and returns True when that is
    all, False when the object (a module) should get forward hooks as well.
    """

    name: str
    classes: tuple[tuple[str, str], ...]
    adapt: Callable[[WatcherSurface, Any], bool]


@dataclass(frozen=True)
class Integration:
    """One framework: the objects it recognises and the hooks it installs.

    ``install(watcher)``: hooks for what happens before any object exists, when a watcher
    starts (post-import hooks: they import nothing). ``boot()``: hooks that need no watcher
    yet, installed by ``ddpwatch run`` at interpreter start.
    """

    name: str
    kinds: tuple[Kind, ...] = ()
    install: Callable[[WatcherSurface], None] | None = None
    boot: Callable[[], None] | None = None


_integrations: dict[str, Integration] = {}


def register(integration: Integration) -> Integration:
    """Add (or, by the same name, replace) an integration."""
    _integrations[integration.name] = integration
    return integration


def integrations() -> tuple[Integration, ...]:
    return tuple(_integrations.values())


def _kind_of(obj: Any) -> Kind | None:
    try:
        mro = type(obj).__mro__
    except Exception:
        return None
    kinds = [kind for integration in _integrations.values() for kind in integration.kinds]
    for cls in mro:
        module = getattr(cls, "__module__", "") or ""
        for kind in kinds:
            for prefix, name in kind.classes:
                if cls.__name__ == name and module.startswith(prefix):
                    return kind
    return None


def framework_of(obj: Any) -> str | None:
    """Which kind of framework object ``obj`` is (by class names, importing nothing), or None."""
    kind = _kind_of(obj)
    return kind.name if kind is not None else None


def adapt(watcher: WatcherSurface, obj: Any) -> bool:
    """Hook ``obj`` if it is a framework object an integration handles.

    True: handled, nothing more to do. False: a plain module, or a framework module that
    should get forward hooks as well (a DeepSpeed engine is an ``nn.Module``: its forward
    hooks count forward passes and measure data loading time; steps come from the engine).
    """
    kind = _kind_of(obj)
    if kind is None:
        return False
    try:
        return kind.adapt(watcher, obj)
    except Exception as exc:
        log.warning(
            "ddpwatch: could not hook %s, watching it as a plain module: %r", kind.name, exc
        )
    return False


def install(watcher: WatcherSurface) -> None:
    """Every integration's hooks for a watcher; called once, from ``Watcher.start``."""
    for integration in integrations():
        if integration.install is not None:
            integration.install(watcher)


def boot() -> None:
    """Every integration's hooks that need no watcher (``ddpwatch run``)."""
    for integration in integrations():
        if integration.boot is not None:
            integration.boot()
