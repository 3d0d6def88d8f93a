"""Two live processes reporting one rank (``state/claims.py``), told from a restart."""

from __future__ import annotations

from ddpwatch.core.protocol import Event, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.rules import Diagnosis, diagnose
from ddpwatch.state.state import ServerState

TH = Thresholds()


def identity(pid: int, host: str, step: int) -> Sample:
    """A heartbeat that repeats its process's identity (every 10th does)."""
    return Sample(v=1, rank=1, t=0.0, pid=pid, host=host, world_size=3, step=step, phase="train")


def plain(step: int) -> Sample:
    return Sample(v=1, rank=1, t=0.0, step=step, phase="train")


def both_report(state: ServerState, until: float) -> None:
    """Rank 1 from two processes, each repeating its identity every 5 s, 0.3 s apart."""
    t = 0.0
    while t <= until:
        state.apply(identity(100, "node-a", int(t)), t)
        state.apply(plain(int(t)), t + 0.1)
        state.apply(identity(200, "node-b", int(t)), t + 0.3)
        t += 5.0


def test_two_processes_with_one_rank_keep_one_record_and_are_named() -> None:
    """SLURM_LOCALID taken for RANK on two nodes: both processes say they are rank 1."""
    state = ServerState(started=0.0)
    both_report(state, until=10.0)
    assert set(state.claims.duplicates[1]) == {100, 200}
    kept = state.ranks[1]
    assert kept.first_seen < 10.0  # told apart at 10.0: the flip at 10.3 kept the record
    (alert,) = [a for a in diagnose(state, 10.5, TH) if a.kind == "duplicate_rank"]
    assert (alert.severity, alert.ranks) == ("error", (1,))
    assert alert.message.startswith(
        "rank 1 is reported by 2 processes at once: pid 100 on node-a and pid 200 on node-b"
    ), alert.message
    assert "ranks 0, 2 never connected" in alert.message
    assert "SLURM_PROCID" in alert.hint


def test_a_restart_is_no_duplicate_even_with_a_late_frame_of_the_old_process() -> None:
    """The old process's last identity lands after the new one's first (a relay held it):
    three changes, but the old pid never comes back again."""
    state = ServerState(started=0.0)
    state.apply(identity(100, "node-a", 5), 0.0)
    state.apply(identity(200, "node-a", 0), 10.0)  # the restarted worker
    state.apply(identity(100, "node-a", 5), 10.2)  # late
    for t in (15.0, 20.0, 25.0):
        state.apply(identity(200, "node-a", int(t)), t)
    assert state.claims.duplicates == {}
    assert state.ranks[1].pid == 200
    assert not [a for a in diagnose(state, 25.5, TH) if a.kind == "duplicate_rank"]


def test_restarts_one_after_another_are_no_duplicate() -> None:
    """torchrun --max-restarts: each worker crashes (its event) and the next one reports."""
    state = ServerState(started=0.0)
    for start, pid in ((0.0, 100), (8.0, 200), (16.0, 300)):
        for t in (start, start + 5.0):
            state.apply(identity(pid, "node-a", int(t)), t)
        state.apply(Event(v=1, rank=1, t=0.0, event="exit", exit_code=1), start + 6.0)
    state.apply(identity(200, "node-a", 9), 16.3)  # a late frame of the one before
    assert state.claims.duplicates == {}


def test_the_alert_ends_when_one_of_them_stops_reporting() -> None:
    state = ServerState(started=0.0)
    both_report(state, until=10.0)
    for t in (15.0, 20.0, 25.0, 30.0):
        state.apply(identity(200, "node-b", int(t)), t)  # pid 100 is gone
    assert not [a for a in diagnose(state, 30.5, TH) if a.kind == "duplicate_rank"]


def test_a_ticking_server_clears_it_once_a_claim_goes_stale() -> None:
    """Nothing changes when one of them stops: the alert ends with time, tick by tick."""
    state = ServerState(started=0.0)
    both_report(state, until=10.0)
    diagnosis = Diagnosis()
    assert [a.kind for a in diagnosis(state, 10.5, TH)].count("duplicate_rank") == 1
    state.ranks[1].last_seen = 40.0  # one process still reports, under its pid: no change
    ticks = [diagnosis(state, 10.5 + 0.25 * i, TH) for i in range(1, 98)]  # not silent yet
    assert not [a for a in ticks[-1] if a.kind == "duplicate_rank"]
