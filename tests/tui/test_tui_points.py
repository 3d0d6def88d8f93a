"""The dashboard points and remembers (issue 25, part 6): the culprit marked in its row, the
cursor on the culprit of each new alert, its stack below the alerts, hints that name the
detail pane, and a job that ended still telling its story.

Every test drives a real ``DashboardApp`` through ``run_test`` over the demo's shape: four
ranks on one host, rank 1 a straggler the others wait for, then rank 3 crashing.
"""

from __future__ import annotations

import copy
from typing import Any

from textual.pilot import Pilot
from tui_fixtures import T0, FixtureSource, rank_entry, typed
from tui_pilot import dashboard, header_text, make_app, poll, settle, table, visible_lines

from ddpwatch.core.vocabulary import RankState
from ddpwatch.status.fmt import STACKS_IN

WORLD = 4
STRAGGLER_STACK = """\
  File "/demo/job.py", line 86, in main
    loss = ddp(x).pow(2).mean()
  File "/demo/job.py", line 44, in forward
    time.sleep(self.sleep_once)  # a straggler: the others wait in DDP's all-reduce"""
CRASH_TRACEBACK = """\
Traceback (most recent call last):
  File "/demo/job.py", line 95, in main
    raise RuntimeError(str(arg))
RuntimeError: CUDA error: invalid device ordinal"""


def _rank(rank: int, **values: Any) -> dict[str, Any]:
    base: dict[str, Any] = {
        "local_rank": rank,
        "host": "box",
        "pid": 500 + rank,
        "device": "cpu",
        "state": RankState.RUNNING,
        "phase": "forward",
        "step": 40,
        "loss": 1.0,
        "step_time_s": 0.11,
        "last_seen_s": 0.2,
    }
    base.update(values)
    return rank_entry(rank, WORLD, **base)


def healthy(tick: int = 0) -> dict[str, Any]:
    return {
        "schema": 1,
        "server_time": T0 + tick,
        "world_size": WORLD,
        "job_started": T0 - 10,
        "ranks": [_rank(r) for r in range(WORLD)],
        "alerts": [],
        "history": [],
        "stats": {"received": 100 + tick, "rejected": 0},
    }


STRAGGLER = {
    "kind": "straggler",
    "severity": "warning",
    "ranks": [1],
    "waiting": [0, 2, 3],
    "message": "rank 1 has not entered all_reduce #20 that ranks 0, 2, 3 have waited in for "
    "5.5 s; it is in 'forward' at step 19 (sleep, job.py:44)",
    "hint": f"see where rank 1 is (its stack in {STACKS_IN}): a rank-dependent "
    "branch, slow data loading or I/O, or a collective that not every rank calls keeps it "
    "from all_reduce #20",
}


def straggling(tick: int = 1) -> dict[str, Any]:
    """Rank 1 sleeps in forward; ranks 0, 2 and 3 wait for it in all_reduce #20."""
    doc = healthy(tick)
    for row in doc["ranks"]:
        if row["rank"] != 1:
            row.update(
                state=RankState.WAITING,
                phase="backward",
                collective={"op": "all_reduce", "seq": 20, "since_s": 5.5},
            )
    doc["ranks"][1].update(step=39, stack=STRAGGLER_STACK)
    doc["alerts"] = [copy.deepcopy(STRAGGLER)]
    doc["history"] = [_entry("raised", 30.0, STRAGGLER)]
    return doc


CRASHED = {
    "kind": "crashed",
    "severity": "error",
    "ranks": [3],
    "waiting": [0, 1, 2],
    "message": "rank 3 crashed in 'forward' at step 62 with RuntimeError: CUDA error: invalid "
    "device ordinal",
    "hint": f"read the traceback of rank 3 ({STACKS_IN} shows it); the other ranks "
    "only failed because it died",
}


def crashing(tick: int = 2) -> dict[str, Any]:
    """Rank 3 crashed; the others still wait for it (the job has not ended yet)."""
    doc = healthy(tick)
    for row in doc["ranks"]:
        row.update(
            state=RankState.WAITING,
            step=62,
            collective={"op": "all_reduce", "seq": 63, "since_s": 1.0},
        )
    doc["ranks"][3].update(
        state=RankState.CRASHED,
        collective=None,
        error={
            "type": "RuntimeError",
            "message": "CUDA error: invalid device ordinal",
            "traceback": CRASH_TRACEBACK,
        },
    )
    doc["alerts"] = [copy.deepcopy(CRASHED)]
    doc["history"] = [
        _entry("raised", 30.0, STRAGGLER),
        _entry("cleared", 36.0, STRAGGLER, duration_s=6.0),
        _entry("raised", 70.0, CRASHED),
    ]
    return doc


def _entry(event: str, elapsed: float, alert: dict[str, Any], **extra: Any) -> dict[str, Any]:
    clock = f"2026-11-23T19:{int(elapsed) // 60:02d}:{int(elapsed) % 60:02d}.000+00:00"
    return {"event": event, "time": clock, "elapsed_s": elapsed, "alert": alert, **extra}


def row_of(pilot: Pilot[Any], rank: int) -> str:
    """The table line of ``rank`` as drawn."""
    return next(line for line in visible_lines(pilot)[1:] if line[1:].split()[:1] == [str(rank)])


def state_cell(pilot: Pilot[Any], rank: int) -> str:
    """The state column's text in the row of ``rank``."""
    header = visible_lines(pilot)[0]
    start = header.index("state")
    phase = header.index("phase")
    return row_of(pilot, rank)[start:phase].strip()


# ----------------------------------------------------------------------------- 1: the culprit's row


async def test_the_culprit_is_marked_and_its_victims_say_whom_they_wait_for() -> None:
    source = FixtureSource([healthy(), straggling(), crashing()])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        assert {state_cell(pilot, r) for r in range(WORLD)} == {"running"}
        await poll(pilot)
        assert state_cell(pilot, 1) == "▶ culprit"  # running, while the others wait for it
        assert [state_cell(pilot, r) for r in (0, 2, 3)] == ["waits for 1"] * 3
        await poll(pilot)
        assert state_cell(pilot, 3) == "▶ crashed"
        assert [state_cell(pilot, r) for r in (0, 1, 2)] == ["waits for 3"] * 3


async def test_at_80_columns_the_marks_fit_the_state_column() -> None:
    async with make_app(FixtureSource([straggling()])).run_test(size=(80, 24)) as pilot:
        await settle(pilot)
        assert state_cell(pilot, 1) == "▶ culprit"
        assert state_cell(pilot, 0) == "waits for 1"
        assert "…" not in "".join(visible_lines(pilot))


async def test_a_culprit_is_no_longer_marked_once_its_alert_clears() -> None:
    source = FixtureSource([straggling(), healthy(3)])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        assert state_cell(pilot, 1) == "▶ culprit"
        await poll(pilot)
        assert [state_cell(pilot, r) for r in range(WORLD)] == ["running"] * WORLD


# ----------------------------------------------------------------------------- 2: the cursor follows


def cursor(pilot: Pilot[Any]) -> Any:
    return table(pilot).cursor_key


async def test_the_cursor_goes_to_the_culprit_of_each_new_alert() -> None:
    source = FixtureSource([healthy(), straggling(), crashing()])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        assert cursor(pilot) == 0  # all healthy: the first rank
        await poll(pilot)
        assert cursor(pilot) == 1  # the straggler (a warning, and no error open)
        await poll(pilot)
        assert cursor(pilot) == 3  # the crashed rank
        assert "cursor yours" not in header_text(pilot)


async def test_after_the_user_moves_the_cursor_it_stays_until_f() -> None:
    later = crashing(3)
    later["ranks"][0].update(state=RankState.CRASHED, collective=None)  # a second crash
    later["alerts"].append(
        {**CRASHED, "ranks": [0], "waiting": [1, 2], "message": "rank 0 crashed too"}
    )
    source = FixtureSource([healthy(), straggling(), crashing(), later])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        await poll(pilot)
        assert cursor(pilot) == 1
        await pilot.press("down")  # the user looks elsewhere
        await pilot.pause()
        mine = cursor(pilot)
        assert mine != 1
        assert "cursor yours (f: follow culprits)" in header_text(pilot)
        await poll(pilot)
        assert cursor(pilot) == mine  # rank 3 crashed, but the cursor is the user's
        await pilot.press("f")
        await pilot.pause()
        assert cursor(pilot) == 3  # the worst rank now
        assert "cursor yours" not in header_text(pilot)
        await poll(pilot)
        assert cursor(pilot) == 0  # and the culprit of the next new error


async def test_a_new_warning_does_not_pull_the_cursor_off_an_open_error() -> None:
    both = crashing(3)
    both["alerts"].append({**STRAGGLER, "ranks": [2], "waiting": [0, 1]})
    source = FixtureSource([healthy(), crashing(), both])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        await poll(pilot)
        assert cursor(pilot) == 3
        await poll(pilot)
        assert cursor(pilot) == 3


def test_help_says_how_the_cursor_follows() -> None:
    from ddpwatch.tui.screens.dashboard import DashboardScreen
    from ddpwatch.tui.screens.help import KEYS

    keys = dict(KEYS)
    assert "culprit of each new error" in keys["f"] and "until you move it" in keys["f"]
    bindings = {b.key: b.action for b in DashboardScreen.BINDINGS if hasattr(b, "key")}
    assert bindings["f"] == "follow"  # named in the header once the user moved the cursor


# ----------------------------------------------------------------------------- 3: the stack below


def stack_panel(pilot: Pilot[Any]) -> Any:
    from ddpwatch.tui.widgets.stack_panel import StackPanel

    return dashboard(pilot).query_one(StackPanel)


def stack_shown(pilot: Pilot[Any]) -> str:
    from textual.widgets import Static

    panel = stack_panel(pilot)
    return f"{panel.border_title}\n{panel.query_one('#stack-text', Static).content}"


async def test_the_space_under_the_alerts_shows_the_culprits_stack() -> None:
    source = FixtureSource([healthy(), straggling(), crashing()])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        await poll(pilot)
        panel = stack_panel(pilot)
        alerts = dashboard(pilot).alert_list
        assert panel.display and alerts.display
        assert panel.region.height >= 5 and panel.region.y >= alerts.region.bottom
        shown = stack_shown(pilot)
        assert shown.startswith("stack of rank 1 (culprit)")
        assert "time.sleep(self.sleep_once)" in shown
        await poll(pilot)
        shown = stack_shown(pilot)
        assert shown.startswith("traceback of rank 3 (culprit)")
        assert "RuntimeError: CUDA error: invalid device ordinal" in shown
        await pilot.press("down")  # a victim: its own stack, and whom it waits for
        await pilot.pause()
        assert stack_shown(pilot).startswith(f"stack of rank {cursor(pilot)} (waits for 3)")


async def test_the_detail_pane_takes_over_the_stack_and_hides_no_other_panel() -> None:
    async with make_app(FixtureSource([crashing()])).run_test(size=(160, 40)) as pilot:
        await settle(pilot)
        assert cursor(pilot) == 3
        await pilot.press("enter")
        await pilot.pause()
        screen = dashboard(pilot)
        assert screen.detail.display and screen.alert_list.display  # wide: side by side
        assert not stack_panel(pilot).display  # the detail pane shows the same traceback
        await pilot.press("enter")
        await pilot.pause()
        assert stack_panel(pilot).display


async def test_on_a_host_row_the_stack_panel_says_to_select_a_rank() -> None:
    async with make_app(FixtureSource([crashing()])).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        await pilot.press("g")
        await pilot.pause()
        assert "select a rank" in stack_shown(pilot)


# ----------------------------------------------------------------------------- 4: hints


def alert_texts(pilot: Pilot[Any]) -> list[str]:
    """Each option of the alerts panel as plain text, as drawn 200 cells wide."""
    import io

    from rich.console import Console

    alerts = dashboard(pilot).alert_list
    texts = []
    for i in range(alerts.option_count):
        console = Console(width=200, file=io.StringIO(), record=True)
        console.print(alerts.get_option_at_index(i).prompt)
        texts.append(" ".join(console.export_text().split()))
    return texts


async def test_hints_in_the_dashboard_name_the_key_not_a_shell_command() -> None:
    source = FixtureSource([straggling(), crashing()])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        (straggler,) = alert_texts(pilot)
        assert STACKS_IN not in straggler
        assert "(its stack in the detail pane: press enter on rank 1): a rank-dependent" in (
            straggler
        )
        await poll(pilot)
        crash, cleared = alert_texts(pilot)  # the straggler cleared a moment ago
        assert cleared.startswith("✔ straggler")
        assert STACKS_IN not in crash
        assert "(press enter on rank 3: the detail pane shows it); the other ranks" in crash
        assert cursor(pilot) == 3  # the cursor followed the crash
        await pilot.press("enter")  # as the hint says: the detail pane, with the traceback
        await pilot.pause()
        screen = dashboard(pilot)
        assert screen.show_detail and screen.detail.rank == 3


async def test_a_hint_never_sends_people_to_a_stack_that_has_not_come() -> None:
    """Issue #33: the hint said "press enter on rank 0" while its detail pane said "no stack
    captured" for the whole run. Until the culprit's stack comes, the hint says it has not;
    once it has, the key to see it."""
    before = straggling()
    before["ranks"][1]["stack"] = None
    source = FixtureSource([before, straggling(2)])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        (straggler,) = alert_texts(pilot)
        assert "press enter" not in straggler
        assert "see where rank 1 is (no stack or traceback from rank 1 yet): a rank-" in straggler
        await poll(pilot)  # its stack came
        (straggler,) = alert_texts(pilot)
        assert "(its stack in the detail pane: press enter on rank 1): a rank-dependent" in (
            straggler
        )


def test_every_phrasing_of_the_servers_hints_is_rewritten() -> None:
    from ddpwatch.diagnosis.alerts import Alert
    from ddpwatch.server.engine import with_port
    from ddpwatch.tui.widgets.alerts_panel import dashboard_hint

    assert dashboard_hint(f"look at rank 7's stack ({STACKS_IN}) or run py-spy", [2, 7]) == (
        "look at rank 7's stack (the detail pane: press enter on rank 7) or run py-spy"
    )
    assert dashboard_hint(f"the traceback ({STACKS_IN} shows it)", [4]) == (
        "the traceback (press enter on rank 4: the detail pane shows it)"
    )
    assert dashboard_hint(f"stacks ({STACKS_IN})", []) == (
        "stacks (the detail pane: press enter on its row)"
    )
    assert dashboard_hint("lower the learning rate", [1]) == "lower the learning rate"
    none = {7: False, 4: False}.get
    assert dashboard_hint(f"look at rank 7's stack ({STACKS_IN}) or run py-spy", [7], none) == (
        "look at rank 7's stack (no stack or traceback from rank 7 yet) or run py-spy"
    )
    assert dashboard_hint(f"the traceback ({STACKS_IN} shows it); the", [4], none) == (
        "the traceback (no stack or traceback from rank 4 yet); the"
    )
    assert dashboard_hint(f"stacks ({STACKS_IN})", [9], none) == (  # not in the document
        "stacks (the detail pane: press enter on rank 9)"
    )
    moved = with_port(
        [Alert("stalled", "error", (5,), (), "m", f"rank 5's stack ({STACKS_IN})")], 6001
    )
    assert "--port 6001" in moved[0].hint  # ddpwatch run moved off a busy 5599
    assert dashboard_hint(moved[0].hint, [5]) == (
        "rank 5's stack (the detail pane: press enter on rank 5)"
    )


# ----------------------------------------------------------------------------- 5: after the job


NAN = {
    "kind": "nan_loss",
    "severity": "error",
    "ranks": [2],
    "waiting": [],
    "message": "rank 2's loss is nan since step 60 while ranks 0, 1, 3 are finite",
    "hint": "lower the learning rate",
}
SILENT = {
    "kind": "silent",
    "severity": "error",
    "ranks": [3],
    "waiting": [0, 1, 2],
    "message": "rank 3 sent nothing for 4.0 s",
    "hint": "the process is frozen or gone",
}


def finished(tick: int = 30) -> dict[str, Any]:
    """The demo after rank 3's crash: torchrun stopped the others; five alerts were raised,
    four came and went."""
    doc = crashing(tick)
    for row in doc["ranks"]:
        if row["rank"] != 3:
            row.update(state=RankState.STOPPED, collective=None, exit_signal="SIGTERM")
    doc["alerts"] = []
    doc["history"] = [
        _entry("raised", 30.0, STRAGGLER),
        _entry("cleared", 36.0, STRAGGLER, duration_s=6.0),
        _entry("raised", 50.0, NAN),
        _entry("cleared", 60.0, NAN, duration_s=10.0),
        _entry("raised", 72.0, SILENT),
        _entry("cleared", 82.0, SILENT, duration_s=10.0),
        _entry("raised", 90.0, CRASHED),
        _entry("raised", 91.0, STRAGGLER),  # a second time
        _entry("cleared", 91.5, STRAGGLER, duration_s=0.5),
    ]
    doc["alerts"] = [copy.deepcopy(CRASHED)]  # still open, as the server leaves it
    return doc


async def test_a_finished_job_says_so_with_its_verdict_and_its_alerts() -> None:
    """serve/top: every rank seen has finished, so the job has."""
    from ddpwatch.outputs.summary import summary_lines, verdict

    ended = finished(30)
    later = copy.deepcopy(ended)
    later["server_time"] += 12
    source = FixtureSource([straggling(), ended, later])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        assert "job finished" not in header_text(pilot)
        await poll(pilot)
        await poll(pilot)
        assert "job finished 12s ago" in header_text(pilot)
        texts = alert_texts(pilot)
        # how long it ran: the summary's own figure (#33: one set of figures everywhere)
        ran = summary_lines(typed(later))[0].split(",")[0].removeprefix("ran ")
        assert texts[0] == (
            f"■ the job finished after {ran}: 5 alerts in its run · verdict: "
            f"{verdict(typed(later))}"
        )
        assert not any("every rank looks healthy" in t for t in texts)
        assert texts[1].startswith("✖ crashed rank 3")  # still open
        cleared = texts[2:]
        assert [t.split()[1] for t in cleared] == ["straggler", "nan_loss", "silent", "straggler"]
        assert "cleared after 6.0 s, at +36.0 s" in cleared[0]
        assert "cleared after 10.0 s, at +60.0 s" in cleared[1]
        assert "cleared after 0.5 s, at +91.5 s" in cleared[3]
        assert dashboard(pilot).alert_list.border_title == "alerts 1 · 4 cleared"


async def test_a_job_that_ended_by_its_process_says_so_even_with_ranks_left() -> None:
    """run --tui and demo: the job process ended; a rank that never said so does not matter."""

    class JobEnds(FixtureSource):
        ended = False

    doc = crashing(5)
    doc["history"] = doc["history"][:2]
    doc["alerts"] = []
    source = JobEnds([doc])
    async with make_app(source).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        texts = alert_texts(pilot)
        assert "every rank looks healthy now" in texts[0]  # running: nothing open...
        assert texts[1].startswith("✔ straggler rank 1 cleared after 6.0 s")  # ...one came, went
        JobEnds.ended = True
        await poll(pilot)
        texts = alert_texts(pilot)
        assert texts[0].startswith("■ the job finished after ")
        assert ": 1 alert in its run · verdict:" in texts[0]
        assert "job finished 0s ago" in header_text(pilot)
        JobEnds.ended = False  # restarted (an elastic job): the story is live again
        await poll(pilot)
        assert not alert_texts(pilot)[0].startswith("■")


async def test_while_the_job_runs_only_recently_cleared_alerts_stay_listed() -> None:
    doc = crashing(5)
    doc["alerts"] = []
    doc["job_started"] = doc["server_time"] - 200  # the straggler cleared at +36 s: long ago
    async with make_app(FixtureSource([doc])).run_test(size=(120, 35)) as pilot:
        await settle(pilot)
        assert alert_texts(pilot) == ["✔ no alerts: every rank looks healthy"]
