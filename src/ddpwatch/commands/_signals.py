"""Signal handling of the commands that run a server in the foreground."""

from __future__ import annotations

import signal

from ddpwatch.status.provider import StatusProvider


def stop_on_signals(server: StatusProvider) -> None:
    """SIGINT (Ctrl-C) and SIGTERM stop ``server`` (its ``run`` returns) instead of the process."""
    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, lambda *_: server.stop())
