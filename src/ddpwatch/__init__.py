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
from collections.abc import Iterator
from types import ModuleType
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpwatch.agent.watcher import Watcher

__version__ = "0.1.0"
__all__ = ["__version__", "attach", "current", "detach", "phase", "step"]

log = logging.getLogger("ddpwatch")
SESSION = "ddpwatch.agent.session"
"""Where the watcher lives (the integrations reach it there, without this package). Looked up
in ``sys.modules``, not imported: importing ``ddpwatch`` alone (the server side) loads no part
of the agent, and a watcher a framework's hook started is the one ``step()`` finds."""


def _session() -> ModuleType | None:
    return sys.modules.get(SESSION)


def attach(model: Any = None, *, addr: str | None = None, interval: float = 0.5) -> Watcher | None:
    """Start watching this rank and return its ``Watcher`` (the same one on every call).

    ``model`` (a module, DDP-wrapped or not) is hooked to count steps and find
    the loss when ``step()`` is never called. ``addr`` is ``host:port`` of
    ``ddpwatch serve``; default ``$DDPWATCH_ADDR``, else ``$MASTER_ADDR:5599``.
    Returns None only when the agent could not start (the reason is logged)
    or in a worker process spawned by a rank, which never reports as a rank.
    """
    try:
        from ddpwatch import integrations  # noqa: F401  registers the frameworks
        from ddpwatch.agent import session
    except Exception as exc:
        log.warning("ddpwatch: could not attach, training continues unwatched: %r", exc)
        return None
    return session.attach(model, addr=addr, interval=interval)


def current() -> Watcher | None:
    """The active watcher of this process, if any."""
    session = _session()
    return session.current() if session is not None else None


def step(loss: Any = None) -> None:
    """Mark the end of a training step on the current watcher; a no-op without one."""
    session = sys.modules.get(SESSION)  # inline: it runs every step
    if session is not None:
        session.step(loss)


@contextlib.contextmanager
def phase(name: str) -> Iterator[None]:
    """Label what the rank does (``with ddpwatch.phase("eval"):``); a no-op without a watcher."""
    session = _session()
    if session is None:
        yield
        return
    with session.phase(name):
        yield


def detach() -> None:
    """Stop watching: remove every hook and stop the agent thread. A no-op without a watcher."""
    session = _session()
    if session is not None:
        session.detach()
