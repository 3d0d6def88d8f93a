"""Where the dashboard's status documents come from.

The TUI reaches the server only through a ``StatusSource``: ``LocalSource``
reads an in-process ``StatusProvider`` (a ``Server`` or ``ReplayServer``);
``RemoteSource`` asks a running ``ddpwatch serve`` over its ZeroMQ query socket
(port + 1). ``fetch`` runs on a worker
thread, one call at a time, and returns None when no document could be had. For a job of
more than ``PAGED_ABOVE`` ranks both ask for the summary (the worst ranks, counts for all),
narrowed to the source's ``scope`` (the ranks or host the filter box names) when it has one;
``whole`` fetches the whole document once, for an export.

A source that runs the job (``JobSource``, the demo's ``DemoSource``) says when its process
ended (``ended``); the dashboard then shows the run's story (``story.py``). Without one, the
job has ended once every rank seen has finished.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import signal
import subprocess
from collections.abc import Callable
from typing import Protocol, runtime_checkable

import msgspec

from ddpwatch.core.protocol import DEFAULT_PORT
from ddpwatch.status.provider import StatusProvider
from ddpwatch.status.query import Query
from ddpwatch.status.schema import StatusDocument, SummaryReply

log = logging.getLogger("ddpwatch.tui")

PAGED_ABOVE = 4096
"""Above this many ranks the dashboard asks for the summary (counts for every rank, and the
``WORST_SHOWN`` worst ranks) instead of the whole document: tens of megabytes at 65,536
ranks, to build on the server and to decode here every poll."""
WORST_SHOWN = 1000
SUMMARY_QUERY = Query(view="summary", worst=WORST_SHOWN)
COUNTS_QUERY = Query(view="summary", worst=0)
EXPORT_TIMEOUT_S = 60.0
"""How long an export waits for the whole document (tens of megabytes on a large job)."""


def ranks_in(document: StatusDocument) -> int:
    """How many ranks the job has: a summary's count, else the document's rank entries."""
    if isinstance(document, SummaryReply):
        return document.summary.ranks
    return len(document.ranks)


def scoped_summary(
    ask: Callable[[Query], SummaryReply | None], scope: Query | None
) -> SummaryReply | None:
    """The summary the dashboard shows, from ``ask`` (a query in, a reply or None out).

    With a ``scope`` (ranks 0-63 or host node7: what the filter box names), the reply
    lists the worst ranks of the scope, its ``scope`` holds the scope's counts and host rows,
    and its ``summary`` still counts the whole job, for the header. A scope the server
    refuses (an ``ask`` that gives None) falls back to the whole job's summary."""
    if scope is None:
        return ask(SUMMARY_QUERY)
    part = ask(dataclasses.replace(scope, view="summary", worst=SUMMARY_QUERY.worst))
    whole = ask(COUNTS_QUERY if part is not None else SUMMARY_QUERY)
    if part is None or whole is None:
        return whole
    return msgspec.structs.replace(part, summary=whole.summary, scope=part.summary)


@runtime_checkable
class StatusSource(Protocol):
    """Anything that can hand the dashboard a status document."""

    label: str

    def fetch(self) -> StatusDocument | None:
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
        self.scope: Query | None = None  # the summary's filter, set by the dashboard

    def fetch(self) -> StatusDocument | None:
        try:
            document: StatusDocument | None = (
                scoped_summary(self._ask, self.scope) if self._large else None
            )
            if document is None:
                document = self.server.status()
        except Exception:  # the view must survive a failing server: show it as disconnected
            log.exception("status() failed")
            return None
        self._large = ranks_in(document) > PAGED_ABOVE
        return document

    def whole(self) -> StatusDocument | None:
        """The whole status document, every rank (an export of a large job)."""
        try:
            return self.server.status()
        except Exception:
            log.exception("status() failed")
            return None

    def _ask(self, query: Query) -> SummaryReply | None:
        """The server's reply to ``status?<query>`` (``Server.query_json``), if it gives one."""
        answer = getattr(self.server, "query_json", None)
        if answer is None:
            return None
        from ddpwatch.status.client import StatusQueryError, decode_reply

        try:
            reply = decode_reply(answer(query.request()), query)
        except StatusQueryError:
            return None
        return reply if isinstance(reply, SummaryReply) else None

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

    @property
    def ended(self) -> bool:
        """The job process has ended: the dashboard says so and shows the run's story."""
        return self.job.poll() is not None

    def fetch(self) -> StatusDocument | None:
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

    def fetch(self) -> StatusDocument | None:
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
        from ddpwatch.status.client import StatusClient

        self.host, self.port, self.timeout = host, port, timeout
        self.label = f"{host}:{port}"
        self.no_ranks = waiting_for_ranks(self.label)
        self.started: float | None = None
        self.client = StatusClient(host, port, timeout)
        self._large = False  # the last document had more than PAGED_ABOVE ranks
        self._summaries = True  # the server answers summaries
        self.scope: Query | None = None  # the summary's filter, set by the dashboard

    @property
    def endpoint(self) -> str:
        return self.client.endpoint

    def fetch(self) -> StatusDocument | None:
        from ddpwatch.status.client import StatusQueryError

        if self._large and self._summaries:
            try:
                # no answer in time is shown as disconnected: asking a server that is slow to
                # summarise for the whole document of a large job would only add to its load
                return self._seen(scoped_summary(self._ask, self.scope))
            except StatusQueryError:  # a server from before summaries: whole documents
                self._summaries = False
        return self._seen(self.client.fetch())

    def _seen(self, document: StatusDocument | None) -> StatusDocument | None:
        if document is not None:
            self._large = ranks_in(document) > PAGED_ABOVE
        return document

    def _ask(self, query: Query) -> SummaryReply | None:
        """The reply to ``status?<query>``; None for a scoped query the server refuses (the
        whole job's summary is shown instead); ``StatusQueryError`` for an unscoped one."""
        from ddpwatch.status.client import StatusQueryError

        try:
            reply = self.client.query(query)
            return reply if isinstance(reply, SummaryReply) else None
        except StatusQueryError:
            if query in (SUMMARY_QUERY, COUNTS_QUERY):
                raise
            return None

    def whole(self) -> StatusDocument | None:
        """The whole status document, every rank (an export of a large job), on a socket of
        its own: the polls' socket is the poll worker's."""
        from ddpwatch.status.client import StatusClient

        client = StatusClient(self.host, self.port, EXPORT_TIMEOUT_S)
        try:
            return client.fetch()
        except ValueError:  # a bad DDPWATCH_SERVER_KEY, which the polls reported already
            return None
        finally:
            client.close()

    def close(self) -> None:
        """Close the socket (after a fetch in flight, at most ``timeout`` away) and the context."""
        self.client.close()

