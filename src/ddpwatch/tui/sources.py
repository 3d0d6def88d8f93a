"""Where the dashboard's status documents come from.

The TUI reaches the server only through a ``StatusSource``: ``LocalSource``
reads an in-process ``StatusProvider`` (a ``Server`` or ``ReplayServer``);
``RemoteSource`` asks a running ``ddpwatch serve`` over its ZeroMQ query socket
(port + 1). ``fetch`` runs on a worker
thread, one call at a time, and returns None when no document could be had. For a job of
more than ``PAGED_ABOVE`` ranks both ask for the summary (the worst ranks, counts for all).
"""

from __future__ import annotations

import logging
import os
import signal
import subprocess
from typing import Any, Protocol, runtime_checkable

import msgspec

from ddpwatch.protocol import DEFAULT_PORT
from ddpwatch.server.provider import StatusProvider

log = logging.getLogger("ddpwatch.tui")

PAGED_ABOVE = 4096
"""Above this many ranks the dashboard asks for the summary (counts for every rank, and the
``WORST_SHOWN`` worst ranks) instead of the whole document: tens of megabytes at 65,536
ranks, to build on the server and to decode here every poll."""
WORST_SHOWN = 1000
SUMMARY_QUERY = f"view=summary&worst={WORST_SHOWN}"


def ranks_in(document: dict[str, Any]) -> int:
    """How many ranks the job has: a summary's count, else the document's rank entries."""
    counts = document.get("summary")
    if isinstance(counts, dict) and isinstance(counts.get("ranks"), int):
        return int(counts["ranks"])
    return len(document.get("ranks") or [])


@runtime_checkable
class StatusSource(Protocol):
    """Anything that can hand the dashboard a status document."""

    label: str

    def fetch(self) -> dict[str, Any] | None:
        """The current status document, or None when it cannot be had (shown as disconnected)."""
        ...


class LocalSource:
    """The server runs in this process (``ddpwatch serve``): read its status directly."""

    def __init__(self, server: StatusProvider) -> None:
        self.server = server
        collector = getattr(server, "collector", None)
        port = getattr(collector, "port", None)
        self.label = f"local :{port}" if port is not None else "local"
        host = getattr(collector, "host", None) or "*"
        self.addr = f"{host}:{port}" if port is not None else None
        self.no_ranks = waiting_for_ranks(self.addr)  # the alerts panel's line until ranks report
        state = getattr(server, "state", None)
        self.started: float | None = getattr(state, "started", None)
        self._large = False  # the last document had more than PAGED_ABOVE ranks

    def fetch(self) -> dict[str, Any] | None:
        try:
            document = self._summary() if self._large else None
            document = document if document is not None else self.server.status()
        except Exception:  # the view must survive a failing server: show it as disconnected
            log.exception("status() failed")
            return None
        self._large = ranks_in(document) > PAGED_ABOVE
        return document

    def _summary(self) -> dict[str, Any] | None:
        """The server's summary (``Server.query_json``), if it can give one."""
        query = getattr(self.server, "query_json", None)
        if query is None:
            return None
        document = msgspec.json.decode(query(f"status?{SUMMARY_QUERY}".encode()))
        return document if isinstance(document, dict) and "summary" in document else None

    def close(self) -> None:
        pass


class JobSource(LocalSource):
    """``ddpwatch run --tui``: the local server plus the job it runs, whose state joins the
    label in the header and whose output file the ``o`` screen follows."""

    def __init__(
        self, server: StatusProvider, job: subprocess.Popen[bytes], output_path: str
    ) -> None:
        super().__init__(server)
        self.job = job
        self.output_path = output_path
        # exports go beside the job's log: the files of one run stay together
        self.export_dir = os.path.dirname(os.path.abspath(output_path))
        self.detached = False  # the quit question's "Detach": the job outlives the dashboard
        if self.addr is not None:
            self.no_ranks = f"waiting for the job's ranks on {self.addr}: each reports as it starts"
        self._server_label = self.label
        self._update_label()

    def detach(self) -> None:
        """Leave the job running when the dashboard exits (``ddpwatch run`` says where it is)."""
        self.detached = True

    def fetch(self) -> dict[str, Any] | None:
        self._update_label()
        return super().fetch()

    def _update_label(self) -> None:
        code = self.job.poll()
        self.label = f"{self._server_label}  job {exit_description(code)}"


@runtime_checkable
class ReplayProvider(StatusProvider, Protocol):
    """A ``StatusProvider`` that replays a recording (``ReplayServer``): what ``ReplaySource``
    reads besides the status. A protocol, so that this module imports no server."""

    @property
    def path(self) -> str | os.PathLike[str]:
        """The recording."""
        ...

    @property
    def progress(self) -> float:
        """How far through it the replay is, 0 to 1."""
        ...


class ReplaySource(LocalSource):
    """``ddpwatch replay FILE``: the header names the file and how far the replay has got."""

    def __init__(self, server: ReplayProvider) -> None:
        super().__init__(server)
        self.replay = server
        self.no_ranks = "no ranks in the recording yet"
        self._update_label()

    def fetch(self) -> dict[str, Any] | None:
        document = super().fetch()
        self._update_label()
        return document

    def _update_label(self) -> None:
        self.label = replay_label(self.replay.path, self.replay.progress)


def replay_label(path: str | os.PathLike[str], progress: float) -> str:
    """``replay run.ddpw 37 %`` (rounded down: 100 % only once the whole file is replayed)."""
    return f"replay {os.path.basename(path)} {int(max(0.0, min(1.0, progress)) * 100)} %"


def local_source(server: StatusProvider) -> LocalSource:
    """The source for a server in this process; a ``ReplayServer`` (it has ``path`` and
    ``progress``) gets a ``ReplaySource``."""
    return ReplaySource(server) if isinstance(server, ReplayProvider) else LocalSource(server)


def waiting_for_ranks(addr: str | None) -> str:
    """The alerts panel's line while no rank has reported: where ranks should report, and how."""
    where = f" on {addr}" if addr else ""
    return f"waiting for ranks{where} — set DDPWATCH_ADDR or run under ddpwatch run"


def exit_description(code: int | None) -> str:
    """``running``, ``exited 0``, ``exited 2``, ``killed by SIGKILL``."""
    if code is None:
        return "running"
    if code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exited {code}"


class RemoteSource:
    """A ``ddpwatch serve`` elsewhere, through a ``StatusClient`` (``ddpwatch/client.py``):
    ZeroMQ REQ to ``port + 1``, send ``b"status"``, read JSON."""

    def __init__(
        self, host: str = "127.0.0.1", port: int = DEFAULT_PORT, timeout: float = 1.0
    ) -> None:
        from ddpwatch.client import StatusClient

        self.host, self.port, self.timeout = host, port, timeout
        self.label = f"{host}:{port}"
        self.no_ranks = waiting_for_ranks(self.label)
        self.started: float | None = None
        self.client = StatusClient(host, port, timeout)
        self._large = False  # the last document had more than PAGED_ABOVE ranks
        self._summaries = True  # the server answers summaries

    @property
    def endpoint(self) -> str:
        return self.client.endpoint

    def fetch(self) -> dict[str, Any] | None:
        from ddpwatch.client import StatusQueryError

        document = None
        if self._large and self._summaries:
            try:
                document = self.client.query(SUMMARY_QUERY)
            except StatusQueryError:  # a server from before summaries: whole documents
                self._summaries = False
        if document is None:
            document = self.client.fetch()
        if document is not None:
            self._large = ranks_in(document) > PAGED_ABOVE
        return document

    def close(self) -> None:
        """Close the socket (after a fetch in flight, at most ``timeout`` away) and the context."""
        self.client.close()
