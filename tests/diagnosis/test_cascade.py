"""The cascade family (``diagnosis/rules/cascade.py``): one rank fails and its peers follow;
the rank that failed first is blamed, not its peers; clean exits while others run."""

from __future__ import annotations

import pytest
from lockstep import (
    BOOM,
    NOW,
    OOM,
    ORDINAL,
    PEER,
    STACK,
    TH,
    WATCHDOG,
    job,
    only,
    rank,
    state_of,
    waiting_in,
)

from ddpwatch.core.protocol import ErrorInfo, Event, Hello, Sample
from ddpwatch.diagnosis.rules import (
    diagnose,
    rule_cascade,
    rule_clean_exit,
)
from ddpwatch.state.state import ServerState


def test_exception_on_one_rank_blames_it_not_its_peers() -> None:
    state = job(3, step=311)
    state.ranks[1] = rank(1, 3, step=311, error=BOOM, error_time=NOW - 2.0, stack=STACK)
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, step=311, error=PEER, error_time=NOW - 1.9)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("crashed", (1,), (0, 2))]
    message = alerts[0].message
    assert message.startswith("rank 1 crashed in 'forward' at step 311, train.py:88")
    assert "ValueError: boom" in message and "ranks 0, 2" in message


def test_exception_cascade_through_apply() -> None:
    state = ServerState(started=0.0)
    for r in range(3):
        state.apply(
            Hello(v=1, rank=r, t=1.0, world_size=3, local_rank=r, host="n", pid=50 + r), 1.0
        )
        state.apply(Sample(v=1, rank=r, t=2.0, step=9, phase="forward", loss=0.5), 2.0)
    state.apply(Event(v=1, rank=1, t=3.0, event="crash", error=OOM), 3.0)
    for r in (0, 2):
        state.apply(Event(v=1, rank=r, t=3.2, event="crash", error=PEER), 3.2)
        state.apply(Event(v=1, rank=r, t=3.3, event="exit", exit_code=1), 3.3)
    alerts = diagnose(state, 4.0, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("crashed", (1,), (0, 2))]
    assert "out of memory" in alerts[0].message
    assert "batch size" in alerts[0].hint


def test_killed_rank_is_the_silent_root() -> None:
    state = job(4, step=311)
    state.ranks[1] = rank(1, step=311, last_seen=NOW - 5.0, pid=4242)
    state.ranks[0] = rank(0, step=311, error=PEER, error_time=NOW - 4.6)
    state.ranks[2] = rank(2, step=311, error=PEER, error_time=NOW - 4.5)
    state.ranks[3] = rank(3, step=311, exit_time=NOW - 4.0, exit_signal="SIGTERM")
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("silent", (1,), (0, 2, 3))]
    assert "5.0 s" in alerts[0].message
    assert "py-spy dump --pid 4242" in alerts[0].hint


def test_ranks_silent_together_are_named_only_once_the_tie_has_lasted() -> None:
    """Rank 1 killed; rank 0 heard 0.25 s after it, its crash report ("Connection reset by
    peer") late on a loaded machine: nothing tells them apart yet, so neither is named
    until a tie window has passed; the late report then makes rank 0 a victim."""

    def tied(now: float, rank0_crashed: bool) -> ServerState:
        state = job(3, step=7)
        state.ranks[1] = rank(1, 3, step=7, last_seen=NOW - 3.05)
        if rank0_crashed:
            state.ranks[0] = rank(0, 3, step=7, error=PEER, error_time=NOW - 2.8)
        else:
            state.ranks[0] = rank(0, 3, step=7, last_seen=NOW - 2.8)
        state.ranks[2] = rank(2, 3, step=7, error=PEER, error_time=NOW - 2.75)
        return state

    assert diagnose(tied(NOW, rank0_crashed=False), NOW, TH) == []
    alerts = diagnose(tied(NOW, rank0_crashed=True), NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("silent", (1,), (0, 2))]
    later = NOW + 2 * TH.interval + 0.5
    alerts = diagnose(tied(later, rank0_crashed=False), later, TH)
    assert [(a.kind, a.ranks) for a in alerts] == [("silent", (0, 1))]


@pytest.mark.parametrize("heard_after", [0.0, 0.3])
def test_a_rank_last_heard_with_its_peers_lost_connections_is_their_lost_peer(
    heard_after: float,
) -> None:
    """Seen in the full suite under 2 CPU hogs (tests/e2e/test_e2e.py's killed rank): rank 1's
    last heartbeat and ranks 0 and 2's "Connection reset by peer" applied in one receive, at
    one time. Every failure is a lost peer, and rank 1 the only rank that stopped talking:
    it is named, once silent a tie window past the threshold (its own report could still
    come until then); never while the window lasts."""

    def tie() -> ServerState:
        state = job(3, step=7)
        failed = NOW - TH.silent - 1.0
        state.ranks[1] = rank(1, 3, step=7, last_seen=failed + heard_after)
        for r in (0, 2):
            state.ranks[r] = rank(r, 3, step=7, error=PEER, error_time=failed)
        return state

    assert diagnose(tie(), NOW, TH) == []  # held: neither rank 1 nor "no culprit"
    later = NOW + 2 * TH.interval + 0.5
    alerts = diagnose(tie(), later, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("silent", (1,), (0, 2))]


def test_a_rank_heard_well_after_its_peers_lost_connections_is_not_named() -> None:
    """Heard 3 s after the failures, the silent rank was alive when they happened: the peer
    they lost is someone ddpwatch does not see."""
    state = job(3, step=7)
    state.ranks[1] = rank(1, 3, step=7, last_seen=NOW - TH.silent - 3.0)
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, step=7, error=PEER, error_time=NOW - TH.silent - 6.0)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks) for a in alerts] == [("crashed", ())]


def test_silent_rank_makes_its_waiting_peers_victims() -> None:
    state = job(3)
    state.ranks[1] = rank(1, 3, last_seen=NOW - 8.0)  # SIGSTOPped or hung holding the GIL
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, last_progress=NOW - 8, **waiting_in("all_reduce", 9, 8.0))
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("silent", (1,), (0, 2))]


def test_peer_failure_without_root_waits_for_the_culprit() -> None:
    state = job(3)
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, error=PEER, error_time=NOW - 1.0)
    state.ranks[1] = rank(1, 3, last_seen=NOW - 1.2)  # killed, not yet silent
    assert diagnose(state, NOW, TH) == []


def test_peer_failure_without_root_names_no_culprit_after_the_window() -> None:
    """A rank whose own error only says a peer went away is a victim, even the first one:
    the issue's early-exit report had rank 0 blamed for "Connection closed by peer"."""
    state = job(3)
    state.ranks[0] = rank(0, 3, error=PEER, error_time=NOW - 4.8)
    state.ranks[1] = rank(1, 3, error=PEER, error_time=NOW - 5.0)
    state.ranks[2] = rank(2, 3, exit_time=NOW - 4.5, exit_signal="SIGTERM")
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("crashed", (), (0, 1, 2))]
    assert "lost the connection to a peer" in alerts[0].message


@pytest.mark.parametrize(("age", "expected"), [(1.0, []), (4.0, [("exited", (), (0, 1, 2, 3))])])
def test_sigterm_without_root(age: float, expected: list[tuple[str, tuple[int, ...]]]) -> None:
    """Stopped from outside with no failure before: say so, but blame no rank."""
    state = job(4, exit_time=NOW - age, exit_signal="SIGTERM", last_seen=NOW - age)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == expected
    assert all(a.severity == "warning" and "SIGTERM" in a.message for a in alerts)


def test_nonzero_exit_is_a_root() -> None:
    state = job(3)
    state.ranks[2] = rank(2, 3, exit_time=NOW - 3, exit_code=1, last_seen=NOW - 3)
    state.ranks[0] = rank(0, 3, error=PEER, error_time=NOW - 2.9)
    state.ranks[1] = rank(1, 3, exit_time=NOW - 2, exit_signal="SIGTERM")
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.severity, a.ranks, a.waiting) for a in alerts] == [
        ("exited", "error", (2,), (0, 1))
    ]
    assert "exited with code 1" in alerts[0].message
    assert "rank 0 failed because of it" in alerts[0].message
    assert "rank 1 was stopped by the launcher after it" in alerts[0].message


@pytest.mark.parametrize("code", [0, None])
def test_clean_exit_is_the_root_once_the_others_fail(code: int | None) -> None:
    """One rank returns early (code 0) and its peers lose their connection: it broke them."""
    state = job(3)
    state.ranks[1] = rank(1, 3, exit_time=NOW - 3, exit_code=code, last_seen=NOW - 3, step=50)
    state.ranks[0] = rank(0, 3, error=PEER, error_time=NOW - 3.1)
    state.ranks[2] = rank(2, 3, exit_time=NOW - 2, exit_signal="SIGTERM", exit_code=-15)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("exited", (1,), (0, 2))]
    assert "exited normally (code 0)" in alerts[0].message and "step 50" in alerts[0].message


def test_two_roots_each_get_an_alert_and_victims_go_to_the_earliest() -> None:
    state = job(4)
    state.ranks[1] = rank(1, error=BOOM, error_time=NOW - 3.0)
    state.ranks[3] = rank(3, error=OOM, error_time=NOW - 2.0)
    state.ranks[0] = rank(0, error=PEER, error_time=NOW - 2.9)
    state.ranks[2] = rank(2, exit_time=NOW - 2.5, exit_signal="SIGTERM")
    alerts = rule_cascade(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [
        ("crashed", (1,), (0, 2)),
        ("crashed", (3,), ()),
    ]


def test_the_same_error_on_many_ranks_is_one_alert() -> None:
    state = job(8, error=ORDINAL, error_time=NOW - 1.0)
    for r in range(4):
        state.ranks[r] = rank(r, 8)
    alert = only(rule_cascade(state, NOW, TH), "crashed")
    assert alert.ranks == (4, 5, 6, 7)
    assert alert.message.startswith("ranks 4-7 crashed")
    assert "global rank" in alert.message


def test_timeouts_are_victims_of_a_silent_rank() -> None:
    state = job(3)
    state.ranks[1] = rank(1, 3, last_seen=NOW - 600)  # hung holding the GIL
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, error=WATCHDOG, error_time=NOW - 1.0)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("silent", (1,), (0, 2))]


def test_timeouts_alone_are_one_root() -> None:
    state = job(3)
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, error=WATCHDOG, error_time=NOW - 1.0)
    state.ranks[1] = rank(1, 3, exit_time=NOW - 0.5, exit_signal="SIGTERM")
    alerts = rule_cascade(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("crashed", (0, 2), (1,))]
    assert "did not finish within the process-group timeout" in alerts[0].message


def test_late_silent_rank_is_a_victim_of_an_earlier_crash() -> None:
    state = job(3)
    state.ranks[1] = rank(1, 3, error=BOOM, error_time=NOW - 6.0)
    state.ranks[2] = rank(2, 3, last_seen=NOW - 5.5)  # SIGKILLed by the launcher afterwards
    state.ranks[0] = rank(0, 3, error=PEER, error_time=NOW - 5.9)
    assert [(a.kind, a.ranks, a.waiting) for a in rule_cascade(state, NOW, TH)] == [
        ("crashed", (1,), (0, 2))
    ]


# --------------------------------------------------------------------------- exits


def test_clean_exit_while_others_run_warns() -> None:
    state = job(4)
    state.ranks[3] = rank(3, exit_time=NOW - 15, exit_code=0, last_seen=NOW - 15)
    alert = only(diagnose(state, NOW, TH), "exited")
    assert alert.severity == "warning" and alert.ranks == (3,)
    assert alert.message == (
        "rank 3 exited at step 500 while ranks 0-2 still run; they will hang in their next "
        "collective"
    )


def test_clean_exit_with_others_stuck_in_a_collective_is_an_error() -> None:
    state = job(4, **waiting_in("barrier", 77, 6.0))
    state.ranks[3] = rank(3, exit_time=NOW - 6.5, exit_code=0)
    alert = only(diagnose(state, NOW, TH), "exited")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (3,), (0, 1, 2))
    assert "barrier #77" in alert.message and "6.0 s" in alert.message


@pytest.mark.parametrize(
    "state",
    [
        job(4, exit_time=NOW - 20, exit_code=0, last_seen=NOW - 20),  # all done
        state_of(rank(0, 2, exit_time=NOW - 1, exit_code=0), rank(1, 2)),  # a second apart
    ],
)
def test_clean_exits_that_are_fine(state: ServerState) -> None:
    assert rule_clean_exit(state, NOW, TH) == []
    assert diagnose(state, NOW, TH) == []


GLOO_CONNECT = ErrorInfo(
    type="RuntimeError",
    message="Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/gloo/"
    "transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused, "
    "remote=[127.0.0.1]:39329",
)


@pytest.mark.parametrize(
    ("rendezvous", "named", "absent"),
    [
        ("standalone", "c10d rendezvous on a free port of one node", "GLOO_SOCKET_IFNAME"),
        ("static", "static rendezvous (--master-addr/--master-port)", "--standalone"),
        (None, "the store torchrun keeps across attempts", "static rendezvous"),
    ],
)
def test_a_rendezvous_fix_names_the_rendezvous_in_use(
    rendezvous: str | None, named: str, absent: str
) -> None:
    """Issue #33: the gloo_connect fix blamed "a static rendezvous (--master-addr/--master-port)"
    on a --standalone job; the rank's identity says which rendezvous its torchrun used."""
    state = ServerState(started=0.0)
    for r in range(2):
        hello = Hello(v=1, rank=r, t=1.0, world_size=2, pid=50 + r, rendezvous=rendezvous)
        state.apply(hello, 1.0)
    state.apply(Event(v=1, rank=1, t=2.0, event="crash", error=GLOO_CONNECT), 2.0)
    state.apply(Event(v=1, rank=1, t=2.1, event="exit", exit_code=1), 2.1)
    (crashed,) = [a for a in diagnose(state, 3.0, TH) if a.kind == "crashed"]
    assert named in crashed.hint
    assert absent not in crashed.hint
    assert "PrefixStore" in crashed.hint
