"""The startup family (``diagnosis/rules/startup.py``): the rank behind in the startup phases,
and ranks that never connected."""

from __future__ import annotations

from typing import Any

import pytest
from lockstep import (
    NOW,
    STACK,
    TH,
    only,
    rank,
    state_of,
)

from ddpwatch.diagnosis.rules import (
    diagnose,
    rule_not_connected,
    rule_startup_hang,
)
from ddpwatch.server.records import RankRecord
from ddpwatch.server.state import ServerState


def starting(r: int, phase: str, since: float, world: int = 4, **changes: Any) -> RankRecord:
    return rank(r, world, step=None, phase=phase, phase_since=NOW - since, **changes)


def test_startup_hang_names_the_rank_behind() -> None:
    state = state_of(
        starting(0, "model_wrap", 70),
        starting(1, "model_wrap", 70),
        starting(2, "device", 70, stack=STACK),
        starting(3, "model_wrap", 70),
    )
    alert = only(diagnose(state, NOW, TH), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("warning", (2,), (0, 1, 3))
    assert alert.message == (
        "rank 2 is still in 'device' after 70.0 s (train.py:88) while ranks 0, 1, 3 wait in "
        "'model_wrap'"
    )


def test_startup_hang_unknown_phase_counts_after_train() -> None:
    state = state_of(starting(0, "warmup_data", 130, 2), starting(1, "first_step", 130, 2))
    alert = only(rule_startup_hang(state, NOW, TH), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (1,), (0,))


@pytest.mark.parametrize(
    "state",
    [
        state_of(starting(0, "rendezvous", 30, 2), starting(1, "started", 30, 2)),  # too soon
        state_of(starting(0, "forward", 100, 2), starting(1, "eval", 100, 2)),  # past startup
        state_of(  # the last rank has just joined the others in rendezvous
            starting(0, "rendezvous", 70, 3),
            starting(1, "rendezvous", 0.3, 3),
            starting(2, "rendezvous", 70, 3),
        ),
    ],
)
def test_startup_hang_quiet(state: ServerState) -> None:
    assert rule_startup_hang(state, NOW, TH) == []


def test_startup_hang_waiting_for_a_rank_that_never_connected() -> None:
    state = state_of(*(starting(r, "rendezvous", 70, first_seen=NOW - 70) for r in range(3)))
    alerts = diagnose(state, NOW, TH)
    hang = only(alerts, "startup_hang")
    assert (hang.ranks, hang.waiting) == ((3,), (0, 1, 2))
    missing = only(alerts, "not_connected")
    assert (missing.severity, missing.ranks) == ("error", (3,))


@pytest.mark.parametrize(("elapsed", "severity"), [(5, None), (12, "warning"), (70, "error")])
def test_not_connected(elapsed: float, severity: str | None) -> None:
    state = state_of(*(rank(r, 8, first_seen=NOW - elapsed) for r in (0, 1, 2, 4, 5, 6)))
    alerts = rule_not_connected(state, NOW, TH)
    if severity is None:
        assert alerts == []
        return
    alert = only(alerts, "not_connected")
    assert (alert.severity, alert.ranks) == (severity, (3, 7))
    assert alert.message.startswith(f"ranks 3, 7 of 8 have not connected {elapsed:.1f} s")


def test_not_connected_ignores_ranks_beyond_the_world() -> None:
    state = state_of(rank(0, 2, first_seen=NOW - 30), rank(1, 2, first_seen=NOW - 30))
    state.ranks[5] = rank(5, 2, first_seen=NOW - 30)
    assert rule_not_connected(state, NOW, TH) == []
