"""What a new user meets first: quitting a running job, where the cursor starts, ``o`` and
``e`` outside and under ``ddpwatch run --tui``, the replay header, and an empty dashboard.

Each goes through ``DashboardApp.run_test``; the quit question stops or leaves a real child
process (``sleep 60``) through ``ddpwatch run``'s own ``_with_dashboard``.
"""

from __future__ import annotations

import asyncio
import signal
import subprocess
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import free_port_pair
from textual.pilot import Pilot
from textual.widgets import Button, Static
from tui_fixtures import FixtureSource, document, healthy, typed

from ddpwatch.core.protocol import Sample, encode
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.jobs.launch import _with_dashboard
from ddpwatch.server.recording import Recorder
from ddpwatch.server.replay import ReplayServer
from ddpwatch.server.service import Server
from ddpwatch.status.schema import StatusDocument
from ddpwatch.tui.app import DashboardApp
from ddpwatch.tui.data.sources import (
    JobSource,
    LocalSource,
    RemoteSource,
    ReplaySource,
    StatusSource,
    local_source,
    replay_label,
)
from ddpwatch.tui.screens.dashboard import DashboardScreen
from ddpwatch.tui.screens.output import OutputScreen
from ddpwatch.tui.screens.quit import QuitScreen
from ddpwatch.tui.widgets.alerts_panel import AlertList
from ddpwatch.tui.widgets.header import StatusHeader, header_lines
from ddpwatch.tui.widgets.rank_table import RankTable

SLOW = 3600.0  # only the first fetch happens by itself; each test polls when it wants


class FakeServer:
    """What a ``LocalSource`` and ``ddpwatch run`` read of a ``Server``."""

    class collector:
        host = "127.0.0.1"
        port = 5599

    class state:
        started = 100.0

    def __init__(self, doc: dict[str, Any] | None = None) -> None:
        self.doc = doc if doc is not None else healthy(2)

    def status(self) -> StatusDocument:
        return typed(self.doc)


def make_app(source: StatusSource) -> DashboardApp:
    return DashboardApp(source, interval=SLOW)


async def settle(pilot: Pilot[Any]) -> None:
    await pilot.app.workers.wait_for_complete()
    await pilot.pause()
    await pilot.pause()


def dashboard(pilot: Pilot[Any]) -> DashboardScreen:
    app = pilot.app
    assert isinstance(app, DashboardApp)
    return app.dashboard


async def poll(pilot: Pilot[Any]) -> None:
    dashboard(pilot).poll_now()
    await settle(pilot)


def cursor(pilot: Pilot[Any]) -> Any:
    return dashboard(pilot).query_one(RankTable).cursor_key


def alerts_panel_text(pilot: Pilot[Any]) -> str:
    panel = dashboard(pilot).query_one(AlertList)
    return "\n".join(str(panel.get_option_at_index(i).prompt) for i in range(panel.option_count))


def header_text(pilot: Pilot[Any]) -> str:
    header = dashboard(pilot).query_one(StatusHeader)
    return "\n".join(line.plain for line in header_lines(header.info, header.content_size.width))


def notifications(pilot: Pilot[Any]) -> str:
    return "\n".join(n.message for n in pilot.app._notifications)


def no_ranks(doc: dict[str, Any]) -> dict[str, Any]:
    return {**doc, "ranks": [], "alerts": [], "world_size": None}


@pytest.fixture
def job() -> Iterator[subprocess.Popen[bytes]]:
    """A real child process standing in for the training job."""
    process = subprocess.Popen(["sleep", "60"])
    try:
        yield process
    finally:
        if process.poll() is None:
            process.kill()
        process.wait(5)


# ----------------------------------------------------------------------------- 1: q asks


def run_under_job(
    monkeypatch: pytest.MonkeyPatch, steps: Callable[[Pilot[Any]], Awaitable[None]]
) -> dict[str, Any]:
    """Make ``_with_dashboard``'s dashboard a ``run_test`` one that plays ``steps``."""
    seen: dict[str, Any] = {}

    def fake_show_dashboard(source: Any, **kwargs: Any) -> None:
        async def drive() -> None:
            app = make_app(source)
            async with app.run_test(size=(100, 30)) as pilot:
                await settle(pilot)
                await steps(pilot)
            seen["exited"] = not app.is_running

        asyncio.run(drive())

    monkeypatch.setattr("ddpwatch.tui.app.show_dashboard", fake_show_dashboard)
    return seen


def run_server() -> Server:
    """The local server ``ddpwatch run --tui`` runs the dashboard and the job with."""
    return Server("127.0.0.1", free_port_pair(), Thresholds())


async def ask_to_quit(pilot: Pilot[Any]) -> QuitScreen:
    await pilot.press("q")
    await pilot.pause()
    screen = pilot.app.screen
    assert isinstance(screen, QuitScreen)
    return screen


def test_q_then_stop_terminates_the_job(
    monkeypatch: pytest.MonkeyPatch,
    job: subprocess.Popen[bytes],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def steps(pilot: Pilot[Any]) -> None:
        screen = await ask_to_quit(pilot)
        text = str(screen.query_one("#quit-text", Static).content)
        assert f"pid {job.pid}" in text and "Detach" in text and "Stop the job" in text
        assert job.poll() is None  # asking stops nothing
        await pilot.click("#stop")
        await pilot.pause()

    seen = run_under_job(monkeypatch, steps)
    log = tmp_path / "job.log"
    code = _with_dashboard(run_server(), job, str(log))
    assert seen["exited"]
    assert job.returncode == -signal.SIGTERM and code == -signal.SIGTERM
    err = capsys.readouterr().err
    assert f"the job's output is in {log}" in err
    assert "verdict: the job did not start: it was stopped by you from the dashboard" in err


def test_q_then_detach_leaves_the_job_running(
    monkeypatch: pytest.MonkeyPatch,
    job: subprocess.Popen[bytes],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    async def steps(pilot: Pilot[Any]) -> None:
        await ask_to_quit(pilot)
        await pilot.press("d")
        await pilot.pause()

    seen = run_under_job(monkeypatch, steps)
    log = tmp_path / "job.log"
    code = _with_dashboard(run_server(), job, str(log))
    assert seen["exited"] and code == 0
    time.sleep(0.2)
    assert job.poll() is None  # still running after ddpwatch run returned
    err = capsys.readouterr().err
    assert f"keeps running as pid {job.pid}" in err and str(log) in err
    assert "monitoring has ended" in err and f"kill {job.pid}" in err


async def test_q_then_cancel_keeps_the_dashboard_and_the_job(
    job: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    app = make_app(JobSource(FakeServer(), job, str(tmp_path / "job.log")))
    async with app.run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        screen = await ask_to_quit(pilot)
        assert screen.focused is not None and screen.focused.id == "cancel"  # enter is safe
        await pilot.press("escape")
        await pilot.pause()
        assert isinstance(app.screen, DashboardScreen) and app.is_running
        await ask_to_quit(pilot)
        await pilot.press("enter")  # on cancel
        await pilot.pause()
        assert isinstance(app.screen, DashboardScreen) and app.is_running
    assert job.poll() is None


async def test_q_quits_at_once_without_a_running_job(tmp_path: Path) -> None:
    ended = subprocess.Popen(["true"])
    ended.wait(5)
    for source in (FixtureSource(), JobSource(FakeServer(), ended, str(tmp_path / "j.log"))):
        app = make_app(source)
        async with app.run_test(size=(100, 30)) as pilot:
            await settle(pilot)
            await pilot.press("q")
            await pilot.pause()
            assert not isinstance(app.screen, QuitScreen)
        assert not app.is_running


async def test_help_says_what_q_does_under_run_tui() -> None:
    async with make_app(FixtureSource()).run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        await pilot.press("question_mark")
        await pilot.pause()
        from ddpwatch.tui.screens.help import KEYS

        q = dict(KEYS)["q"]
        assert "run --tui" in q and "detach" in q and "stop the job" in q


# ----------------------------------------------------------------------------- 2: the cursor


async def test_cursor_starts_on_the_worst_rank_whatever_the_sort_then_stays() -> None:
    later = document(1)
    for row in later["ranks"]:  # rank 5 recovers; rank 14 is now the worst
        if row["rank"] == 5:
            row.update(state="running", error=None, exit_code=None)
    later["alerts"] = [a for a in later["alerts"] if 5 not in a["ranks"]]
    source = FixtureSource([no_ranks(healthy(2)), document(0), later])
    async with make_app(source).run_test(size=(120, 40)) as pilot:
        await settle(pilot)
        assert cursor(pilot) is None
        await pilot.press("greater_than_sign")  # sort by rank before any rank reported
        await pilot.pause()
        assert dashboard(pilot).query_state.sort == "rank"
        await poll(pilot)
        table = dashboard(pilot).query_one(RankTable)
        assert table.row_key(table.rows[0]) == 0
        assert cursor(pilot) == 5  # the crashed rank, not row 0
        await poll(pilot)
        assert cursor(pilot) == 5  # never moved under the user once placed
        await pilot.press("down")
        await poll(pilot)
        assert cursor(pilot) == 6


async def test_cursor_starts_on_the_worst_rank_reversed_at_8192() -> None:
    from tui_fixtures import big

    doc = big(8192)
    async with make_app(FixtureSource([no_ranks(doc), doc])).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("r")  # worst last
        await poll(pilot)
        table = dashboard(pilot).query_one(RankTable)
        assert cursor(pilot) == 8189 and table.row_key(table.rows[-1]) == 8189
        await pilot.pause()
        lines = [table.render_line(y).text for y in range(table.size.height)]
        assert any(line.startswith(">") and " 8189 " in line for line in lines)  # scrolled to


# ----------------------------------------------------------------------------- 3: o


async def test_o_outside_run_tui_says_where_output_is(job: subprocess.Popen[bytes]) -> None:
    async with make_app(FixtureSource()).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("o")
        await pilot.pause()
        assert isinstance(pilot.app.screen, DashboardScreen)
        said = notifications(pilot)
        assert "only available under ddpwatch run --tui" in said and "detail pane" in said


async def test_o_under_run_tui_opens_the_output(
    job: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    log = tmp_path / "job.log"
    log.write_text("loading data\n")
    async with make_app(JobSource(FakeServer(), job, str(log))).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("o")
        await pilot.pause()
        assert isinstance(pilot.app.screen, OutputScreen)
        assert not notifications(pilot)


# ----------------------------------------------------------------------------- 4: replay header


def write_recording(path: Path) -> None:
    """Rank 0 at t=1000.5, then 30 s of nothing, then rank 1: a replay at 1x waits in the gap."""
    recorder = Recorder(path, {"started": 1000.0})
    for rank, t in ((0, 1000.5), (1, 1030.0), (1, 1030.5)):
        sample = Sample(v=1, rank=rank, t=t, world_size=2, host="box", pid=10 + rank, step=3)
        recorder.frame(t, encode(sample))
    recorder.close()


def replay_percent(pilot: Pilot[Any]) -> int:
    """The header's "replay night.ddpw 37 %", as 37."""
    return int(header_text(pilot).split("replay night.ddpw ")[1].split(" %")[0])


async def test_replay_header_names_the_file_and_its_progress(tmp_path: Path) -> None:
    path = tmp_path / "night.ddpw"
    write_recording(path)
    server = ReplayServer(path, speed=1.0)
    source = local_source(server)  # what run_dashboard picks for a replay
    assert isinstance(source, ReplaySource)
    thread = threading.Thread(target=server.run, daemon=True)
    async with make_app(source).run_test(size=(120, 30)) as pilot:
        await settle(pilot)
        assert "no ranks in the recording yet" in alerts_panel_text(pilot)
        assert 0 <= replay_percent(pilot) < 50  # only the session record read
        assert "local" not in header_text(pilot)
        thread.start()
        deadline = time.monotonic() + 5
        while server.messages < 1 and time.monotonic() < deadline:
            await pilot.pause(0.05)
        await poll(pilot)  # in the 30 s gap: rank 0 shown, part of the file read
        assert 0 < replay_percent(pilot) < 100
        server.stop()
        thread.join(5)
        await poll(pilot)
        assert "replay night.ddpw 100 %" in header_text(pilot)


def test_replay_progress_and_label() -> None:
    assert replay_label("/data/runs/night.ddpw", 0.376) == "replay night.ddpw 37 %"
    assert replay_label("x", 0.999) == "replay x 99 %"
    assert replay_label("x", 1.0) == "replay x 100 %"
    assert isinstance(local_source(FakeServer()), LocalSource)
    assert not isinstance(local_source(FakeServer()), ReplaySource)


def test_replay_progress_runs_from_start_to_end(tmp_path: Path) -> None:
    path = tmp_path / "r.ddpw"
    write_recording(path)
    server = ReplayServer(path, speed=None)
    assert 0.0 < server.progress < 0.5  # the session record only
    server.run()
    assert server.progress == 1.0


# ----------------------------------------------------------------------------- 5: e


async def test_export_under_run_tui_goes_beside_the_log_and_names_it(
    job: subprocess.Popen[bytes], tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    run_dir, cwd = tmp_path / "run", tmp_path / "cwd"
    run_dir.mkdir()
    cwd.mkdir()
    monkeypatch.chdir(cwd)
    source = JobSource(FakeServer(), job, str(run_dir / "ddpwatch-run-1.log"))
    async with make_app(source).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("e")
        await pilot.pause()
        files = list(run_dir.glob("ddpwatch-status-*.json"))
        assert len(files) == 1 and not list(cwd.iterdir())
        assert str(files[0]) in notifications(pilot) and files[0].is_absolute()


async def test_export_elsewhere_goes_to_the_working_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.chdir(tmp_path)
    async with make_app(FixtureSource()).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.press("e")
        await pilot.pause()
        files = list(tmp_path.glob("ddpwatch-status-*.json"))
        assert len(files) == 1
        assert f"the status JSON on screen is in {files[0]}" in notifications(pilot)


# ----------------------------------------------------------------------------- 6: no ranks


async def test_serve_without_ranks_says_where_ranks_should_report() -> None:
    server = FakeServer(no_ranks(healthy(2)))
    async with make_app(LocalSource(server)).run_test(size=(120, 30)) as pilot:
        await settle(pilot)
        text = alerts_panel_text(pilot)
        assert "waiting for ranks on 127.0.0.1:5599" in text
        assert "DDPWATCH_ADDR" in text and "ddpwatch run" in text
        assert "healthy" not in text
        server.doc = healthy(2)  # ranks arrive, nothing wrong: now they look healthy
        await poll(pilot)
        assert "every rank looks healthy" in alerts_panel_text(pilot)


async def test_top_without_ranks_says_where_ranks_should_report() -> None:
    port = free_port_pair()
    source = RemoteSource("127.0.0.1", port, timeout=0.2)  # nothing there yet
    async with make_app(source).run_test(size=(120, 30)) as pilot:
        await settle(pilot)
        text = alerts_panel_text(pilot)
        assert f"waiting for ranks on 127.0.0.1:{port}" in text and "healthy" not in text


async def test_run_tui_without_ranks_says_they_are_starting(
    job: subprocess.Popen[bytes], tmp_path: Path
) -> None:
    source = JobSource(FakeServer(no_ranks(healthy(2))), job, str(tmp_path / "j.log"))
    async with make_app(source).run_test(size=(120, 30)) as pilot:
        await settle(pilot)
        assert "waiting for the job's ranks on 127.0.0.1:5599" in alerts_panel_text(pilot)


async def test_buttons_are_labelled() -> None:
    """The three answers, as the modal shows them."""
    screen = QuitScreen(42, "/tmp/x.log")
    async with make_app(FixtureSource()).run_test(size=(100, 30)) as pilot:
        await settle(pilot)
        await pilot.app.push_screen(screen)
        await pilot.pause()
        labels = [str(b.label) for b in screen.query(Button)]
        assert labels == ["Stop the job (s)", "Detach (d)", "Cancel (esc)"]
