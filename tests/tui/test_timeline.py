"""The dashboard's timeline (key ``t``): alerts that came and went stay findable; the list
scrolls with the usual keys and shows the selected change whole."""

from __future__ import annotations

import copy
from typing import Any

from textual.widgets import DataTable
from tui_fixtures import FixtureSource, document
from tui_pilot import make_app, poll, settle

from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.history import AlertTracker
from ddpwatch.tui.screens.timeline import TimelineScreen, timeline_rows

T0 = 1_800_000_000.0
NAN = Alert("nan_loss", "error", (2,), (), "rank 2's loss is nan since step 15", "lower the lr")
FROZEN = Alert("straggler", "warning", (3,), (0, 1, 2), "rank 3 has not entered", "look")
FROZEN_STALLED = Alert("stalled", "error", (3,), (), "rank 3 has made no progress", "look")


def with_history(tracker: AlertTracker, tick: int = 0) -> dict[str, Any]:
    doc = copy.deepcopy(document(tick))
    doc["history"] = tracker.entries()
    return doc


def test_rows_newest_first_with_escalation_and_duration() -> None:
    tracker = AlertTracker(raise_hold_s=0.0, clear_hold_s=0.0)  # sparse ticks
    tracker.update([NAN], T0 + 5, T0)
    tracker.update([], T0 + 9, T0)
    tracker.update([FROZEN], T0 + 20, T0)
    tracker.update([FROZEN_STALLED], T0 + 30, T0)
    rows = timeline_rows(tracker.entries())
    assert [(r[1], r[2], r[4], r[5], r[6]) for r in rows] == [
        ("+30.0 s", "escalated #2 from straggler", "stalled", "3", ""),
        ("+20.0 s", "raised #2", "straggler", "3", ""),
        ("+9.0 s", "cleared #1", "nan_loss", "2", "4.0 s"),
        ("+5.0 s", "raised #1", "nan_loss", "2", ""),
    ]
    assert rows[0][0].count(":") == 2  # the time of day, hh:mm:ss


async def test_t_opens_the_timeline_which_follows_new_changes_and_t_closes_it() -> None:
    tracker = AlertTracker(raise_hold_s=0.0, clear_hold_s=0.0)  # sparse ticks
    tracker.update([NAN], T0 + 5, T0)
    tracker.update([], T0 + 9, T0)  # the NaN came and went before anyone looked
    source = FixtureSource([with_history(tracker)])
    async with make_app(source).run_test(size=(160, 40)) as pilot:
        await settle(pilot)
        await pilot.press("t")
        await pilot.pause()
        screen = pilot.app.screen
        assert isinstance(screen, TimelineScreen)
        table = screen.query_one(DataTable)
        assert table.row_count == 2
        assert [table.get_row_at(i)[4] for i in range(2)] == ["nan_loss", "nan_loss"]
        tracker.update([FROZEN], T0 + 20, T0)
        source.push(with_history(tracker, 1))
        await poll(pilot)  # the dashboard keeps polling under the timeline
        screen.follow()
        await pilot.pause()
        assert table.row_count == 3
        assert table.get_row_at(0)[4] == "straggler"
        await pilot.press("t")
        await pilot.pause()
        assert not isinstance(pilot.app.screen, TimelineScreen)


async def test_an_empty_timeline_says_so() -> None:
    async with make_app(FixtureSource([document(0)])).run_test(size=(120, 30)) as pilot:
        await settle(pilot)
        await pilot.press("t")
        await pilot.pause()
        table = pilot.app.screen.query_one(DataTable)
        assert table.get_row_at(0)[2] == "no alerts yet"


def _entry(event: str, elapsed: float, alert: Alert, **extra: Any) -> dict[str, Any]:
    clock = f"2026-11-23T19:{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}.000+00:00"
    return {"event": event, "time": clock, "elapsed_s": elapsed, "alert": alert.to_dict(), **extra}


def test_snapshot_timeline(snap_compare: Any) -> None:
    """The demo's story after it happened: a NaN that cleared, a frozen rank that escalated."""
    doc = copy.deepcopy(document(1))
    doc["history"] = [
        _entry("raised", 12.0, NAN),
        _entry("cleared", 19.5, NAN, duration_s=7.5),
        _entry("raised", 31.0, FROZEN),
        _entry("escalated", 36.0, FROZEN_STALLED, **{"from": {"kind": "straggler",
                                                             "severity": "warning"}}),
    ]  # fmt: skip

    async def open_timeline(pilot: Any) -> None:
        await settle(pilot)
        await pilot.press("t")
        await pilot.pause()

    app = make_app(FixtureSource([doc]))
    assert snap_compare(app, terminal_size=(120, 24), run_before=open_timeline)


# ----------------------------------------------------------------------------- scrolling, whole messages

LONG = (
    "rank {n} has not entered all_reduce #{n} that ranks 0-2, 4-7 have waited in for 12.5 s; it "
    "is in 'data' at step {n} (fetch_shard, shards.py:57); ranks 0-2, 4-7 will time out in 30 min"
)


def _long_history(count: int) -> list[dict[str, Any]]:
    """``count`` changes, each a straggler with its own long message (the newest: ``count - 1``)."""
    return [
        _entry(
            "raised",
            10.0 + n,
            Alert("straggler", "warning", (3,), (0, 1, 2), LONG.format(n=n), f"see rank 3 ({n})"),
        )
        for n in range(count)
    ]


def _timeline(pilot: Any) -> tuple[TimelineScreen, DataTable[str]]:
    screen = pilot.app.screen
    assert isinstance(screen, TimelineScreen)
    return screen, screen.query_one(DataTable)


def _panel(screen: TimelineScreen) -> str:
    from textual.widgets import Static

    return str(screen.query_one("#timeline-message", Static).content)


async def test_the_timeline_scrolls_with_the_usual_keys_at_120x35() -> None:
    doc = copy.deepcopy(document(0))
    doc["history"] = _long_history(80)
    async with make_app(FixtureSource([doc])).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        await pilot.press("t")
        await pilot.pause()
        _, table = _timeline(pilot)
        assert table.row_count == 80 and table.cursor_row == 0

        async def press(*keys: str) -> int:
            await pilot.press(*keys)
            await pilot.pause()
            return table.cursor_row

        assert await press("down") == 1
        assert await press("j") == 2
        assert await press("j", "j") == 4
        assert await press("up") == 3
        assert await press("k") == 2
        page = await press("pagedown")
        assert page > 10
        assert await press("pageup") < page
        assert await press("end") == 79
        assert table.is_valid_row_index(79) and table.scroll_y > 0  # scrolled to it
        assert await press("home") == 0
        assert table.scroll_y == 0


async def test_the_selected_change_is_shown_whole_under_the_list() -> None:
    doc = copy.deepcopy(document(0))
    doc["history"] = _long_history(30)
    async with make_app(FixtureSource([doc])).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        await pilot.press("t")
        await pilot.pause()
        screen, table = _timeline(pilot)
        cell = table.get_row_at(0)[7]
        assert cell.endswith("…") and len(cell) < len(LONG.format(n=29))  # cut to fit...
        columns = sum(c.get_render_width(table) for c in table.columns.values())
        assert columns <= table.scrollable_content_region.width  # ...no column past the edge
        assert LONG.format(n=29) in " ".join(_panel(screen).split())  # ...and whole below
        assert "see rank 3 (29)" in _panel(screen)  # with its hint
        await pilot.press("j", "j")
        await pilot.pause()
        assert LONG.format(n=27) in " ".join(_panel(screen).split())


async def test_the_cursor_stays_on_its_change_as_new_ones_arrive() -> None:
    doc = copy.deepcopy(document(0))
    doc["history"] = _long_history(10)
    source = FixtureSource([doc])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        await pilot.press("t")
        await pilot.pause()
        screen, table = _timeline(pilot)
        await pilot.press("j", "j", "j")  # the change of n = 6
        await pilot.pause()
        later = copy.deepcopy(doc)
        later["history"] = _long_history(12)
        source.push(later)
        await poll(pilot)
        screen.follow()
        await pilot.pause()
        assert table.row_count == 12
        assert table.cursor_row == 5  # two newer rows above it: still n = 6
        assert LONG.format(n=6) in " ".join(_panel(screen).split())


async def test_the_timelines_hint_says_when_the_culprits_stack_has_not_come() -> None:
    """Issue #33: as the alerts panel does, the timeline's hint says a rank has sent no stack
    yet instead of sending people to an empty detail pane; once it has, the key to see it."""
    from ddpwatch.status.fmt import STACKS_IN

    hinted = Alert("straggler", "warning", (3,), (0, 1, 2), "rank 3 has not entered",
                   f"look at rank 3's stack ({STACKS_IN})")  # fmt: skip
    doc = copy.deepcopy(document(0))
    doc["history"] = [_entry("raised", 12.0, hinted)]
    doc["ranks"][3]["stack"] = doc["ranks"][3]["error"] = None
    with_stack = copy.deepcopy(doc)
    with_stack["ranks"][3]["stack"] = 'File "train.py", line 40, in step'
    source = FixtureSource([doc, with_stack])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        await pilot.press("t")
        await pilot.pause()
        screen, _ = _timeline(pilot)
        assert "look at rank 3's stack (no stack or traceback from rank 3 yet)" in _panel(screen)
        await poll(pilot)  # its stack came
        screen.follow()
        await pilot.pause()
        assert "(the detail pane: press enter on rank 3)" in _panel(screen)


def test_a_finished_large_jobs_banner_says_where_its_verdict_is() -> None:
    """A summary reply (the dashboard past 4,096 ranks) holds no verdict: the banner says where
    to read it rather than judge the worst ranks it holds as if they were the job."""
    from ddpwatch.status.schema import RankEntry, Summary, SummaryPageInfo, SummaryReply
    from ddpwatch.tui.data.story import ended_banner

    reply = SummaryReply(
        server_time=100.0,
        ranks=[RankEntry(rank=0, state="exited", exit_code=0)],
        summary=Summary(ranks=8192, states={"exited": 8192}, hosts=[]),
        page=SummaryPageInfo(view="summary", total=8192, matched=8192, worst=1),
    )
    assert ended_banner(reply) == (
        "the job finished: no alerts in its run · verdict: ddpwatch status gives it"
    )
