"""One set of figures everywhere (#33 item 4): the run's duration, each rank's median step,
the ranks that waited and the time lost come from one computation (``diagnosis/figures.py``)
that the summary, the verdict, ``ddpwatch status``, the report and the dashboard's end state
all quote; the report's fixes are the live ones.

What a newcomer met: a 2 min 9 s run reported as "ran 2 min 50 s" (the report counted to the
end of the recording), "median step 0.205 s" where most steps took 8 ms (a median over
heartbeats), a time lost without the ~50 s the others waited on the slow-data rank, and the
report's generic "compare its GPU" fix where the live alert had said "give its DataLoader
more workers"."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import Recording, judged

from ddpwatch.commands.status import format_status
from ddpwatch.core.protocol import Event, Sample, encode
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.history import AlertTracker, describe
from ddpwatch.outputs.postmortem import RunReport, load_run
from ddpwatch.outputs.report_text import header_line, to_json, to_markdown
from ddpwatch.outputs.summary import summary_lines, verdict
from ddpwatch.server.replay import replay_to_end
from ddpwatch.status.schema import StatusDocument

T0 = 1_800_000_000.0
GENERIC = (
    "rank 2 computes or loads data slower than the others: compare its data wait, its GPU "
    "(clocks, temperature, other processes) and its batch sizes"
)
DATA = "rank 2 waits 100 ms per step for data, the others 1 ms: give its DataLoader more workers"


def typed(document: dict[str, Any]) -> StatusDocument:
    """The document as the server ends a watch with it: its verdict judged as the watch ends."""
    return judged(msgspec.convert(document, StatusDocument))


def rank(r: int, state: str = "exited", **fields: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {"rank": r, "state": state, "host": "node0", "step": 3440,
                             "exit_code": 0, "ended_at": T0 + 129.0, "median_step_s": 0.008}  # fmt: skip
    entry.update(fields)
    return entry


def slow(hint: str, share: float = 0.5) -> Alert:
    return Alert("slow_rank", "warning", (2,), (0, 1), "rank 2 enters DDP's gradient all-reduce "
                 "~100 ms after ranks 0, 1 every step", hint, lost_share=share)  # fmt: skip


def newcomers_run(*, still_up: bool = False) -> dict[str, Any]:
    """The newcomer's run, as its document ends: 2 min 9 s from the first report to the last
    exit, the watch going on 41 s after; rank 0 held ranks 1, 2 up for 10 s; rank 2 was slow
    on its data from +20 s to +120 s, the others waiting half of each step: raised with the
    generic fix, its fix the data-loading one from the next tick on (numbers and fixes move
    on without a history entry)."""
    tracker = AlertTracker(raise_hold_s=0.0, clear_hold_s=0.0)
    for t in (5.0, 13.0):  # they had waited 2 s at its raise, 10 s at its last tick
        straggler = Alert("straggler", "warning", (0,), (1, 2), "rank 0 has not entered",
                          "fix", waited_s=t - 3.0, phase="eval")  # fmt: skip
        tracker.update([straggler], T0 + t, T0)
    tracker.update([], T0 + 13.5, T0)
    tracker.update([slow(GENERIC)], T0 + 20, T0)
    for t in range(21, 120):
        tracker.update([slow(DATA)], T0 + t, T0)
    if not still_up:
        tracker.update([], T0 + 120, T0)
    return {
        "server_time": T0 + 170.0,
        "job_started": T0,
        "world_size": 3,
        "ranks": [rank(r) for r in range(3)],
        "history": tracker.entries(),
        "alerts": [a.to_dict() for a in tracker.shown],
    }


def test_the_run_lasts_from_the_first_report_to_the_last_end_in_every_output() -> None:
    doc = typed(newcomers_run())
    report = RunReport("run.ddpw", doc, {}, [], [], None)
    assert summary_lines(doc)[0].startswith("ran 2 min 9 s, 3 ranks seen on 1 host")
    assert report.duration_s == 129.0
    assert "ran 2 min 9 s" in header_line(report)  # not 2 min 50 s: the watch went on
    assert "ran 2 min 9 s" in format_status(doc)


def test_a_rank_killed_while_the_others_ended_ends_the_run_at_its_last_word() -> None:
    ranks = [rank(0, "crashed", ended_at=T0 + 60.0), rank(1, "crashed", ended_at=T0 + 61.0),
             rank(2, "silent", ended_at=None, exit_code=None, last_seen_s=115.0)]  # fmt: skip
    doc = typed({"server_time": T0 + 180.0, "job_started": T0, "world_size": 3, "ranks": ranks})
    assert summary_lines(doc)[0].startswith("ran 1 min 5 s,")  # its last word, at +65 s
    running = typed({"server_time": T0 + 180.0, "job_started": T0, "world_size": 3,
                     "ranks": [rank(0, "running", ended_at=None), *ranks[1:]]})  # fmt: skip
    assert summary_lines(running)[0].startswith("ran 3 min 0 s,")  # still running: the watch's


def test_the_time_lost_counts_the_waits_on_a_slow_rank() -> None:
    """The others waited half of each step for rank 2 for 1 min 40 s: 50 s lost, beside the
    10 s rank 0 held them up."""
    doc = typed(newcomers_run())
    slow_text = (
        "rank 2 was slower than ranks 0, 1 for 1 min 40 s: they waited for it every step, "
        "50.0 s in all (39 % of a 2 min 9 s run) (slow_rank)"
    )
    held_text = "rank 0 held ranks 1, 2 up once, 10.0 s (8 % of a 2 min 9 s run), in 'eval'"
    lines = summary_lines(doc)
    assert f"time lost: 1 min 0 s in all (47 % of a 2 min 9 s run): {slow_text}; {held_text}" in (
        lines
    )
    assert verdict(doc) == f"the job finished: every rank exited 0; {slow_text}; {held_text}"
    status = [line.strip() for line in format_status(doc).splitlines()]  # ended: indented
    assert lines[0] in status and next(x for x in lines if x.startswith("time lost")) in status


def test_the_reports_fix_is_the_one_the_alert_gave_live() -> None:
    """Raised with the generic fix, the slow rank's alert gave the data-loading one live from
    the next tick on: the report's hints and culprits say that one, whether the alert cleared
    (its clearing holds its last words) or was still up at the end (the document's alerts)."""
    for still_up in (False, True):
        doc = typed(newcomers_run(still_up=still_up))
        report = RunReport("run.ddpw", doc, {}, [], [], None)
        assert ("slow_rank", DATA) in report.hints()
        assert ("slow_rank", GENERIC) not in report.hints()
        assert [e.hint for e in report.run.episodes if e.kind == "slow_rank"] == [DATA]


def test_an_alert_was_up_as_long_in_the_summary_as_the_alert_stream_said() -> None:
    """The live holds (a warning goes up after 0.5 s, anything comes down after 1 s unseen):
    the stream said "cleared slow_rank (rank 2) after 15.6 s"; the summary said 16.6 s, the
    clear hold counted in, and the time lost with it."""
    tracker = AlertTracker()
    changes = []
    for i in range(80):
        t = 10.0 + i * 0.25
        changes += tracker.update([slow(DATA, 0.8)] if t < 26.0 else [], T0 + t, T0)
    cleared = next(c for c in changes if c.event == "cleared")
    after = describe(cleared).rsplit(" after ", 1)[1]
    assert after == "15.5 s"
    doc = {"server_time": T0 + 40.0, "job_started": T0, "world_size": 3,
           "ranks": [rank(r) for r in range(3)], "history": tracker.entries()}  # fmt: skip
    lines = summary_lines(typed(doc))
    assert f"  +10.5 s [warning] slow_rank, cleared after {after}" in [
        line.split(":")[0] for line in lines
    ]
    assert "for 15.5 s: they waited for it every step, 12.4 s in all" in lines[-1]


def _sample(r: int, step: int, sent: float, step_time: float) -> bytes:
    return encode(Sample(v=1, rank=r, t=sent, step=step, world_size=2, host="node-a",
                         pid=200 + r, step_time_s=step_time))  # fmt: skip


def test_a_recorded_runs_summary_status_and_report_agree_figure_for_figure(
    tmp_path: Path,
) -> None:
    """A real server records two ranks: 40 heartbeats of 60 steps of 8 ms, then 20 of one
    0.4 s step each, then both exit; the watch goes on after. The live summary, ``ddpwatch
    status`` asking the live server and the report of the recording quote the same duration
    and median step: 8 ms, not the slow steps' time a third of the heartbeats carry."""
    path = tmp_path / "run.ddpw"
    live = Recording(path)
    try:
        sent, step = time.time(), 0
        for beat in range(60):
            fast = beat < 40
            step += 60 if fast else 1
            sent += 0.48 if fast else 0.4
            live.send(*(_sample(r, step, sent, 0.008 if fast else 0.4) for r in (0, 1)))
            time.sleep(0.01)
        time.sleep(0.3)
        live.send(*(encode(Event(v=1, rank=r, t=sent, event="exit", exit_code=0)) for r in (0, 1)))
        live.wait_for(lambda s: all(r["state"] == "exited" for r in s["ranks"]), 10.0)
        time.sleep(1.5)  # the watch outlives the job
        document = live.server.status()
        status = subprocess.run(  # as a user asks the live server
            [sys.executable, "-m", "ddpwatch", "status", "--port", str(live.port)],
            capture_output=True, text=True, timeout=30, check=True,
        ).stdout  # fmt: skip
    finally:
        live.stop()
    summary = summary_lines(document)
    overview = summary[0]
    assert "median step 0.008 s" in overview, summary
    assert overview in [line.strip() for line in status.splitlines()], status  # ended: indented
    report = load_run(path, *replay_to_end(path))
    assert report.summary[0] == overview
    ran = overview.split(",")[0]
    assert f"{ran}," in header_line(report)
    assert [r.median_step_time_s for r in report.ranks] == [0.008, 0.008]
    assert "| 0 | node-a | exited | 2420 | 0.008 s |" in to_markdown(report)
    data = msgspec.json.decode(to_json(report))
    assert data["duration_s"] == pytest.approx(report.run.run_s)
    assert data["median_step_time_s"] == 0.008


def test_the_reports_json_has_the_summarys_time_lost() -> None:
    doc = typed(newcomers_run())
    data = msgspec.json.decode(to_json(RunReport("run.ddpw", doc, {}, [], [], None)))
    assert [(x["rank"], x["seconds"], x["held_s"], x["slowed_s"]) for x in data["time_lost"]] == [
        (2, 50.0, 0.0, 50.0),
        (0, 10.0, 10.0, None),
    ]


def test_holds_a_heartbeat_apart_are_counted_apart_and_a_frozen_ranks_two_alerts_as_one() -> None:
    """RETURNN #1621's mode (``rank0-eval-epochs``): rank 0 evaluates alone three times, 0.3 s
    of training apart, less than a heartbeat, so each hold's measured wait runs into the next;
    three straggler episodes are still three holds (seen in CI: "2 times"). A frozen rank's
    ``silent`` then ``straggler`` over the same span stay one hold."""
    from ddpwatch.diagnosis.episodes import Episode
    from ddpwatch.diagnosis.figures import time_lost

    def hold(kind: str, raised: float, cleared: float, waited: float) -> Episode:
        return Episode(kind=kind, severity="error", ranks=(0,), waiting=(1, 2), message="",
                       raised_s=raised, cleared_s=cleared, waited_s=waited,
                       waited_at_s=cleared)  # fmt: skip

    # each wait measured 6.2 s to its clearing: 0.2 s into the one before
    evaluations = [hold("straggler", 2.5 + 6 * n, 6.0 + 6 * n, 6.2) for n in range(3)]
    (lost,) = time_lost(evaluations, 30.0)
    assert lost.times == 3
    assert lost.held_s == pytest.approx(18.2)  # the time, counted once: -0.2 s to 18.0 s
    frozen = [hold("silent", 3.0, 9.0, 6.0), hold("straggler", 4.0, 9.0, 6.5)]
    (lost,) = time_lost(frozen, 30.0)
    assert lost.times == 1
