"""The dashboard on a large job asks for the summary (counts for every rank, the worst ranks
for the table) instead of the whole status document, tens of megabytes at 65,536 ranks; its
filter box narrows what the server sends, its host view reads the server's per-host counts
and its export fetches the whole document. Real servers and sockets; the size thresholds are
lowered so that 12 ranks count as large."""

from __future__ import annotations

import contextlib
import json
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import msgspec
import pytest
from conftest import LiveServer
from tui_pilot import (
    dashboard,
    header_text,
    make_app,
    poll,
    settle,
    shown_ranks,
    table,
    type_text,
)

from ddpwatch.core.protocol import ErrorInfo, Event, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.server.collector import Collector
from ddpwatch.server.document import status_document
from ddpwatch.server.pages import TickView, build_reply
from ddpwatch.server.service import Server
from ddpwatch.state.state import ServerState
from ddpwatch.status.query import Query
from ddpwatch.status.schema import UNSET, StatusDocument, SummaryReply
from ddpwatch.tui.data import sources
from ddpwatch.tui.data.large_job import scope_of
from ddpwatch.tui.data.model import WORST_CRASHED, HostGroup
from ddpwatch.tui.data.sources import LocalSource, RemoteSource
from ddpwatch.tui.widgets.header import summarize

RANKS = 12


@pytest.fixture(autouse=True)
def small_large_job(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(sources, "PAGED_ABOVE", 5)
    monkeypatch.setattr(sources, "SUMMARY_QUERY", Query(view="summary", worst=3))


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


@contextlib.contextmanager
def serving(collector: Collector) -> Iterator[None]:
    """``collector`` polled on a thread, as ``Server.run`` polls it, then closed."""
    stop = threading.Event()

    def serve() -> None:
        while not stop.is_set():
            collector.poll(0.05)

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    try:
        yield
    finally:
        stop.set()
        thread.join(5)
        collector.close()


def test_a_remote_dashboard_asks_for_the_summary_once_the_job_is_large(live: LiveServer) -> None:
    source = RemoteSource("127.0.0.1", live.port, timeout=5.0)
    try:
        first = source.fetch()
        assert type(first) is StatusDocument and len(first.ranks) == RANKS
        second = source.fetch()
    finally:
        source.close()
    assert isinstance(second, SummaryReply) and second.summary.ranks == RANKS
    assert second.ranks[0].rank == 7  # the worst (crashed) first
    assert len(second.ranks) == 3
    header = summarize(second)
    assert (header["total_ranks"], header["connected_ranks"], header["hosts"]) == (12, 12, 3)
    assert (header["step_min"], header["step_max"], header["listed"]) == (40, 41, 3)
    assert summarize(first)["total_ranks"] == 12 and "listed" not in summarize(first)


def test_a_summary_that_does_not_come_in_time_shows_disconnected_not_a_whole_document(
    port: int,
) -> None:
    """A server too busy to summarise a large job in time is not then asked for the whole
    document (tens of megabytes at 65,536 ranks): the poll says disconnected and the next
    one asks for the summary again."""
    state = ServerState(started=time.time())
    fill(state, time.time())
    whole = msgspec.json.encode(status_document(state, [], time.time(), Thresholds()))
    view = TickView(state, [], time.time(), Thresholds())
    summary = msgspec.json.encode(build_reply(view, sources.SUMMARY_QUERY))
    asked: list[str] = []
    slow = threading.Event()

    def snapshot() -> bytes:
        asked.append("whole")
        return whole

    def query(text: bytes) -> bytes:
        asked.append("summary")
        if slow.is_set():
            time.sleep(0.6)  # past the dashboard's timeout
        return summary

    source = RemoteSource("127.0.0.1", port, timeout=0.3)
    with serving(Collector(state, snapshot, port=port, query=query)):
        try:
            assert source.fetch() is not None  # a whole document: the job turns out large
            slow.set()
            assert source.fetch() is None  # the summary came too late
            slow.clear()
            time.sleep(0.5)  # the late reply is dropped with the socket
            assert source.fetch() is not None
        finally:
            source.close()
    assert asked[0] == "whole" and asked.count("whole") == 1, asked


def test_a_remote_dashboard_keeps_whole_documents_from_a_server_without_summaries(
    port: int,
) -> None:
    """A server from before summaries answers them with an error: the dashboard goes on with
    whole documents."""
    state = ServerState(started=time.time())
    fill(state, time.time())
    whole = msgspec.json.encode(status_document(state, [], time.time(), Thresholds()))
    source = RemoteSource("127.0.0.1", port, timeout=5.0)
    with serving(Collector(state, lambda: whole, port=port)):  # no query callable: errors
        try:
            documents = [source.fetch() for _ in range(3)]
        finally:
            source.close()
    assert all(d is not None and len(d.ranks) == RANKS for d in documents)


def local_server(port: int) -> Server:
    """A server holding ``fill``'s ranks, heard once: thresholds long enough that none falls
    silent or stalled while a loaded machine runs the test (seen: 3 ranks 'silent')."""
    server = Server("127.0.0.1", port, Thresholds(stall_after=600.0, silent_after=600.0))
    fill(server.state, time.time())
    server.tick()
    return server


def test_a_local_dashboard_reads_the_summary_of_its_own_server(port: int) -> None:
    server = local_server(port)
    try:
        source = LocalSource(server)
        assert type(source.fetch()) is StatusDocument
        document = source.fetch()
    finally:
        server.collector.close()
    assert isinstance(document, SummaryReply) and document.summary.ranks == RANKS
    assert len(document.ranks) == 3


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


# ------------------------------------------------------------------ what the screen asks for


def test_the_filter_box_becomes_the_servers_scope() -> None:
    hosts = ["node0", "node 1"]
    assert scope_of("r:0-15", hosts) == Query(ranks=frozenset(range(16)))
    assert scope_of("3, 5-7", hosts) == Query(ranks=frozenset({3, 5, 6, 7}))
    scope = scope_of("node 1", hosts)  # a host's exact name, URL-encoded
    assert scope == Query(hosts=frozenset({"node 1"})) and scope.text == "host=node+1"
    assert scope_of("silent", hosts) == Query(states=frozenset({"silent"}))
    assert scope_of("node", hosts) is None  # a word: matched among the ranks held
    assert scope_of("  ", hosts) is None
    assert scope_of("0-99999999", hosts) is None  # more than a query may name


async def test_the_host_view_of_a_large_job_counts_every_rank(port: int) -> None:
    """``g`` on a summary: one row per host from the server's counts, not from the 3 ranks
    the table holds; enter on a host asks the server for that host's worst ranks."""
    server = local_server(port)
    try:
        source = LocalSource(server)
        async with make_app(source).run_test(size=(140, 30)) as pilot:
            await settle(pilot)
            await poll(pilot)
            assert len(shown_ranks(pilot)) == 3
            await pilot.press("g")
            widget = table(pilot)
            hosts = {row.host: row for row in widget.rows if isinstance(row, HostGroup)}
            assert [row.host for row in widget.rows] == ["node1", "node0", "node2"]
            assert [hosts[h].ranks for h in ("node0", "node1", "node2")] == [4, 4, 4]
            assert hosts["node1"].states == {"crashed": 1, "running": 3}
            assert (hosts["node0"].step_min, hosts["node0"].step_max) == (40, 41)
            assert hosts["node1"].flagged >= 1 and hosts["node1"].worst <= WORST_CRASHED
            widget.move_cursor_to_key("node2")
            await pilot.press("enter")
            assert source.scope == Query(hosts=frozenset({"node2"}))
            await settle(pilot)
            assert not widget.grouped and sorted(shown_ranks(pilot)) == [8, 9, 10]
            assert "ranks 12/12" in header_text(pilot)  # the header still counts the job
    finally:
        server.collector.close()


async def test_a_rank_range_on_a_large_job_lists_those_ranks(port: int) -> None:
    server = local_server(port)
    try:
        source = LocalSource(server)
        async with make_app(source).run_test(size=(140, 30)) as pilot:
            await settle(pilot)
            await poll(pilot)
            assert 10 not in shown_ranks(pilot)  # not among the worst 3
            dashboard(pilot).action_filter()
            await type_text(pilot, "r:10-11")
            assert source.scope == Query(ranks=frozenset({10, 11}))
            await settle(pilot)
            assert shown_ranks(pilot) == [10, 11]
            assert "ranks 12/12" in header_text(pilot) and "hosts 3" in header_text(pilot)
            await pilot.press("escape")
            await settle(pilot)
            assert source.scope is None and shown_ranks(pilot)[0] == 7
    finally:
        server.collector.close()


def test_a_scope_the_server_refuses_falls_back_to_the_whole_summary(live: LiveServer) -> None:
    source = RemoteSource("127.0.0.1", live.port, timeout=5.0)
    try:
        source.fetch()  # the job is large: the next fetches ask for summaries
        source.scope = Query(states=frozenset({"sleepy"}))  # no such state: refused
        document = source.fetch()
        source.scope = Query(ranks=frozenset({4, 5}))
        scoped = source.fetch()
    finally:
        source.close()
    assert isinstance(document, SummaryReply) and document.ranks[0].rank == 7
    assert document.scope is UNSET
    assert isinstance(scoped, SummaryReply) and [r.rank for r in scoped.ranks] == [4, 5]
    assert scoped.summary.ranks == RANKS and scoped.scope and scoped.scope.ranks == 2


async def test_export_of_a_large_job_saves_every_rank(
    live: LiveServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    source = RemoteSource("127.0.0.1", live.port, timeout=5.0)
    async with make_app(source).run_test(size=(140, 30)) as pilot:
        await settle(pilot)
        await poll(pilot)
        assert len(shown_ranks(pilot)) == 3
        assert isinstance(dashboard(pilot).document, SummaryReply)
        await pilot.press("e")
        await settle(pilot)
        files = list(tmp_path.glob("ddpwatch-status-*.json"))
        assert len(files) == 1
        saved = json.loads(files[0].read_text())
        assert [r["rank"] for r in saved["ranks"]] == list(range(RANKS))
        assert "summary" not in saved and dashboard(pilot).last_export == files[0]
        assert any("every rank" in n.message for n in pilot.app._notifications)
    source.close()
