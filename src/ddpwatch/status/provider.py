"""What the views need of a server: ``StatusProvider``, and running one in the background.

``Server`` (live) and ``ReplayServer`` (a recording) both provide it; the dashboard,
``ddpwatch run`` and ``ddpwatch demo`` run either on a daemon thread with ``in_background``.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Protocol, runtime_checkable

from ddpwatch.status.schema import StatusDocument

JOIN_S = 5.0  # how long a stopped server gets to close its sockets and recording


@runtime_checkable
class StatusProvider(Protocol):
    """A server the views can read: ``run`` feeds it until ``stop`` (from any thread), and
    ``status`` returns the current status document (thread-safe, read-only)."""

    def status(self) -> StatusDocument: ...

    def run(self) -> None: ...

    def stop(self) -> None: ...


@contextmanager
def in_background(
    server: StatusProvider, name: str = "ddpwatch-server", join_s: float = JOIN_S
) -> Iterator[threading.Thread]:
    """Run ``server`` on a daemon thread for the ``with`` block; then stop it and wait for
    its thread (at most ``join_s`` seconds)."""
    thread = threading.Thread(target=server.run, name=name, daemon=True)
    thread.start()
    try:
        yield thread
    finally:
        server.stop()
        thread.join(join_s)
