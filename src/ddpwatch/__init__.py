"""ddpwatch: live multi-rank monitoring of distributed PyTorch training.

In each rank::

    import ddpwatch
    watcher = ddpwatch.attach(model)      # before or after init_process_group
    for batch in loader:
        loss = model(batch).sum(); loss.backward(); opt.step()
        ddpwatch.step(loss)               # optional: steps are counted from opt.step()

and ``ddpwatch serve`` on any machine that can reach the ranks. Nothing here
ever raises into training: a fault inside ddpwatch is logged once and the
agent degrades.
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

__version__ = "0.1.0"
__all__ = ["__version__", "attach", "current", "detach", "phase", "step"]

log = logging.getLogger("ddpwatch")
_lock = threading.Lock()
_watcher: Watcher | None = None


def attach(model: Any = None, *, addr: str | None = None, interval: float = 0.5) -> Watcher | None:
    """Start watching this rank and return its ``Watcher`` (the same one on every call).

    ``model`` (a module, DDP-wrapped or not) is hooked to count steps and find
    the loss when ``step()`` is never called. ``addr`` is ``host:port`` of
    ``ddpwatch serve``; default ``$DDPWATCH_ADDR``, else ``$MASTER_ADDR:5599``.
    Returns None only when the agent could not start (the reason is logged)
    or in a worker process spawned by a rank, which never reports as a rank.
    """
    global _watcher
    try:
        with _lock:
            if _watcher is None or not _watcher.active:
                if _in_data_loader_worker():
                    return None  # a data-loader worker, not a rank
                from ddpwatch import integrations  # noqa: F401  registers the frameworks
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
    """Label what the rank does (``with ddpwatch.phase("eval"):``); a no-op without a watcher."""
    watcher = current()
    if watcher is None:
        yield
        return
    with watcher.phase(name):
        yield


def detach() -> None:
    """Stop watching: remove every hook and stop the agent thread. A no-op without a watcher."""
    global _watcher
    with _lock:
        watcher, _watcher = _watcher, None
    if watcher is not None:
        try:
            watcher.detach()
        except Exception as exc:
            log.warning("ddpwatch: error while detaching: %r", exc)
