"""The dashboard on a large job asks for the summary (counts for every rank, the worst ranks
for the table) instead of the whole status document, tens of megabytes at 65,536 ranks.
Real servers and sockets; the size thresholds are lowered so that 12 ranks count as large."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
from conftest import LiveServer
from test_tui import dashboard, header_text, make_app, poll, settle, shown_ranks

from ddpwatch.protocol import ErrorInfo, Event, Sample
from ddpwatch.server.alerts import Thresholds
from ddpwatch.server.collector import Collector
from ddpwatch.server.service import Server
from ddpwatch.server.state import ServerState
from ddpwatch.server.status import status_document
from ddpwatch.tui import sources
from ddpwatch.tui.header import summarize
from ddpwatch.tui.sources import LocalSource, RemoteSource

RANKS = 12


@pytest.fixture(autouse=True)
def small_large_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "PAGED_ABOVE", 5)
    monkeypatch.setattr(sources, "SUMMARY_QUERY", "view=summary&worst=3")


def fill(state: ServerState, now: float) -> None:
    """12 ranks on 3 hosts at step 40; rank 7 crashed."""
    for rank in range(RANKS):
        sample = Sample(
            v=1, rank=rank, t=0.0, pid=100 + rank, world_size=RANKS, local_rank=rank % 4,
            host=f"node{rank // 4}", device="cpu", step=40 + rank % 2, phase="train",
        )  # fmt: skip
        state.apply(sample, now)
    crash = Event(v=1, rank=7, t=0.0, event="crash", error=ErrorInfo(type="RuntimeError"))
    state.apply(crash, now)


@pytest.fixture
def live(port: int) -> Iterator[LiveServer]:
    server = LiveServer(port, Thresholds())
    with server.server.lock:
        fill(server.server.state, time.time())
    yield server
    server.stop()


def test_a_remote_dashboard_asks_for_the_summary_once_the_job_is_large(live: LiveServer) -> None:
    source = RemoteSource("127.0.0.1", live.port, timeout=5.0)
    try:
        first = source.fetch()
        assert first is not None and len(first["ranks"]) == RANKS and "summary" not in first
        second = source.fetch()
    finally:
        source.close()
    assert second is not None and second["summary"]["ranks"] == RANKS
    assert second["ranks"][0]["rank"] == 7  # the worst (crashed) first
    assert len(second["ranks"]) == 3
    header = summarize(second)
    assert (header["total_ranks"], header["connected_ranks"], header["hosts"]) == (12, 12, 3)
    assert (header["step_min"], header["step_max"], header["listed"]) == (40, 41, 3)
    assert summarize(first)["total_ranks"] == 12 and "listed" not in summarize(first)


def test_a_remote_dashboard_keeps_whole_documents_from_a_server_without_summaries(
    port: int,
) -> None:
    """A server from before summaries answers them with an error: the dashboard goes on with
    whole documents."""
    state = ServerState(started=time.time())
    fill(state, time.time())
    whole = msgspec.json.encode(status_document(state, [], time.time(), Thresholds()))
    collector = Collector(state, lambda: whole, port=port)  # no query callable: errors
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            collector.poll(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    source = RemoteSource("127.0.0.1", port, timeout=5.0)
    try:
        documents = [source.fetch() for _ in range(3)]
    finally:
        source.close()
        stop.set()
        thread.join(5)
        collector.close()
    assert all(d is not None and len(d["ranks"]) == RANKS for d in documents)


def local_server(port: int) -> Server:
    server = Server("127.0.0.1", port, Thresholds())
    fill(server.state, time.time())
    server.tick()
    return server


def test_a_local_dashboard_reads_the_summary_of_its_own_server(port: int) -> None:
    server = local_server(port)
    try:
        source = LocalSource(server)
        assert "summary" not in (source.fetch() or {})
        document: dict[str, Any] | None = source.fetch()
    finally:
        server.collector.close()
    assert document is not None and document["summary"]["ranks"] == RANKS
    assert len(document["ranks"]) == 3


async def test_the_header_says_the_table_holds_the_worst_ranks_only(port: int) -> None:
    server = local_server(port)
    try:
        async with make_app(LocalSource(server)).run_test(size=(140, 30)) as pilot:
            await settle(pilot)
            assert " of 12" not in header_text(pilot)
            await poll(pilot)
            assert "worst 3 of 12" in header_text(pilot)
            assert "ranks 12/12" in header_text(pilot)
            assert shown_ranks(pilot)[0] == 7 and len(shown_ranks(pilot)) == 3
            assert dashboard(pilot).connected
    finally:
        server.collector.close()
