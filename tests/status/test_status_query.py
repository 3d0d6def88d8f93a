"""Paged status queries (docs/status.md, "Summary and pages"): the parser, summaries and pages
over real ZeroMQ sockets, the CLI flags, and that a page never builds every rank entry."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Iterator
from typing import Any

import msgspec
import pytest
import zmq
from conftest import free_port_pair

from ddpwatch.cli import main
from ddpwatch.core.protocol import ErrorInfo, Event, Sample, encode
from ddpwatch.core.ranges import parse_rank_ranges
from ddpwatch.core.vocabulary import RANK_STATES
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.server import pages
from ddpwatch.server.pages import TickView
from ddpwatch.server.service import Server
from ddpwatch.state.state import ServerState
from ddpwatch.status.client import StatusClient, StatusQueryError, fetch_status
from ddpwatch.status.order import worst_ranks
from ddpwatch.status.query import Query, QueryError
from ddpwatch.status.schema import PageReply, StatusDocument, SummaryReply
from ddpwatch.tui.data.model import index_alerts, is_flagged

pytestmark = pytest.mark.xdist_group("status_query")  # one worker: its module fixture

CONTRACT_KEYS = [
    "schema", "server_time", "world_size", "ranks", "alerts", "stats", "history", "job_started",
    "relays", "attempt", "attempts", "verdict",
]  # fmt: skip
WORLD = 14  # ranks 0-11 report; 12 and 13 never do
HOSTS = {**dict.fromkeys(range(4), "node-a"), **dict.fromkeys(range(4, 8), "node-b")}
HOSTS.update(dict.fromkeys(range(8, 12), "node-c"))
SILENT, CRASHED, MISSING = (2, 9), 5, (12, 13)
STEP0 = 10

# ------------------------------------------------------------------------------ rank lists


@pytest.mark.parametrize(
    ("text", "ranks"),
    [
        ("0-3,7", [0, 1, 2, 3, 7]),
        ("5", [5]),
        (" 0 - 2 , 9 ", [0, 1, 2, 9]),
        ("3-3,1-2,2", [1, 2, 3]),
        ("0-1048575", list(range(1 << 20))),  # exactly the cap
    ],
)
def test_rank_lists_parse(text: str, ranks: list[int]) -> None:
    assert sorted(parse_rank_ranges(text)) == ranks


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ("", "empty rank list"),
        ("0,,3", "not a rank"),
        ("-1", "not a rank"),
        ("a-b", "not a rank"),
        ("1.5", "not a rank"),
        ("9-3", "runs backwards"),
        ("0-1048576", "more than 1048576 ranks"),
        ("0-99999999999", "not a rank"),  # more digits than any rank has
        ("0-600000,600001-1200000", "more than 1048576 ranks"),
        ("٣", "not a rank"),  # a digit, but not an ASCII one
    ],
)
def test_bad_rank_lists_say_why_in_one_line(text: str, reason: str) -> None:
    with pytest.raises(ValueError, match=reason) as raised:
        parse_rank_ranges(text)
    assert "\n" not in str(raised.value)


def test_a_rank_list_is_capped_by_its_limit() -> None:
    assert parse_rank_ranges("0-9", limit=10) == frozenset(range(10))
    with pytest.raises(ValueError, match="more than 10 ranks"):
        parse_rank_ranges("0-9,20", limit=10)


# ------------------------------------------------------------------------------ requests


def test_requests_parse_into_queries() -> None:
    assert Query.from_request(b"status?") == Query()
    assert Query.from_request(b"status?view=summary&worst=0") == Query(view="summary", worst=0)
    query = Query.from_request(b"status?ranks=0-3%2C9&state=silent,crashed&host=a,b&offset=4&limit=1")
    assert query == Query(
        ranks=frozenset({0, 1, 2, 3, 9}),
        states=frozenset({"silent", "crashed"}),
        hosts=frozenset({"a", "b"}),
        offset=4,
        limit=1,
    )
    assert Query.from_request(b"  status?limit=5000\n").limit == 5000


@pytest.mark.parametrize(
    ("request_", "reason"),
    [
        (b"drop tables", "unknown request"),
        (b"statusx", "unknown request"),
        (b"\xff\xfe", "not UTF-8"),
        (b"status?colour=red", "unknown key 'colour'"),
        (b"status?limit=1&limit=2", "limit given more than once"),
        (b"status?limit", "not a URL query string"),
        (b"status?limit=1&&offset=2", "not a URL query string"),
        (b"status?ranks=%FF", "not a URL query string"),
        (b"status?view=table", "view must be page or summary"),
        (b"status?view=summary&limit=3", "a summary takes worst"),
        (b"status?worst=3", "a page takes offset and limit"),
        (b"status?ranks=", "ranks: empty rank list"),
        (b"status?ranks=-4", "ranks: not a rank"),
        (b"status?state=sleepy", "state: unknown 'sleepy'"),
        (b"status?state=silent,", "state: an empty name"),
        (b"status?host=", "host: an empty name"),
        (b"status?offset=-1", "offset must be a whole number from 0"),
        (b"status?offset=+1", "offset must be"),
        (b"status?limit=0", "limit must be a whole number from 1 to 5000"),
        (b"status?limit=5001", "limit must be"),
        (b"status?limit=1e3", "limit must be"),
        (b"status?view=summary&worst=1001", "worst must be a whole number from 0 to 1000"),
        (b"status?" + b"&".join([b"view=page"] * 20), "not a URL query string"),
    ],
)
def test_bad_requests_are_refused_with_a_reason(request_: bytes, reason: str) -> None:
    with pytest.raises(QueryError, match=reason) as raised:
        Query.from_request(request_)
    assert "\n" not in str(raised.value)


def test_a_query_writes_what_the_server_reads() -> None:
    summary = Query(
        view="summary", ranks=frozenset({3, 0, 1, 2, 9}), states=frozenset({"silent", "crashed"})
    )
    assert summary.text == "view=summary&ranks=0-3,9&state=crashed,silent"
    page = Query(hosts=frozenset({"node 3"}), offset=5, limit=10)
    assert page.text == "host=node+3&offset=5&limit=10"
    assert Query().text == "" and Query().request() == b"status?"
    assert Query(view="summary", worst=0).text == "view=summary&worst=0"
    for query in (summary, page, Query(ranks=frozenset({0, 1}), hosts=frozenset({"a", "b"}))):
        assert Query.from_request(query.request()) == query


# ------------------------------------------------------------------------------ a live server


class FrozenClock:
    """The server's clock, moved only by the test: ranks' states stay put while it looks."""

    def __init__(self) -> None:
        self.now = 1_000_000.0

    def __call__(self) -> float:
        return self.now


class Running:
    """A real ``Server`` on a thread (like ``conftest.LiveServer``), on a frozen clock."""

    def __init__(self) -> None:
        self.port = free_port_pair()
        self.clock = FrozenClock()
        self.server = Server(
            "127.0.0.1", self.port, Thresholds(stall_after=600.0), clock=self.clock
        )
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()

    def push(self, frames: list[bytes], received: int) -> None:
        sock = zmq.Context.instance().socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 2000)
        sock.connect(f"tcp://127.0.0.1:{self.port}")
        for frame in frames:
            sock.send(frame)
        sock.close()
        self.wait(lambda doc: doc["stats"]["received"] >= received)

    def wait(self, predicate: Any, timeout: float = 10) -> dict[str, Any]:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            document = json.loads(self.server.status_json())
            if predicate(document):
                return document
            time.sleep(0.05)
        raise AssertionError(f"timed out; last status:\n{self.server.status()}")

    def ask(self, request: bytes) -> dict[str, Any]:
        sock = zmq.Context.instance().socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        sock.connect(f"tcp://127.0.0.1:{self.port + 1}")
        try:
            sock.send(request)
            assert sock.poll(5000), f"no answer to {request!r}"
            reply: dict[str, Any] = json.loads(sock.recv())
            return reply
        finally:
            sock.close()

    def stop(self) -> None:
        self.server.stop()
        self.thread.join(5)


def beat(rank: int, **fields: Any) -> bytes:
    base = {
        "world_size": WORLD,
        "host": HOSTS[rank],
        "pid": 100 + rank,
        "local_rank": rank % 4,
        "device": f"cuda:{rank % 4}",
        "step": STEP0 + rank,
        "gpu_mem_used_bytes": 1000 * (rank + 1),
        "mem_allocated_bytes": 100 * (rank + 1),
        "step_time_s": 0.25 * (rank + 1),
    }
    return encode(Sample(v=1, rank=rank, t=time.time(), **{**base, **fields}))


@pytest.fixture(scope="module")
def job() -> Iterator[Running]:
    """Twelve ranks on three hosts: two silent, one crashed, two never connected."""
    running = Running()
    try:
        crash = Event(v=1, rank=CRASHED, t=time.time(), event="crash", error=ErrorInfo(type="E"))
        running.push([beat(r) for r in range(12)] + [encode(crash)], received=13)
        running.clock.now += 60  # past the silent and the connect thresholds
        alive = [r for r in range(12) if r not in (*SILENT, CRASHED)]
        running.push([beat(r) for r in alive], received=13 + len(alive))
        running.wait(lambda doc: {a["kind"] for a in doc["alerts"]} >= {"crashed"})
        running.clock.now += 1  # a tick has found the warnings: past their raise hold
        kinds = {"crashed", "not_connected"}
        running.wait(lambda doc: {a["kind"] for a in doc["alerts"]} >= kinds)
        yield running
    finally:
        running.stop()


def states_of(document: dict[str, Any]) -> dict[int, str]:
    return {entry["rank"]: entry["state"] for entry in document["ranks"]}


def test_the_full_document_is_unchanged(job: Running) -> None:
    full = job.ask(b"status")
    assert list(full) == CONTRACT_KEYS and "page" not in full and "summary" not in full
    assert [e["rank"] for e in full["ranks"]] == list(range(WORLD))
    assert full == json.loads(job.server.status_json())


def test_the_job_is_as_built(job: Running) -> None:
    states = states_of(job.ask(b"status"))
    assert [r for r, s in states.items() if s == "silent"] == list(SILENT)
    assert [r for r, s in states.items() if s == "crashed"] == [CRASHED]
    assert [r for r, s in states.items() if s == "not_connected"] == list(MISSING)


def test_a_page_holds_the_matching_entries_in_the_documents_format(job: Running) -> None:
    full = job.ask(b"status")
    page = job.ask(b"status?state=silent,crashed,not_connected")
    assert list(page) == [*CONTRACT_KEYS, "page"]
    assert page["page"] == {"view": "page", "total": WORLD, "matched": 5, "offset": 0, "limit": 500}
    assert [e["rank"] for e in page["ranks"]] == [2, 5, 9, 12, 13]
    by_rank = {e["rank"]: e for e in full["ranks"]}
    for entry in page["ranks"]:
        assert entry == by_rank[entry["rank"]]  # the same entry, field for field
    assert page["alerts"] == full["alerts"] and page["world_size"] == WORLD


@pytest.mark.parametrize(
    ("request_", "ranks", "matched"),
    [
        (b"status?ranks=0-3,12", [0, 1, 2, 3, 12], 5),
        (b"status?ranks=10-99", [10, 11, 12, 13], 4),  # beyond the job: not there
        (b"status?host=node-b", [4, 5, 6, 7], 4),
        (b"status?host=node-a,node-c&state=silent", [2, 9], 2),
        (b"status?host=node-b&state=running", [4, 6, 7], 3),
        (b"status?ranks=0-7&state=running", [0, 1, 3, 4, 6, 7], 6),
        (b"status?state=running&offset=2&limit=3", [3, 4, 6], 9),
        (b"status?offset=12", [12, 13], 14),
        (b"status?offset=99", [], 14),
        (b"status?limit=2", [0, 1], 14),
        (b"status?state=not_connected", [12, 13], 2),
        (b"status?host=node-z", [], 0),
        (b"status?state=stalled", [], 0),
        (b"status?", list(range(WORLD)), 14),
    ],
)
def test_page_filters_and_slices(
    job: Running, request_: bytes, ranks: list[int], matched: int
) -> None:
    page = job.ask(request_)
    assert [e["rank"] for e in page["ranks"]] == ranks
    assert page["page"]["matched"] == matched and page["page"]["total"] == WORLD


def test_the_summary_counts_what_the_full_document_shows(job: Running) -> None:
    full = job.ask(b"status")
    reply = job.ask(b"status?view=summary")
    assert list(reply) == [*CONTRACT_KEYS, "summary", "page"]
    summary = reply["summary"]
    counted = {s: sum(1 for e in full["ranks"] if e["state"] == s) for s in RANK_STATES}
    assert summary["states"] == counted and list(summary["states"]) == list(RANK_STATES)
    assert summary["ranks"] == WORLD and summary["hosts_omitted"] == 0
    assert reply["page"] == {"view": "summary", "total": WORLD, "matched": WORLD, "worst": 20}
    assert summary["hosts"] == [
        {
            "host": "node-a", "ranks": 4, "states": {"silent": 1, "running": 3},
            "flagged": 4, "step_min": STEP0, "step_max": STEP0 + 3,
            "step_time_max_s": 1.0, "mem_allocated_sum_bytes": 1000,
            "gpu_mem_used_max_bytes": 4000,
        },
        {
            "host": "node-b", "ranks": 4, "states": {"crashed": 1, "running": 3},
            "flagged": 1, "step_min": STEP0 + 4, "step_max": STEP0 + 7,
            "step_time_max_s": 2.0, "mem_allocated_sum_bytes": 2600,
            "gpu_mem_used_max_bytes": 8000,
        },
        {
            "host": "node-c", "ranks": 4, "states": {"silent": 1, "running": 3},
            "flagged": 1, "step_min": STEP0 + 8, "step_max": STEP0 + 11,
            "step_time_max_s": 3.0, "mem_allocated_sum_bytes": 4200,
            "gpu_mem_used_max_bytes": 12000,
        },
        {
            "host": None, "ranks": 2, "states": {"not_connected": 2},
            "flagged": 2, "step_min": None, "step_max": None, "step_time_max_s": None,
            "mem_allocated_sum_bytes": None, "gpu_mem_used_max_bytes": None,
        },
    ]  # fmt: skip
    typed = msgspec.convert(full, StatusDocument)
    index = index_alerts(typed.alerts)  # the dashboard's ``a`` (flagged) counts the same
    for row in summary["hosts"]:
        on_host = [e for e in typed.ranks if e.host == row["host"]]
        assert row["flagged"] == sum(is_flagged(e, index) for e in on_host)


def test_the_summary_lists_the_worst_ranks_first(job: Running) -> None:
    reply = job.ask(b"status?view=summary&worst=6")
    assert [e["rank"] for e in reply["ranks"]] == [5, 2, 9, 12, 13, 0]
    full = {e["rank"]: e for e in job.ask(b"status")["ranks"]}
    assert all(entry == full[entry["rank"]] for entry in reply["ranks"])
    assert job.ask(b"status?view=summary&worst=0")["ranks"] == []


def test_filters_narrow_the_summary(job: Running) -> None:
    reply = job.ask(b"status?view=summary&host=node-b")
    assert reply["summary"]["ranks"] == 4 and [h["host"] for h in reply["summary"]["hosts"]] == [
        "node-b"
    ]
    assert reply["summary"]["states"]["crashed"] == 1 and reply["summary"]["states"]["silent"] == 0
    assert reply["page"]["matched"] == 4 and reply["page"]["total"] == WORLD
    assert [e["rank"] for e in reply["ranks"]] == [5, 4, 6, 7]


def test_bad_requests_get_an_error_and_the_socket_answers_on(job: Running) -> None:
    for request in (b"status?view=table", b"status?nope=1", b"\xff", b"status?ranks=9-1", b""):
        reply = job.ask(request)
        assert list(reply) == ["error"] and "\n" not in reply["error"], request
    assert job.ask(b"status?limit=1")["ranks"][0]["rank"] == 0
    assert list(job.ask(b"status")) == CONTRACT_KEYS


def test_the_client_asks_for_pages_and_raises_on_a_refusal(job: Running) -> None:
    page = fetch_status("127.0.0.1", job.port, 2.0, query=Query(states=frozenset({"silent"})))
    assert isinstance(page, PageReply) and [e.rank for e in page.ranks] == list(SILENT)
    client = StatusClient("127.0.0.1", job.port, 2.0)
    try:
        summary = client.query(Query(view="summary", worst=1))
        assert isinstance(summary, SummaryReply) and summary.ranks[0].rank == CRASHED
        with pytest.raises(StatusQueryError, match="limit must be a whole number"):
            client.query(Query(limit=0))
        with pytest.raises(StatusQueryError, match="over the server's 4096"):
            client.query(Query(ranks=frozenset(range(0, 4000, 2))))
        assert client.fetch() is not None  # the same socket still works
    finally:
        client.close()
    document = fetch_status("127.0.0.1", job.port, 2.0)
    assert type(document) is StatusDocument


# ------------------------------------------------------------------------------ the CLI


def test_cli_summary(job: Running, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--port", str(job.port), "--summary"]) == 0
    out = capsys.readouterr().out
    assert "14 ranks: 1 crashed, 2 silent, 2 not_connected, 9 running" in out
    assert "node-b" in out and "1 crashed, 3 running" in out and "14-17" in out
    assert "worst 14 ranks:" in out
    worst = out.split("worst 14 ranks:\n")[1].splitlines()
    assert worst[0].split()[:2] == ["rank", "host"] and worst[1].split()[0] == "5"
    assert main(["status", "--port", str(job.port), "--summary", "--limit", "2"]) == 0
    assert "worst 2 ranks:" in capsys.readouterr().out


def test_cli_state_filter_prints_a_table(job: Running, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--port", str(job.port), "--state", "silent,crashed"]) == 0
    out = capsys.readouterr().out
    rows = [line.split()[0] for line in out.splitlines()[1:4]]
    assert rows == ["2", "5", "9"]
    assert "ranks 1-3 of 3 matching (14 in all)" in out
    assert main(["status", "--port", str(job.port), "--on-host", "node-c", "--limit", "3"]) == 0
    out = capsys.readouterr().out
    assert "ranks 1-3 of 4 matching" in out and "--offset 3 for more" in out


def test_cli_json_page(job: Running, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--port", str(job.port), "--json", "--ranks", "0-3"]) == 0
    page = json.loads(capsys.readouterr().out)
    assert [e["rank"] for e in page["ranks"]] == [0, 1, 2, 3] and page["page"]["matched"] == 4
    assert main(["status", "--port", str(job.port), "--json", "--summary"]) == 0
    assert json.loads(capsys.readouterr().out)["summary"]["ranks"] == WORLD
    assert main(["status", "--port", str(job.port), "--json"]) == 0
    assert list(json.loads(capsys.readouterr().out)) == CONTRACT_KEYS  # as before


def test_cli_refusals_are_one_line(job: Running, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["status", "--port", str(job.port), "--limit", "6000"]) == 1
    err = capsys.readouterr().err.strip()
    assert err.count("\n") == 0 and "refused the query: limit must be" in err
    assert main(["status", "--port", str(job.port), "--summary", "--offset", "3"]) == 2
    assert capsys.readouterr().err.strip().count("\n") == 0
    for flag, value in (("--state", "sleepy"), ("--ranks", "3-1"), ("--offset", "-1")):
        with pytest.raises(SystemExit) as exited:
            main(["status", "--port", str(job.port), flag, value])
        assert exited.value.code == 2
        assert f"error: argument {flag}:" in capsys.readouterr().err


# ------------------------------------------------------------------------------ cost


def big_state(ranks: int, state: ServerState | None = None) -> ServerState:
    """``ranks`` ranks on hosts of eight, at step 7; ten more below the world size never came."""
    state = state or ServerState(started=0.0)
    for rank in range(ranks):
        sample = Sample(
            v=1, rank=rank, t=0, world_size=ranks + 10, host=f"node{rank // 8}", pid=rank, step=7
        )
        state.apply(sample, 1.0)
    return state


def test_a_page_builds_only_its_entries(port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    built: list[int] = []
    real = pages.rank_entry

    def counting(record: Any, *args: Any, **kwargs: Any) -> dict[str, Any]:
        built.append(record.rank)
        return real(record, *args, **kwargs)

    monkeypatch.setattr(pages, "rank_entry", counting)
    clock = FrozenClock()
    server = Server("127.0.0.1", port, clock=clock)  # not running: its methods are called here
    try:
        big_state(20_000, server.state)
        clock.now = 2.0
        page = msgspec.json.decode(server.query_json(b"status?offset=19990&limit=50"))
        assert [e["rank"] for e in page["ranks"]] == list(range(19_990, 20_010))
        assert built == list(range(19_990, 20_000))  # the other ten never reported
        assert page["page"] == {
            "view": "page", "total": 20_010, "matched": 20_010, "offset": 19_990, "limit": 50,
        }  # fmt: skip
        built.clear()
        page = msgspec.json.decode(server.query_json(b"status?limit=50"))
        assert len(page["ranks"]) == 50 and len(built) == 50
        built.clear()
        encoded = server.query_json(b"status?view=summary")
        summary = msgspec.json.decode(encoded)
        assert len(built) == 10 and len(summary["ranks"]) == 20  # 10 not_connected come first
        hosts = summary["summary"]["hosts"]
        assert len(hosts) == 1000 and summary["summary"]["hosts_omitted"] == 1501  # + null
        assert server.query_json(b"status?view=summary") is encoded  # cached for the tick
        server.tick()
        assert server.query_json(b"status?view=summary") is not encoded
        assert len(built) == 20
    finally:
        server.collector.close()


def test_alert_culprits_come_first_within_a_state() -> None:
    state = big_state(6)
    culprit = Alert("straggler", "warning", (4,), (0, 1), "m", "h")
    view = TickView(state, [culprit], 2.0, Thresholds())
    assert worst_ranks(view.ranks, view.states, view.culprits, 3) == [6, 7, 8]  # not_connected first
    running = [r for r in view.ranks if view.states[r] == "running"]
    assert worst_ranks(running, view.states, view.culprits, 3) == [4, 0, 1]
