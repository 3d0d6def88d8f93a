"""The end-of-run summary: a pure function of the status document and its history."""

from __future__ import annotations

import io
from typing import Any

from ddpwatch.server.alerts import Alert
from ddpwatch.server.history import AlertTracker
from ddpwatch.server.summary import print_summary, summary_lines, verdict

T0 = 1_800_000_000.0
EXITED = Alert("exited", "error", (1,), (0, 2), "rank 1 exited with code 3 at step 51", "fix")
SLOW = Alert("slow_rank", "warning", (2,), (), "rank 2 is the slowest", "look")


def rank(r: int, state: str = "running", **fields: Any) -> dict[str, Any]:
    entry: dict[str, Any] = {
        "rank": r, "state": state, "host": "node0", "step": 51, "exit_code": None,
        "exit_signal": None, "error": None, "nan_step": None,
    }  # fmt: skip
    entry.update(fields)
    return entry


def document(ranks: list[dict[str, Any]], *ticks: list[Alert]) -> dict[str, Any]:
    tracker = AlertTracker()
    for i, alerts in enumerate(ticks):
        tracker.update(alerts, T0 + 10 + i, T0)
    return {
        "server_time": T0 + 72.0,
        "job_started": T0,
        "world_size": len(ranks),
        "ranks": ranks,
        "history": tracker.entries(),
    }


def test_an_early_exit_names_the_rank_its_code_and_who_it_took_down() -> None:
    ranks = [
        rank(0, "crashed", exit_code=1, error={"type": "RuntimeError"}),
        rank(1, "exited", exit_code=3),
        rank(2, "stopped", exit_code=-15, exit_signal="SIGTERM"),
    ]
    doc = document(ranks, [EXITED], [EXITED], [])
    assert summary_lines(doc) == [
        "ran 1 min 12 s, 3 ranks seen on 1 host, last step 51",
        "alerts, in order:",
        "  +10.0 s [error] exited, cleared after 2.0 s: rank 1 exited with code 3 at step 51",
        "ranks: 0 crashed (RuntimeError), exit 1 · 1 exit 3 · 2 stopped, SIGTERM",
        "verdict: rank 1 exited with code 3 at step 51; ranks 0, 2 failed because of it",
    ]


def test_a_straggler_that_escalated_is_listed_once_with_where_it_came_from() -> None:
    warning = Alert("straggler", "warning", (1,), (0, 2), "rank 1 has not entered", "fix")
    stalled = Alert("stalled", "error", (1,), (), "rank 1 has made no progress", "fix")
    doc = document([rank(0), rank(1), rank(2)], [warning], [stalled])
    lines = summary_lines(doc)
    assert lines[2] == "  +10.0 s [warning] straggler: rank 1 has not entered"
    assert lines[3] == "  +11.0 s [error] stalled (was straggler): rank 1 has made no progress"
    assert verdict(doc) == ("rank 1 held the others up (stopped making progress) at step 51")


def test_healthy_and_warning_only_runs() -> None:
    assert verdict(document([rank(0), rank(1)])) == "no problems seen"
    assert summary_lines(document([rank(0), rank(1)]))[1] == "alerts: none"
    assert verdict(document([rank(0), rank(1)], [SLOW])) == "no errors; 1 warning (slow_rank)"


def test_an_error_with_no_culprit_says_so() -> None:
    lost = Alert("silent", "error", (), (0, 1), "all ranks fell silent together", "fix")
    assert verdict(document([rank(0), rank(1)], [lost])) == (
        "silent: all ranks fell silent together (no single rank to blame)"
    )


def test_ranks_that_never_reported_are_counted_and_nan_uses_its_first_step() -> None:
    nan = Alert("nan_loss", "error", (2,), (0, 1), "rank 2's loss is nan since step 15", "fix")
    ranks = [rank(0), rank(1), rank(2, nan_step=15), {"rank": 3, "state": "not_connected"}]
    doc = document(ranks, [nan])
    assert summary_lines(doc)[0] == (
        "ran 1 min 12 s, 3 ranks seen on 1 host, 1 of 4 never reported, last step 51"
    )
    assert verdict(doc) == (
        "rank 2 produced the first non-finite loss at step 15; ranks 0, 1 waited for it"
    )


def test_print_summary_prefixes_every_line() -> None:
    out = io.StringIO()
    print_summary(document([rank(0)]), out)
    lines = out.getvalue().splitlines()
    assert lines[0].startswith("ddpwatch: ── summary")
    assert all(line.startswith("ddpwatch: ") for line in lines)
    assert lines[-1] == "ddpwatch: verdict: no problems seen"


def test_the_verdict_reads_an_alert_as_it_last_stood() -> None:
    """A crash is raised before its peers fail; the ranks it took down join its ``waiting``
    on later ticks, which change no history entry: the verdict must still say so."""
    first = Alert("crashed", "error", (1,), (), "rank 1 crashed", "fix")
    later = Alert("crashed", "error", (1,), (0, 2), "rank 1 crashed; ranks 0, 2 failed", "fix")
    ranks = [rank(0, "crashed"), rank(1, "crashed", error={"type": "RuntimeError"}),
             rank(2, "crashed")]  # fmt: skip
    live = document(ranks, [first], [later])
    live["alerts"] = [later.to_dict()]
    expected = "rank 1 crashed with RuntimeError at step 51; ranks 0, 2 failed because of it"
    assert verdict(live) == expected
    ended = document(ranks, [first], [later], [])  # cleared: the entry holds its last version
    assert verdict(ended) == expected
