"""The alert timeline: changes stamped with time and the job's elapsed time, escalations as
events of their own, bounded, and in the status document as ``history``."""

from __future__ import annotations

import datetime

from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.history import HISTORY_KEPT, AlertTracker, describe
from ddpwatch.server.document import status_document
from ddpwatch.state.state import ServerState
from ddpwatch.status.fmt import event_label, iso_time

T0 = 1_800_000_000.0
STRAGGLER = Alert("straggler", "warning", (1,), (0, 2), "rank 1 has not entered", "look")
STRAGGLER_ERROR = Alert("straggler", "error", (1,), (0, 2), "rank 1 still not", "look")
STALLED = Alert("stalled", "error", (1,), (), "rank 1 has made no progress", "look")
NAN = Alert("nan_loss", "error", (2,), (), "rank 2's loss is nan", "lower the lr")


def instant() -> AlertTracker:
    """A tracker without hysteresis: the tests of what a change carries tick sparsely."""
    return AlertTracker(raise_hold_s=0.0, clear_hold_s=0.0)


def test_changes_carry_time_elapsed_and_duration() -> None:
    tracker = instant()
    assert tracker.update([], T0 + 1, T0) == []
    (raised,) = tracker.update([NAN], T0 + 12.5, T0)
    assert (raised.event, raised.at, raised.elapsed_s) == ("raised", T0 + 12.5, 12.5)
    (cleared,) = tracker.update([], T0 + 20.0, T0)
    assert (cleared.event, cleared.duration_s, cleared.alert) == ("cleared", 7.5, NAN)
    entry = cleared.to_dict()
    assert entry["elapsed_s"] == 20.0 and entry["duration_s"] == 7.5
    assert datetime.datetime.fromisoformat(entry["time"]).timestamp() == T0 + 20.0
    assert [e.event for e in tracker.entries()] == ["raised", "cleared"]


def test_a_warning_that_becomes_an_error_is_an_escalation() -> None:
    tracker = instant()
    tracker.update([STRAGGLER], T0 + 2, T0)
    (up,) = tracker.update([STRAGGLER_ERROR], T0 + 10, T0)
    assert (up.event, up.previous, up.alert) == ("escalated", STRAGGLER, STRAGGLER_ERROR)
    assert up.to_dict()["from"] == {"kind": "straggler", "severity": "warning"}
    assert tracker.update([STRAGGLER_ERROR], T0 + 11, T0) == []  # no repeat
    (cleared,) = tracker.update([], T0 + 14, T0)
    assert cleared.duration_s == 12.0  # up since the first warning


def test_a_straggler_that_becomes_stalled_is_one_escalation() -> None:
    tracker = instant()
    tracker.update([STRAGGLER, NAN], T0 + 2, T0)
    changes = tracker.update([STALLED, NAN], T0 + 9, T0)
    assert [(c.event, c.alert.kind) for c in changes] == [("escalated", "stalled")]
    assert changes[0].previous == STRAGGLER
    (cleared,) = [c for c in tracker.update([NAN], T0 + 15, T0) if c.event == "cleared"]
    assert cleared.duration_s == 13.0  # up since the straggler was raised, at T0 + 2
    tracker.update([STALLED, NAN], T0 + 16, T0)
    # a different rank's alert going away while another is raised stays two events
    other = Alert("silent", "error", (3,), (), "rank 3 fell silent", "look")
    changes = tracker.update([other], T0 + 20, T0)
    assert sorted(c.event for c in changes) == ["cleared", "cleared", "raised"]


def test_the_timeline_is_bounded_newest_last() -> None:
    tracker = instant()
    for i in range(HISTORY_KEPT):
        tracker.update([NAN] if i % 2 == 0 else [], T0 + i, T0)
    tracker.update([STALLED], T0 + HISTORY_KEPT, T0)
    entries = tracker.entries()
    assert len(entries) == HISTORY_KEPT and tracker.total == HISTORY_KEPT + 1
    assert entries[-1].alert.kind == "stalled"


def test_status_document_has_the_history_and_the_job_start() -> None:
    tracker = instant()
    tracker.update([NAN], T0 + 5, T0)
    state = ServerState(started=T0 - 30)
    document = status_document(state, [NAN], T0 + 6, Thresholds(), tracker.entries())
    assert [e.alert.kind for e in document.history] == ["nan_loss"]
    assert document.job_started == T0 - 30  # no rank yet: the server's start
    assert status_document(state, [], T0, Thresholds()).history == []


def test_iso_time_has_an_offset_and_milliseconds() -> None:
    text = iso_time(T0 + 0.25)
    parsed = datetime.datetime.fromisoformat(text)
    assert parsed.tzinfo is not None and parsed.timestamp() == T0 + 0.25
    assert text.count(":") >= 3 and ".250" in text


def test_hints_name_the_servers_port_when_it_is_not_the_default() -> None:
    from ddpwatch.server.engine import with_port

    hint = Alert("straggler", "warning", (1,), (0,), "m", "its stack in ddpwatch status --json")
    assert with_port([hint], 5599) == [hint]
    (moved,) = with_port([hint], 57853)
    assert moved.hint == "its stack in ddpwatch status --port 57853 --json"
    assert moved.key == hint.key  # the same alert, only its words point elsewhere


def test_each_episode_keeps_its_own_times() -> None:
    """The same straggler raised three times (once an epoch) is three episodes: each
    clearing says how long that one was up, never the last one's figure."""
    tracker = instant()
    for start, up in ((5.0, 28.3), (40.0, 28.8), (75.0, 28.1)):
        tracker.update([STRAGGLER], T0 + start, T0)
        tracker.update([STRAGGLER_ERROR], T0 + start + 8, T0)
        tracker.update([], T0 + start + up, T0)
    entries = tracker.entries()
    assert [(e.event, e.episode) for e in entries] == [
        ("raised", 1), ("escalated", 1), ("cleared", 1),
        ("raised", 2), ("escalated", 2), ("cleared", 2),
        ("raised", 3), ("escalated", 3), ("cleared", 3),
    ]  # fmt: skip
    assert [e.duration_s for e in entries if e.event == "cleared"] == [28.3, 28.8, 28.1]
    assert {e.attempt for e in entries} == {1}


def test_a_new_attempt_closes_what_was_up_instead_of_clearing_it() -> None:
    crashed = Alert("crashed", "error", (1,), (0, 2), "rank 1 crashed", "read it")
    tracker = instant()
    tracker.update([crashed], T0 + 10, T0)
    tracker.update([crashed], T0 + 12, T0)
    changes = tracker.update([], T0 + 12.5, T0, attempt=2)
    assert [(c.event, c.closed_by, c.attempt, c.episode) for c in changes] == [
        ("cleared", "new_attempt", 1, 1)
    ]
    entry = changes[0].to_dict()
    assert entry["closed_by"] == "new_attempt" and entry["duration_s"] == 2.5
    (again,) = tracker.update([crashed], T0 + 20, T0, attempt=2)
    assert (again.event, again.attempt, again.episode) == ("raised", 2, 2)
    assert "attempt 2 began" in describe(changes[0])
    assert [event_label(e) for e in tracker.entries()] == [
        "raised #1", "ended with attempt 1 #1", "raised #2 in attempt 2"
    ]  # fmt: skip


def stalled(*ranks: int) -> Alert:
    return Alert("stalled", "error", ranks, (), f"ranks {ranks} made no progress", "look")


def straggler(rank: int) -> Alert:
    return Alert("straggler", "warning", (rank,), (0,), f"rank {rank} has not entered", "look")


def test_a_stall_whose_ranks_change_is_one_episode_updated_in_place() -> None:
    """The compile warm-up's flapping (#32): the stalled rank set went [0, 2] → [0, 1, 2] →
    [0, 2] → [0] → [1] → [1, 2] over ticks, and gone for a tick now and then: one raise,
    updates, one clearing, the episode's number and raise time kept throughout."""
    tracker = AlertTracker()
    sets: list[tuple[int, ...]] = [(0, 2), (0, 1, 2), (), (0, 2), (0,), (1,), (), (1, 2)]
    changes = []
    for n, ranks in enumerate(sets):
        changes += tracker.update([stalled(*ranks)] if ranks else [], T0 + 4 + n * 0.25, T0)
        (shown,) = tracker.shown
        assert (shown.episode, shown.raised_at) == (1, T0 + 4)
    changes += tracker.update([], T0 + 6.5, T0)
    changes += tracker.update([], T0 + 7.5, T0)
    assert [(c.event, c.alert.ranks) for c in changes] == [
        ("raised", (0, 2)),
        ("updated", (0, 1, 2)),
        ("updated", (0, 2)),
        ("updated", (0,)),
        ("updated", (1,)),
        ("updated", (1, 2)),
        ("cleared", (1, 2)),
    ]
    assert {c.episode for c in changes} == {1}
    assert changes[-1].duration_s == 2.5  # from the raise to when it was last found
    assert "(now rank 0, 1, 2, was 0, 2)" in describe(changes[1])
    assert tracker.shown == []


def test_a_warning_found_for_one_tick_is_never_raised() -> None:
    tracker = AlertTracker()
    assert tracker.update([straggler(1)], T0 + 1.0, T0) == []
    assert tracker.update([], T0 + 1.25, T0) == [] and tracker.shown == []
    assert tracker.update([straggler(1)], T0 + 2.0, T0) == []  # held afresh
    assert tracker.update([straggler(1)], T0 + 2.25, T0) == []
    (raised,) = tracker.update([straggler(1)], T0 + 2.5, T0)
    assert (raised.event, raised.at, raised.episode) == ("raised", T0 + 2.5, 1)


def test_an_error_is_raised_at_once() -> None:
    (raised,) = AlertTracker().update([NAN], T0 + 1.0, T0)
    assert raised.event == "raised"


def test_an_alert_that_comes_back_within_the_clear_hold_is_the_same_episode() -> None:
    tracker = AlertTracker()
    tracker.update([NAN], T0 + 1.0, T0)
    assert tracker.update([], T0 + 1.25, T0) == []
    assert [a.kind for a in tracker.shown] == ["nan_loss"]  # still on show, held
    assert tracker.update([NAN], T0 + 1.75, T0) == []
    assert tracker.update([], T0 + 2.0, T0) == []
    (cleared,) = tracker.update([], T0 + 3.0, T0)
    assert (cleared.event, cleared.episode, cleared.duration_s) == ("cleared", 1, 1.0)


def test_two_culprits_are_two_episodes_and_merge_into_one() -> None:
    """Stragglers in two subgroups are two alerts; ranks 1 and 2 silent, then one alert
    about both: the first episode goes on about both, the second ends at once."""
    tracker = instant()
    raised = tracker.update([straggler(1), straggler(3)], T0 + 1, T0)
    assert [(c.event, c.episode) for c in raised] == [("raised", 1), ("raised", 2)]
    silent = [Alert("silent", "error", (r,), (), "quiet", "look") for r in (1, 2)]
    tracker = AlertTracker()
    tracker.update(silent, T0 + 1, T0)
    both = Alert("silent", "error", (1, 2), (), "quiet", "look")
    changes = tracker.update([both], T0 + 2, T0)
    assert [(c.event, c.alert.ranks, c.episode) for c in changes] == [
        ("updated", (1, 2), 1),
        ("cleared", (2,), 2),
    ]
    assert [a.ranks for a in tracker.shown] == [(1, 2)]


def test_a_straggler_moving_to_another_rank_is_another_episode() -> None:
    """The culprit changed: its time lost must not be carried to the new one."""
    tracker = instant()
    tracker.update([straggler(1)], T0 + 1, T0)
    changes = tracker.update([straggler(2)], T0 + 2, T0)
    assert sorted((c.event, c.alert.ranks, c.episode) for c in changes) == [
        ("cleared", (1,), 1),
        ("raised", (2,), 2),
    ]


def test_a_mismatch_that_names_its_culprit_once_a_dead_ranks_call_is_known_is_one_episode() -> None:
    """A tie ("rank 0's call is not known, so which side is odd cannot be told") becomes an
    alert naming rank 1 once rank 0's black box is read: updated in place, the first raise
    kept. A mismatch between other ranks, found in the same tick, is an episode of its own."""
    tracker = instant()
    tie = Alert("collective_mismatch", "error", (), (1, 2), "which side cannot be told", "")
    named = Alert("collective_mismatch", "error", (1,), (0, 2), "rank 1 called", "")
    elsewhere = Alert("collective_mismatch", "error", (4,), (5,), "rank 4 called", "")
    (raised,) = tracker.update([tie], T0 + 1.0, T0)
    changes = tracker.update([named, elsewhere], T0 + 2.0, T0)
    assert sorted((c.event, c.alert.ranks) for c in changes) == [
        ("raised", (4,)),
        ("updated", (1,)),
    ]
    updated = next(c for c in changes if c.event == "updated")
    assert updated.episode == raised.episode
