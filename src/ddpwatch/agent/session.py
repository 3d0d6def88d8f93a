"""The process's one watcher: what ``ddpwatch.attach``, ``current``, ``step``, ``phase`` and
``detach`` act on.

Here rather than in the package root so that the integrations, which start or find the
watcher from a framework's hook (a Lightning callback, a Trainer callback), reach it without
importing the root, which imports them to register the frameworks. Nothing here raises into
training: a fault is logged once and the rank trains on unwatched.
"""

from __future__ import annotations

import contextlib
import logging
import sys
import threading
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpwatch.agent.watcher import Watcher

log = logging.getLogger("ddpwatch")
_lock = threading.Lock()
_watcher: Watcher | None = None


def attach(model: Any = None, *, addr: str | None = None, interval: float = 0.5) -> Watcher | None:
    """``ddpwatch.attach`` once the frameworks are registered (the root's ``attach`` does it)."""
    global _watcher
    try:
        with _lock:
            if _watcher is None or not _watcher.active:
                if _in_data_loader_worker():
                    return None  # a data-loader worker, not a rank
                from ddpwatch.agent.watcher import Watcher

                watcher = Watcher(addr=addr, interval=interval)
                watcher.start()
                _watcher = watcher
            if model is not None:
                _watcher.add_model(model)
            return _watcher
    except Exception as exc:
        log.warning("ddpwatch: could not attach, training continues unwatched: %r", exc)
        return None


def _in_data_loader_worker() -> bool:
    data = sys.modules.get("torch.utils.data")
    return data is not None and data.get_worker_info() is not None


def current() -> Watcher | None:
    """The active watcher of this process, if any."""
    return _watcher if _watcher is not None and _watcher.active else None


def step(loss: Any = None) -> None:
    """Mark the end of a training step on the current watcher; a no-op without one."""
    watcher = _watcher
    if watcher is not None:
        watcher.step(loss)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label what the rank does; a no-op without a watcher."""
    watcher = current()
    if watcher is None:
        yield
        return
    with watcher.phase(name):
        yield


def detach() -> None:
    """Stop watching: remove every hook and stop the agent thread. A no-op without one."""
    global _watcher
    with _lock:
        watcher, _watcher = _watcher, None
    if watcher is not None:
        try:
            watcher.detach()
        except Exception as exc:
            log.warning("ddpwatch: error while detaching: %r", exc)
