"""ddpwatch's terminal dashboard (Textual): a view over the server's status document.

Entry points: ``run_dashboard(server)`` for ``ddpwatch serve`` and
``run_client(host, port)`` for ``ddpwatch top``; documents come from a
``StatusSource`` (``LocalSource``, ``RemoteSource``). Importing this package
does not import Textual: ``ddpwatch.tui.app`` does.
"""

from ddpwatch.tui.data.sources import LocalSource, RemoteSource, StatusSource

__all__ = ["LocalSource", "RemoteSource", "StatusSource"]
