"""The dashboard: keys, selection, ordering, sources, sizes, snapshots.

Every app test drives ``DashboardApp`` through ``run_test`` with a
``FixtureSource`` playing back the fixed documents of ``tui_fixtures``; polling
is slowed to once an hour so each test decides when a document arrives.
"""

from __future__ import annotations

import json
import socket
import threading
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
import zmq
from textual.pilot import Pilot
from textual.widgets import Input, Static
from tui_fixtures import STARTED, FixtureSource, big, document, healthy, typed
from tui_pilot import (
    dashboard,
    header_text,
    make_app,
    poll,
    settle,
    shown_ranks,
    table,
    type_text,
    visible_lines,
    visible_ranks,
)

from ddpwatch.core.ranges import rank_ranges
from ddpwatch.status.fmt import human_bytes, short_seconds, uptime
from ddpwatch.status.schema import StatusDocument
from ddpwatch.tui.app import DashboardApp, run_dashboard
from ddpwatch.tui.data.model import (
    HostGroup,
    TableQuery,
    index_alerts,
    is_flagged,
    job_wait_fraction,
    make_filter,
    parse_ranges,
    select_groups,
    select_rows,
)
from ddpwatch.tui.data.sources import LocalSource, RemoteSource, StatusSource
from ddpwatch.tui.data.sparklines import History
from ddpwatch.tui.screens.dashboard import DashboardScreen
from ddpwatch.tui.screens.help import HelpScreen
from ddpwatch.tui.widgets.detail import split_text
from ddpwatch.tui.widgets.fmt import DASH, loss_text, sparkline
from ddpwatch.tui.widgets.header import HeaderInfo, header_lines, summarize
from ddpwatch.tui.widgets.rank_table import RankTable

# ----------------------------------------------------------------------------- ordering and layout


async def test_worst_first_puts_crashed_and_straggler_on_screen_at_80x24() -> None:
    async with make_app().run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        on_screen = visible_ranks(pilot)
        assert len(on_screen) >= 8
        assert on_screen[0] == 5  # the crashed rank
        assert 11 in on_screen  # the straggler
        assert {14, 15, 3, 7} <= set(on_screen)  # silent, absent, nan loss, duplicate device
        assert table(pilot).cursor_key == 5


async def test_default_order_is_worst_then_rank() -> None:
    async with make_app().run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        ranks = shown_ranks(pilot)
        assert ranks[:6] == [5, 14, 3, 7, 15, 11]
        healthy_tail = ranks[6:]
        assert healthy_tail == sorted(healthy_tail)


async def test_columns_collapse_by_priority() -> None:
    async with make_app().run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        narrow = table(pilot).visible_columns
        assert {"rank", "state", "phase", "step", "collective"} <= set(narrow)
        assert "pid" not in narrow
        assert "all_reduce #131 12.4s" in "\n".join(visible_lines(pilot))
    async with make_app().run_test(size=(200, 50)) as pilot:
        await settle(pilot)
        wide = table(pilot).visible_columns
        for key in (
            "host",
            "pid",
            "device",
            "loss",
            "step_time",
            "mem",
            "gpu",
            "seen",
            "data_wait",
        ):
            assert key in wide


async def test_simulated_rank_carries_sim_marker() -> None:
    async with make_app().run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        line = next(text for text in visible_lines(pilot) if text[1:].split()[:1] == ["13"])
        assert "sim" in line.split()
        assert all(
            "sim" not in t.split() for t in visible_lines(pilot) if t[1:].split()[:1] == ["12"]
        )


async def test_nan_loss_is_shown_as_nan() -> None:
    async with make_app().run_test(size=(200, 40)) as pilot:
        await settle(pilot)
        line = next(text for text in visible_lines(pilot) if text[1:].split()[:1] == ["3"])
        assert " nan " in line


async def test_terminal_too_small_message() -> None:
    async with make_app().run_test(size=(50, 12)) as pilot:
        await settle(pilot)
        screen = dashboard(pilot)
        assert screen.has_class("-too-small")
        message = screen.query_one("#too-small", Static)
        assert message.display
        assert "terminal too small" in str(message.render())
        assert not screen.query_one("#main").display
    async with make_app().run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert not dashboard(pilot).has_class("-too-small")


# ----------------------------------------------------------------------------- header


async def test_header_counts_rate_uptime_and_source() -> None:
    async with make_app().run_test(size=(160, 40)) as pilot:
        await settle(pilot)
        text = header_text(pilot)
        assert "world 16" in text
        assert "ranks 15/16" in text
        assert "hosts 2" in text
        assert f"step 129{DASH}130" in text
        assert "4 error" in text and "2 warning" in text and "1 info" in text
        assert "msg/s —" in text  # one document: no rate yet
        assert "up 1h02m05s" in text
        assert "fixture :5599" in text
        await poll(pilot)
        text = header_text(pilot)
        assert "msg/s 122" in text  # 61 messages in 0.5 s
        assert "up 1h02m05s" in text  # int(3725.5)


def _split_cells(pilot: Pilot[Any]) -> dict[int, str]:
    """Each visible rank's step split cell, as drawn (no split column: {})."""
    widget = table(pilot)
    offset = 1
    for column, width in widget._layout:
        if column.key == "split":
            break
        offset += width + 1
    else:
        return {}
    cells = {}
    for line in visible_lines(pilot)[1:]:
        words = line[1:].split()
        if words and words[0].isdigit():
            cells[int(words[0])] = line[offset : offset + width]
    return cells


async def test_the_step_split_column_shows_where_a_step_goes_and_waiting_in_the_header() -> None:
    async with make_app().run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        cells = _split_cells(pilot)
        assert cells[11] == "▒▒▒███   1%"  # the straggler: others wait for its input
        assert cells[0] == "███░░░  49%"  # they wait half their step for it
        assert cells[13].strip() == "" and cells[15].strip() == ""  # no split reported
        assert "waiting 45% of step time" in header_text(pilot)  # 2.603 s of 5.849 s
        while dashboard(pilot).query_state.sort != "split":  # sort by the wait's share
            await pilot.press("greater_than_sign")
        assert shown_ranks(pilot)[0] == 11 and shown_ranks(pilot)[-2:] == [13, 15]
    async with make_app(FixtureSource([healthy(8)])).run_test(size=(200, 40)) as pilot:
        await settle(pilot)  # no rank reports a split (models on GPUs): no column, no share
        assert "split" not in table(pilot).visible_columns
        assert "waiting" not in header_text(pilot)


def test_the_share_of_step_time_spent_waiting() -> None:
    """The ranks' waits over their steps: the ranks without a split left out."""
    doc = healthy(3)
    doc["ranks"][0].update(input_wait_s=0.01, compute_s=0.14, grad_wait_s=0.09)
    doc["ranks"][0]["collective_time_s"] = 0.01  # 250 ms, 100 ms of it waiting
    doc["ranks"][1].update(input_wait_s=None, compute_s=0.24, grad_wait_s=0.01)
    doc["ranks"][1]["collective_time_s"] = None  # 250 ms, 10 ms waiting
    assert doc["ranks"][2]["compute_s"] is None  # the third reports no split
    assert summarize(typed(doc))["waiting"] == pytest.approx(0.22)
    assert job_wait_fraction(typed(doc).ranks) == pytest.approx(0.22)
    assert job_wait_fraction(typed(healthy(3)).ranks) is None
    text = "\n".join(line.plain for line in header_lines(HeaderInfo(waiting=0.22), 160))
    assert "waiting 22% of step time" in text
    none = "\n".join(line.plain for line in header_lines(HeaderInfo(), 160))
    assert "waiting" not in none
    summary = {**doc, "summary": {"ranks": 3, "states": {}, "hosts": []}}
    summary["page"] = {"view": "summary", "total": 3, "matched": 3, "worst": 20}
    assert summarize(typed(summary))["waiting"] is None  # its ranks are only the worst few


def test_the_detail_pane_says_where_the_step_goes() -> None:
    row = typed(healthy(1)).ranks[0]
    assert split_text(row) is None
    row = msgspec.structs.replace(
        row, input_wait_s=0.012, compute_s=0.235, grad_wait_s=0.003, collective_time_s=0.0
    )
    text = split_text(row)
    assert text is not None
    assert text.plain == "input 12ms · compute 235ms · waiting 3ms (1%) of a 250ms step"
    row = msgspec.structs.replace(row, grad_wait_s=0.06, collective_time_s=0.03, compute_s=0.148)
    text = split_text(row)
    assert text is not None
    assert text.plain == (
        "input 12ms · compute 148ms · waiting 90ms (36%: 60ms in DDP's all-reduce, 30ms in "
        "collectives) of a 250ms step"
    )


async def test_the_header_shows_the_attempt_once_the_launcher_restarted_the_job() -> None:
    source = FixtureSource()
    async with make_app(source).run_test(size=(160, 40)) as pilot:
        await settle(pilot)
        assert "attempt" not in header_text(pilot)
        restarted = document(1)
        restarted["attempt"] = 2
        source.push(restarted)
        await poll(pilot)
        assert "ddpwatch  attempt 2  world 16" in header_text(pilot)


async def test_unreachable_source_shows_disconnected() -> None:
    source = FixtureSource()
    async with make_app(source).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        assert shown_ranks(pilot)
        source.reachable = False
        await poll(pilot)
        assert "DISCONNECTED" in header_text(pilot)
        assert shown_ranks(pilot)  # the last document stays on screen
        source.reachable = True
        await poll(pilot)
        assert "DISCONNECTED" not in header_text(pilot)


async def test_uptime_starts_at_first_document_without_a_start_time() -> None:
    source = FixtureSource()
    source.started = None
    async with make_app(source).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        assert "up 0s" in header_text(pilot)
        await poll(pilot)
        assert "up 0s" in header_text(pilot)  # int(0.5)


# ----------------------------------------------------------------------------- keys


async def test_sort_next_previous_and_reverse() -> None:
    async with make_app().run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        screen = dashboard(pilot)
        await pilot.press("greater_than_sign")
        assert screen.query_state.sort == "rank"
        assert shown_ranks(pilot) == list(range(16))
        assert "rank▲" in visible_lines(pilot)[0]
        await pilot.press("r")
        assert shown_ranks(pilot) == list(range(15, -1, -1))
        assert "rank▼" in visible_lines(pilot)[0]
        await pilot.press("greater_than_sign")  # next column, ascending again
        next_key = screen.sort_keys()[2]
        assert screen.query_state.sort == next_key
        assert not screen.query_state.reverse
        await pilot.press("less_than_sign", "less_than_sign")
        assert screen.query_state.sort == "worst"
        assert shown_ranks(pilot)[0] == 5


async def test_sort_by_step_time_puts_unknown_last() -> None:
    async with make_app().run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        screen = dashboard(pilot)
        while screen.query_state.sort != "step_time":
            await pilot.press("greater_than_sign")
        await pilot.press("r")
        ranks = shown_ranks(pilot)
        assert ranks[0] == 11  # the slowest step
        assert ranks[-1] == 15  # never connected: no step time, last either way


async def test_filter_by_host_and_escape_clears() -> None:
    async with make_app().run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        screen = dashboard(pilot)
        await pilot.press("slash")
        box = screen.query_one("#filter", Input)
        assert box.has_focus and box.display
        await type_text(pilot, "node-b")
        rows = table(pilot).rows
        assert rows and all(row.host == "node-b" for row in rows)
        assert len(rows) == 7  # rank 15 never connected: no host
        await pilot.press("enter")
        assert table(pilot).has_focus
        assert len(table(pilot).rows) == 7
        await pilot.press("escape")
        assert len(table(pilot).rows) == 16
        assert screen.query_state.filter == ""
        assert not box.display


async def test_filter_by_state_and_phase_words() -> None:
    async with make_app().run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("slash")
        await type_text(pilot, "crashed")
        assert shown_ranks(pilot) == [5]
        await pilot.press("escape", "slash")
        await type_text(pilot, "node-b data")
        assert shown_ranks(pilot) == [11]


async def test_filter_by_rank_range() -> None:
    async with make_app().run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("slash")
        await type_text(pilot, "r:0-3")
        assert sorted(shown_ranks(pilot)) == [0, 1, 2, 3]
        await pilot.press("escape", "slash")
        await type_text(pilot, "3,5-7")
        assert sorted(shown_ranks(pilot)) == [3, 5, 6, 7]
        await pilot.press("escape")
        assert len(shown_ranks(pilot)) == 16


async def test_flagged_only() -> None:
    doc = healthy(8)
    doc["ranks"][2]["state"] = "stalled"
    doc["ranks"][6]["state"] = "exited"
    doc["alerts"] = [
        {
            "kind": "slow_rank",
            "severity": "info",
            "ranks": [5],
            "waiting": [],
            "message": "rank 5 is 1.6x slower than the median",
            "hint": "look at its host",
        }
    ]
    async with make_app(FixtureSource([doc])).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        assert len(shown_ranks(pilot)) == 8
        await pilot.press("a")
        assert shown_ranks(pilot) == [2, 5]
        assert "flagged only" in header_text(pilot)
        await pilot.press("a")
        assert len(shown_ranks(pilot)) == 8


async def test_group_by_host_and_enter_shows_its_ranks() -> None:
    async with make_app().run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("g")
        widget = table(pilot)
        assert widget.grouped
        hosts = {row.host: row for row in widget.rows if isinstance(row, HostGroup)}
        assert set(hosts) == {"node-a", "node-b", "?"}
        assert hosts["node-a"].ranks == 8
        assert hosts["node-a"].states["crashed"] == 1
        assert hosts["node-b"].step_min == 129 and hosts["node-b"].step_max == 130
        assert hosts["node-b"].step_time_max_s == pytest.approx(2.9)
        assert widget.rows[0].host == "node-a"  # worst first: it has the crashed rank
        text = "\n".join(visible_lines(pilot))
        assert "1 crash" in text and f"129{DASH}130" in text
        await pilot.press("down")
        assert widget.cursor_key == "node-b"
        await pilot.press("enter")
        assert not widget.grouped
        assert {row.host for row in widget.rows} == {"node-b"}
        assert dashboard(pilot).query_state.filter == "node-b"


async def test_pause_stops_updates() -> None:
    source = FixtureSource([document(0)])
    async with make_app(source, interval=0.05).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        screen = dashboard(pilot)
        await pilot.press("p")
        assert screen.paused
        assert "PAUSED" in header_text(pilot)
        await pilot.pause(0.15)
        await settle(pilot)
        fetches = source.fetches
        before = screen.document
        source.push(document(20))
        await pilot.pause(0.3)
        await settle(pilot)
        assert source.fetches == fetches
        assert screen.document is before
        assert screen.document is not None
        assert screen.document.server_time == document(0)["server_time"]
        await pilot.press("p")
        await settle(pilot)
        assert not screen.paused
        assert screen.document.server_time == document(20)["server_time"]


async def test_polls_repeat_and_never_overlap() -> None:
    class Slow(FixtureSource):
        def __init__(self) -> None:
            super().__init__([document(0)])
            self.active = 0
            self.overlap = False

        def fetch(self) -> StatusDocument | None:
            self.active += 1
            self.overlap |= self.active > 1
            time.sleep(0.03)
            self.active -= 1
            return super().fetch()

    source = Slow()
    async with make_app(source, interval=0.01).run_test(size=(100, 30)) as pilot:
        deadline = time.monotonic() + 10
        while source.fetches < 5 and time.monotonic() < deadline:
            await pilot.pause(0.1)
        assert source.fetches >= 5
        assert not source.overlap


async def test_export_writes_the_status_json(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    async with make_app().run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("e")
        await pilot.pause()
        files = list(tmp_path.glob("ddpwatch-status-*.json"))
        assert len(files) == 1
        saved = json.loads(files[0].read_text())
        assert saved == msgspec.to_builtins(typed(document(0)))  # every field, null if unknown
        assert saved["schema"] == 1 and len(saved["ranks"]) == 16
        await pilot.press("e")
        await pilot.pause()
        assert len(list(tmp_path.glob("ddpwatch-status-*.json"))) == 2  # never overwrites
        assert any(str(files[0]) in n.message for n in pilot.app._notifications)


async def test_help_screen_opens_and_closes() -> None:
    async with make_app().run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        assert isinstance(pilot.app.screen, HelpScreen)
        await pilot.press("escape")
        assert isinstance(pilot.app.screen, DashboardScreen)
        await pilot.press("question_mark", "question_mark")
        assert isinstance(pilot.app.screen, DashboardScreen)


async def test_quit() -> None:
    app = make_app()
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("q")
        await pilot.pause()
    assert not app.is_running


# ----------------------------------------------------------------------------- selection


async def test_cursor_moves_and_follows_its_rank() -> None:
    source = FixtureSource()
    async with make_app(source).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        widget = table(pilot)
        assert widget.cursor == 0 and widget.cursor_key == 5
        await pilot.press("down", "down")
        assert widget.cursor == 2 and widget.cursor_key == widget.row_key(widget.rows[2])
        await pilot.press("up")
        assert widget.cursor == 1
        await pilot.press("end")
        assert widget.cursor == 15
        await pilot.press("home")
        assert widget.cursor == 0
        await pilot.press("pagedown")
        assert widget.cursor == widget.page_height
        # a new document that reorders rows keeps the cursor on the same rank
        await pilot.press("home", "down")
        chosen = widget.cursor_key
        doc = document(1)
        doc["alerts"] = []
        source.push(doc)
        await poll(pilot)
        assert widget.cursor_key == chosen
        assert widget.row_key(widget.rows[widget.cursor]) == chosen


async def test_click_selects_row_and_header_click_sorts() -> None:
    async with make_app().run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        widget = table(pilot)
        await pilot.click(RankTable, offset=(3, 3))
        assert widget.cursor == 2
        await pilot.click(RankTable, offset=(3, 0))  # the "rank" title
        assert dashboard(pilot).query_state.sort == "rank"


async def test_enter_toggles_detail_of_cursor_rank() -> None:
    async with make_app().run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        screen = dashboard(pilot)
        assert not screen.detail.display
        await pilot.press("enter")
        assert screen.detail.display
        assert screen.detail.rank == 5
        identity = screen.query_one("#detail-identity")
        text = str(identity.render())
        assert "rank 5" in text and "node-a" in text and "41035" in text and "torchrun" in text
        trouble = str(screen.query_one("#detail-trouble").render())
        assert "torch.OutOfMemoryError" in trouble
        stack = str(screen.query_one("#detail-stack", Static).render())
        assert "loss.backward()" in stack
        await pilot.press("down")  # the detail follows the cursor
        assert screen.detail.rank == table(pilot).cursor_key == 14
        await pilot.press("enter")
        assert not screen.detail.display


async def test_detail_sparklines_use_history() -> None:
    source = FixtureSource([document(t) for t in range(0, 12, 2)])
    async with make_app(source).run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        for _ in range(5):
            await poll(pilot)
        screen = dashboard(pilot)
        assert len(screen.history.series(0, "loss")) == 6
        await pilot.press("enter")
        sparks = str(screen.query_one("#detail-sparks").render())
        assert "step time" in sparks and "loss" in sparks and "memory" in sparks
        assert any(ch in sparks for ch in "▁▂▃▄▅▆▇█")


async def test_selecting_an_alert_selects_its_culprit() -> None:
    async with make_app().run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        screen = dashboard(pilot)
        alerts = screen.alert_list
        kinds = [a.kind for a in alerts.alerts]
        alerts.focus()
        alerts.highlighted = kinds.index("straggler")
        await pilot.press("enter")
        await pilot.pause()
        assert table(pilot).cursor_key == 11
        assert table(pilot).has_focus
        assert 11 in visible_ranks(pilot)


async def test_alert_jump_clears_a_filter_that_hides_the_rank() -> None:
    async with make_app().run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        screen = dashboard(pilot)
        await pilot.press("slash")
        await type_text(pilot, "node-a")
        await pilot.press("enter")
        assert 14 not in shown_ranks(pilot)
        alerts = screen.alert_list
        alerts.focus()
        alerts.highlighted = [a.kind for a in alerts.alerts].index("silent")
        await pilot.press("enter")
        await pilot.pause()
        assert screen.query_state.filter == ""
        assert table(pilot).cursor_key == 14


async def test_alert_click_selects_its_culprit() -> None:
    async with make_app().run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        screen = dashboard(pilot)
        alerts = screen.alert_list
        index = [a.kind for a in alerts.alerts].index("duplicate_device")
        # each alert is three lines here (head, message, hint) at this width
        await pilot.click(alerts, offset=(4, 1 + 3 * index))
        await pilot.pause()
        assert table(pilot).cursor_key == 7


# ----------------------------------------------------------------------------- scale


async def test_8192_ranks_render_and_cursor_reaches_the_end() -> None:
    doc = big(8192)
    source = FixtureSource([doc], copy_docs=False)
    async with make_app(source).run_test(size=(160, 48)) as pilot:
        await settle(pilot)
        widget = table(pilot)
        assert len(widget.rows) == 8192
        assert widget.virtual_size.height == 8193
        on_screen = visible_ranks(pilot)
        assert on_screen[0] == 8189  # the crashed rank first
        assert 4099 in on_screen  # the straggler
        await pilot.press("end")
        await pilot.pause()
        last = widget.row_key(widget.rows[-1])
        assert widget.cursor == 8191 and widget.cursor_key == last
        assert visible_ranks(pilot)[-1] == last
        await pilot.press("slash")
        await type_text(pilot, "r:8000-8009")
        assert sorted(shown_ranks(pilot)) == list(range(8000, 8010))
        started = time.perf_counter()
        await pilot.press("escape", "g")
        assert len(widget.rows) == 1024
        assert time.perf_counter() - started < 5


# ----------------------------------------------------------------------------- sources


def _free_port_pair() -> int:
    for _ in range(100):
        with socket.socket() as a, socket.socket() as b:
            try:
                a.bind(("127.0.0.1", 0))
                port = a.getsockname()[1]
                b.bind(("127.0.0.1", port + 1))
            except OSError:
                continue
            return port
    raise RuntimeError("no free port pair")


class TinyServer:
    """A REP socket on port+1 that answers b"status" with a document, like ``ddpwatch serve``."""

    def __init__(self, port: int, doc: dict[str, Any]) -> None:
        self.context = zmq.Context()
        self.sock = self.context.socket(zmq.REP)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{port + 1}")
        self.payload = json.dumps(doc).encode()
        self.requests: list[bytes] = []
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._serve, daemon=True)
        self.thread.start()

    def _serve(self) -> None:
        while not self.stop.is_set():
            if self.sock.poll(50):
                request = self.sock.recv()
                self.requests.append(request)
                self.sock.send(self.payload if request == b"status" else b'{"error": "?"}')

    def close(self) -> None:
        self.stop.set()
        self.thread.join(2)
        self.sock.close(linger=0)
        self.context.term()


def test_remote_source_fetches_the_document() -> None:
    port = _free_port_pair()
    server = TinyServer(port, document(0))
    source = RemoteSource("127.0.0.1", port, timeout=2.0)
    try:
        assert isinstance(source, StatusSource)
        assert source.label == f"127.0.0.1:{port}"
        assert source.fetch() == msgspec.convert(document(0), StatusDocument)  # as served
        assert source.fetch() == msgspec.convert(document(0), StatusDocument)  # the same socket, request after reply
        assert server.requests == [b"status", b"status"]
    finally:
        source.close()
        server.close()
    assert source.fetch() is None  # closed
    source.close()  # twice is fine


def test_remote_source_unreachable_returns_none_quickly_then_reconnects() -> None:
    port = _free_port_pair()
    source = RemoteSource("127.0.0.1", port, timeout=0.2)
    try:
        started = time.monotonic()
        assert source.fetch() is None
        assert (
            source.fetch() is None
        )  # a fresh socket each time: no "Operation cannot be accomplished"
        assert time.monotonic() - started < 1.5
        server = TinyServer(port, healthy(4))
        try:
            deadline = time.monotonic() + 5
            got = None
            while got is None and time.monotonic() < deadline:
                got = source.fetch()
            assert got == msgspec.convert(healthy(4), StatusDocument)
        finally:
            server.close()
    finally:
        source.close()


def test_remote_source_rejects_a_non_document() -> None:
    port = _free_port_pair()
    server = TinyServer(port, {"error": "unknown request"})
    source = RemoteSource("127.0.0.1", port, timeout=2.0)
    try:
        assert source.fetch() is None
    finally:
        source.close()
        server.close()


def test_local_source_reads_the_server_and_survives_its_errors() -> None:
    class FakeServer:
        class collector:
            port = 5599

        class state:
            started = 123.0

        def __init__(self) -> None:
            self.fail = False

        def status(self) -> StatusDocument:
            if self.fail:
                raise RuntimeError("boom")
            return typed(document(0))

    server = FakeServer()
    source = LocalSource(server)
    assert isinstance(source, StatusSource)
    assert source.label == "local :5599"
    assert source.started == 123.0
    assert source.fetch() == typed(document(0))
    server.fail = True
    assert source.fetch() is None


def test_run_dashboard_runs_the_server_thread_and_stops_it(monkeypatch: pytest.MonkeyPatch) -> None:
    events: list[str] = []

    class FakeServer:
        def __init__(self) -> None:
            self._stop = threading.Event()

        def run(self) -> None:
            events.append("run")
            self._stop.wait(5)
            events.append("ran")

        def stop(self) -> None:
            events.append("stop")
            self._stop.set()

        def status(self) -> StatusDocument:
            return typed(document(0))

    def fake_run(app: DashboardApp, *args: Any, **kwargs: Any) -> None:
        assert isinstance(app.source, LocalSource)
        assert app.source.fetch() == typed(document(0))
        time.sleep(0.05)
        events.append("app")

    monkeypatch.setattr(DashboardApp, "run", fake_run)
    assert run_dashboard(FakeServer()) == 0
    assert events[:3] == ["run", "app", "stop"]
    assert "ran" in events


async def test_dashboard_over_a_real_server(live_server: Any) -> None:
    """Messages on the wire -> Server -> status document -> LocalSource and RemoteSource -> table."""
    from ddpwatch.core.protocol import Sample, encode

    context = zmq.Context()
    push = context.socket(zmq.PUSH)
    push.setsockopt(zmq.LINGER, 500)
    push.connect(f"tcp://127.0.0.1:{live_server.port}")
    for rank in range(2):
        sample = Sample(
            v=1, rank=rank, t=time.time(), world_size=2, local_rank=rank, host="box", pid=100 + rank,
            device=f"cuda:{rank}", phase="forward", step=7, loss=1.5, step_time_s=0.2,
        )  # fmt: skip
        push.send(encode(sample))
    push.close()
    context.term()
    live_server.wait_for(lambda s: len(s["ranks"]) == 2 and s["ranks"][1]["step"] == 7, 10)

    async with make_app(LocalSource(live_server.server)).run_test(size=(120, 30)) as pilot:
        await settle(pilot)
        assert sorted(shown_ranks(pilot)) == [0, 1]
        assert "ranks 2/2" in header_text(pilot)
        assert dashboard(pilot).source.label == f"local :{live_server.port}"

    remote = RemoteSource("127.0.0.1", live_server.port, timeout=2.0)
    async with make_app(remote).run_test(size=(120, 30)) as pilot:
        await settle(pilot)
        assert sorted(shown_ranks(pilot)) == [0, 1]
        assert table(pilot).rows[0].host == "box"


# ----------------------------------------------------------------------------- view model and formatting


def test_parse_ranges() -> None:
    assert parse_ranges("r:0-15") == [(0, 15)]
    assert parse_ranges("3,5-7") == [(3, 3), (5, 7)]
    assert parse_ranges("rank=9") == [(9, 9)]
    assert parse_ranges(" 7 - 3 ") == [(3, 7)]
    assert parse_ranges("node-a") is None
    assert parse_ranges("r:") is None


def test_filter_words_match_host_state_or_phase() -> None:
    rows = typed(document(0)).ranks
    only = make_filter("NODE-A")
    assert only is not None
    assert {r.rank for r in rows if only(r)} == set(range(8))
    silent = make_filter("silent")
    assert silent is not None
    assert [r.rank for r in rows if silent(r)] == [14]
    assert make_filter("  ") is None


def test_flagged_and_worst_first_from_alerts() -> None:
    doc = typed(document(0))
    index = index_alerts(doc.alerts)
    assert index.counts == {"error": 4, "warning": 2, "info": 1}
    assert index.nan == {3}
    ranks = select_rows(doc.ranks, TableQuery(), index)
    assert [r.rank for r in ranks[:6]] == [5, 14, 3, 7, 15, 11]
    assert all(is_flagged(r, index) for r in doc.ranks)
    groups = select_groups(doc.ranks, TableQuery(), index)
    assert [g.host for g in groups] == ["node-a", "node-b", "?"]


def test_formatting() -> None:
    assert short_seconds(None) == "—"
    assert short_seconds(0.0123) == "12ms"
    assert short_seconds(2.5) == "2.50s"
    assert short_seconds(75) == "1m15s"
    assert short_seconds(4000) == "1h06m"
    assert all(
        len(short_seconds(v)) <= 5
        for v in (0.00001, 0.5, 9.99, 59.9, 599, 3599, 35999, 86399, 10**6)
    )
    assert uptime(3725) == "1h02m05s"
    assert human_bytes(None) == "—"
    assert human_bytes(512) == "512B"
    assert human_bytes(1536) == "1.5K"
    assert human_bytes(80 * 2**30) == "80.0G"
    assert loss_text(1.98) == "1.9800"
    assert loss_text(float("nan")) == "nan"
    assert rank_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"
    assert rank_ranges(range(0, 40, 2), limit=3) == "0,2,4 +17"
    assert sparkline([1, 2, 3, None, 8], 5) == "▁▂▃ █"
    assert sparkline([], 5) == ""


def test_history_is_bounded_and_per_step() -> None:
    history = History(capacity=4)
    for tick in range(10):
        ranks = typed(healthy(3, tick)).ranks
        history.update(ranks)
        history.update(ranks)  # same step twice: one point
    series = history.series(1, "loss")
    assert len(series) == 4
    assert series == sorted(series, reverse=True)  # the loss falls step by step
    assert history.series(99, "loss") == []
    assert len(history) == 3


def test_fixture_documents_follow_the_contract() -> None:
    contract = {
        "rank", "local_rank", "world_size", "host", "pid", "device", "device_uuid", "state",
        "phase", "step", "loss", "step_time_s", "mem_allocated_bytes", "mem_reserved_bytes",
        "gpu_mem_used_bytes", "gpu_mem_total_bytes", "collective", "last_seen_s", "stack", "error",
    }  # fmt: skip
    for doc in (document(0), healthy(4), big(64)):
        assert set(doc) == {"schema", "server_time", "world_size", "ranks", "alerts", "stats"}
        for row in doc["ranks"]:
            assert contract <= set(row)
        for alert in doc["alerts"]:
            assert set(alert) == {"kind", "severity", "ranks", "waiting", "message", "hint"}
    assert document(3) == document(3)  # deterministic
    assert document(0)["server_time"] > STARTED


# ----------------------------------------------------------------------------- snapshots


SNAPSHOT_TICKS = (0, 2, 4, 6, 8, 10, 12, 13)
"""Eight documents 0.5-1 s apart: some history for the sparklines, a message rate."""


def _snapshot_app() -> DashboardApp:
    return make_app(FixtureSource([document(t) for t in SNAPSHOT_TICKS]))


async def _two_documents(pilot: Pilot[Any]) -> None:
    await settle(pilot)
    for _ in SNAPSHOT_TICKS[1:]:
        await poll(pilot)


async def _detail_of_straggler(pilot: Pilot[Any]) -> None:
    await _two_documents(pilot)
    table(pilot).move_cursor_to_key(11)
    await pilot.press("enter")
    await pilot.pause()


async def _detail_of_crashed(pilot: Pilot[Any]) -> None:
    await _two_documents(pilot)
    await pilot.press("enter")
    await pilot.pause()


@pytest.mark.parametrize("size", [(80, 24), (160, 48)], ids=["80x24", "160x48"])
def test_snapshot_main(snap_compare: Any, size: tuple[int, int]) -> None:
    assert snap_compare(_snapshot_app(), terminal_size=size, run_before=_two_documents)


@pytest.mark.parametrize(
    ("size", "select"),
    [((80, 24), _detail_of_straggler), ((160, 48), _detail_of_crashed)],
    ids=["80x24-straggler", "160x48-crashed"],
)
def test_snapshot_detail(snap_compare: Any, size: tuple[int, int], select: Any) -> None:
    """The detail pane: the straggler's stack and sparklines; the crashed rank's traceback."""
    assert snap_compare(_snapshot_app(), terminal_size=size, run_before=select)


def test_snapshot_help(snap_compare: Any) -> None:
    async def open_help(pilot: Pilot[Any]) -> None:
        await _two_documents(pilot)
        await pilot.press("question_mark")
        await pilot.pause()

    assert snap_compare(_snapshot_app(), terminal_size=(100, 32), run_before=open_help)
