"""The startup family (``diagnosis/rules/startup.py``): the rank behind in the startup phases,
and ranks that never connected."""

from __future__ import annotations

from typing import Any

import pytest
from lockstep import (
    NOW,
    STACK,
    TH,
    kinds,
    only,
    rank,
    state_of,
    waiting_in,
)

from ddpwatch.core.protocol import Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts.ranks import cpu_growing, still_working
from ddpwatch.diagnosis.rules import (
    diagnose,
    rule_not_connected,
    rule_startup_hang,
)
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState


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


# ------------------------------------------------------------ a slow start is not a hang (#32)

LOADED = Thresholds(stall_after=4.0, silent_after=3.0, startup_after=6.0)
"""``serve --stall-after 4 --silent-after 3 --startup-after 6``, as the issue ran it."""


def importing(r: int, since: float, world: int = 3, cpu_grew: float = 0.3) -> RankRecord:
    """A rank that said its early hello ``since`` s ago and is still importing: phase
    'starting', its CPU time last grown ``cpu_grew`` s ago, at 0.4 s a second before."""
    return starting(
        r,
        "starting",
        since,
        world,
        first_seen=NOW - since,
        cpu_s=4.0,
        cpu_grew_at=NOW - cpu_grew,
        cpu_rate=0.4,
    )


def test_ranks_still_importing_are_starting_not_never_connected() -> None:
    """Issue #32: "ranks 1, 2 never connected while rank 0 has waited in 'rendezvous' for
    6.2 s" while their processes were alive, importing Lightning."""
    state = state_of(
        starting(0, "rendezvous", 6.2, 3, first_seen=NOW - 6.5),
        importing(1, 5.9),
        importing(2, 5.8),
    )
    alerts = diagnose(state, NOW, LOADED)
    assert not [a for a in alerts if "never connected" in a.message], alerts
    assert "not_connected" not in kinds(alerts)
    note = only(alerts, "startup_hang")
    assert (note.severity, note.ranks, note.waiting) == ("info", (1, 2), (0,))
    assert note.message == (
        "ranks 1, 2 are still starting after 5.9 s, their CPU time growing (importing or "
        "preparing, not hung) while rank 0 has waited in 'rendezvous' for 6.2 s"
    )


@pytest.mark.parametrize(("since", "severity"), [(20, "info"), (130, "warning")])
def test_a_long_start_while_cpu_grows_is_a_note_then_a_warning_never_an_error(
    since: float, severity: str
) -> None:
    """Slow is not wrong: a note past ``--startup-after``, a warning past twice that and two
    minutes (``WORKING_WARN_S``), whatever the threshold."""
    state = state_of(starting(0, "rendezvous", since, 2), importing(1, since, 2))
    alert = only(rule_startup_hang(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks) == (severity, (1,))


def test_a_starting_rank_whose_cpu_stopped_is_named_as_before() -> None:
    state = state_of(starting(0, "rendezvous", 20, 2), importing(1, 20, 2, cpu_grew=15))
    alert = only(rule_startup_hang(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (1,), (0,))
    assert (
        alert.message
        == "rank 1 is still in 'starting' after 20.0 s while rank 0 waits in 'rendezvous'"
    )


def test_a_rank_that_never_started_is_still_named_beside_one_starting() -> None:
    state = state_of(starting(0, "rendezvous", 6.2, 3), importing(1, 5.9))
    alert = only(rule_startup_hang(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (2,), (0,))
    assert alert.message == (
        "rank 2 never connected while rank 0 has waited in 'rendezvous' for 6.2 s; "
        "rank 1 is still starting after 5.9 s, its CPU time growing"
    )


def test_ranks_with_no_process_and_no_hello_are_never_connected() -> None:
    state = state_of(starting(0, "rendezvous", 6.2, 3, first_seen=NOW - 6.5))
    alert = only(diagnose(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (1, 2), (0,))
    assert alert.message == (
        "ranks 1, 2 never connected while rank 0 has waited in 'rendezvous' for 6.2 s"
    )


def test_every_rank_slow_in_one_phase_names_no_culprit() -> None:
    """Issue #32: "ranks 0-2 are still in 'model_wrap' after 6.2 s": every rank slow
    together, named as culprits."""
    state = state_of(*(starting(r, "model_wrap", 6.2 + r / 10, 3) for r in range(3)))
    alert = only(diagnose(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("warning", (), ())
    assert alert.message == (
        "all 3 ranks have been in 'model_wrap' for 6.2 s: slow start-up on every rank, "
        "no rank holds the others"
    )
    alert.to_dict()  # a valid alert with no culprit


def test_a_job_wide_slow_phase_stays_a_warning() -> None:
    state = state_of(*(starting(r, "model_wrap", 130, 3) for r in range(3)))
    alert = only(rule_startup_hang(state, NOW, TH), "startup_hang")
    assert (alert.severity, alert.ranks) == ("warning", ())


def test_a_job_wide_phase_with_a_silent_rank_still_names_ranks() -> None:
    """Not every rank is there (one went quiet): the job-wide wording does not apply."""
    state = state_of(
        *(starting(r, "model_wrap", 70, 3) for r in range(2)),
        starting(2, "model_wrap", 70, 3, last_seen=NOW - 30),
    )
    alert = only(rule_startup_hang(state, NOW, TH), "startup_hang")
    assert alert.ranks == (0, 1)


# ------------------------------------------- a slow phase past init_process_group is no hang (#32)


def initializing(r: int, since: float, world: int = 3, **changes: Any) -> RankRecord:
    """A rank ``since`` s in DeepSpeed's initialize, its CPU time growing at 0.3 s a second
    (a loaded machine), its last mark half a second ago: working."""
    fields: dict[str, Any] = {"cpu_s": 9.0, "cpu_grew_at": NOW - 0.5, "cpu_rate": 0.3}
    return starting(r, "deepspeed_init", since, world, **{**fields, **changes})


def through(r: int = 2, waited: float = 5.0, world: int = 3) -> RankRecord:
    """A rank through DeepSpeed's initialize first, waiting in 'backward' (its gradients'
    all-reduce, before its first step) for the ranks still in it."""
    return starting(r, "backward", waited, world, **waiting_in("all_reduce", 1, waited))


def test_ranks_working_in_deepspeed_init_are_a_note_not_a_hang() -> None:
    """Issue #32: "ranks 0, 1 are still in 'deepspeed_init' after 17.4 s while rank 2 waits in
    'backward'" raised as an error on a loaded machine at --startup-after 6, while ranks 0
    and 1 worked (DeepSpeed's initialize is slow under load) and rank 2, through first,
    waited for them in backward's all-reduce."""
    state = state_of(initializing(0, 17.4), initializing(1, 17.2), through(2, 5.0))
    alerts = diagnose(state, NOW, LOADED)
    note = only(alerts, "startup_hang")
    assert (note.severity, note.ranks, note.waiting) == ("info", (0, 1), (2,))
    assert note.message == (
        "ranks 0, 1 are still in 'deepspeed_init' after 17.4 s, their CPU time growing "
        "(working, not hung) while rank 2 has waited in 'backward' for 5.0 s"
    )
    assert note.hint.startswith("nothing to do while their CPU time grows: 'deepspeed_init'")
    # nor a straggler's error: rank 2's all-reduce waits for their start-up, which works
    assert not [a for a in alerts if a.severity in ("warning", "error") and a.ranks], alerts


def test_ranks_whose_cpu_time_stopped_in_deepspeed_init_are_named() -> None:
    """The same ranks, their CPU time flat for 12 s (past the tight 6 s start-up threshold):
    hung in DeepSpeed's initialize (a collective that a rank blocks in, a deadlock), named
    with an error; rank 2, waiting for them, is a victim."""
    flat = {"cpu_grew_at": NOW - 12.0, "cpu_rate": 0.3}
    state = state_of(initializing(0, 17.4, **flat), initializing(1, 17.2, **flat), through(2))
    alert = only(diagnose(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (0, 1), (2,))
    assert alert.message == (
        "ranks 0, 1 are still in 'deepspeed_init' after 17.4 s while rank 2 waits in 'backward'"
    )


def test_ranks_hung_in_deepspeed_init_are_still_stragglers() -> None:
    """Their CPU time flat, the ranks rank 2 waits for in its all-reduce are named by
    ``straggler`` as before, beside ``startup_hang``."""
    flat = {"cpu_grew_at": NOW - 12.0}
    state = state_of(initializing(0, 17.4, **flat), initializing(1, 17.2, **flat), through(2))
    straggler = only(diagnose(state, NOW, LOADED), "straggler")
    assert (straggler.severity, straggler.ranks, straggler.waiting) == ("error", (0, 1), (2,))


def test_of_the_stragglers_only_the_hung_one_is_named() -> None:
    """Rank 2 waits for ranks 0 and 1; rank 0's CPU time is flat, rank 1 still works: the
    straggler alert names rank 0 alone, as ``startup_hang`` does."""
    flat = {"cpu_grew_at": NOW - 12.0}
    state = state_of(initializing(0, 17.4, **flat), initializing(1, 17.2), through(2))
    straggler = only(diagnose(state, NOW, LOADED), "straggler")
    assert (straggler.severity, straggler.ranks, straggler.waiting) == ("error", (0,), (2,))
    assert straggler.message.startswith("rank 0 has not entered all_reduce #1"), straggler


def test_an_idle_agents_own_cpu_time_is_no_work() -> None:
    """An attached rank that sleeps or waits still uses ~6 ms of CPU a second (its agent's
    threads): a 0.1 s mark every ~17 s, the last one just now. That rate is no work."""
    idle = {"cpu_grew_at": NOW - 0.3, "cpu_rate": 0.006}
    state = state_of(initializing(0, 17.4, **idle), initializing(1, 17.2), through(2))
    alert = only(rule_startup_hang(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (0,), (2,))


def test_only_the_hung_rank_is_named_beside_one_that_works() -> None:
    flat = {"cpu_grew_at": NOW - 12.0}
    state = state_of(initializing(0, 17.4, **flat), initializing(1, 17.2), through(2))
    alert = only(rule_startup_hang(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (0,), (2,))
    assert alert.message == (
        "rank 0 is still in 'deepspeed_init' after 17.4 s while rank 2 waits in 'backward'; "
        "rank 1 is still in 'deepspeed_init' after 17.2 s, its CPU time growing (working, not "
        "hung)"
    )


def test_a_rank_inside_a_collective_is_waiting_however_its_cpu_time_grows() -> None:
    """A rank blocked in a collective can burn CPU (a spinning GPU sync): not work."""
    spinning = waiting_in("broadcast", 3, 10.0)
    state = state_of(initializing(0, 17.4, **spinning), initializing(1, 17.2), through(2))
    assert not still_working(state.ranks[0], NOW)
    alert = only(rule_startup_hang(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks) == ("error", (0,))


def test_a_long_working_phase_warns_only_after_two_minutes() -> None:
    state = state_of(initializing(0, 130), initializing(1, 130), through(2, 60.0))
    alert = only(rule_startup_hang(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("warning", (0, 1), (2,))


def test_every_rank_working_in_one_phase_is_a_note() -> None:
    state = state_of(*(initializing(r, 17.4) for r in range(3)))
    alert = only(rule_startup_hang(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("info", (), ())


def test_cpu_time_is_judged_at_the_last_heartbeat() -> None:
    """A rank working at its last heartbeat, then quiet for 8 s (a starved heartbeat thread
    on a loaded machine): no evidence that it stopped, so not named hung (``silent`` is the
    rule for a rank that does not report)."""
    quiet = {"cpu_grew_at": NOW - 8.2, "sample_seen": NOW - 8.0, "last_seen": NOW - 8.0}
    state = state_of(initializing(0, 17.4, **quiet), initializing(1, 17.2), through(2))
    assert cpu_growing(state.ranks[0], NOW)
    alert = only(rule_startup_hang(state, NOW, LOADED), "startup_hang")
    assert (alert.severity, alert.ranks) == ("info", (0, 1))


@pytest.mark.parametrize(
    ("per_beat", "growing"),
    [
        (0.003, False),  # an attached agent on a rank that sleeps: ~6 ms a second
        (0.01, False),  # three times that (NVML, a stack each beat)
        (0.15, True),  # a rank at 0.3 of a core: a loaded machine
    ],
)
def test_the_rate_of_cpu_time_from_heartbeats(per_beat: float, growing: bool) -> None:
    """Through ``ServerState.apply``: a heartbeat every 0.5 s for a minute, CPU time growing
    by ``per_beat`` each; judged at every beat once two marks could have come."""
    state = ServerState(started=0.0)
    seen = set()
    for beat in range(120):
        now = 1.0 + beat * 0.5
        sample = Sample(
            v=1, rank=0, t=0.0, pid=7, phase="deepspeed_init", cpu_s=2.0 + beat * per_beat
        )
        state.apply(sample, now)
        if beat >= 4:
            seen.add(cpu_growing(state.ranks[0], now))
    assert seen == {growing}


def test_a_rank_that_stops_working_reads_as_stopped_within_three_seconds() -> None:
    """Lightning's rank 1 asleep in ``setup`` (tests/integrations): 3.5 s into its sleep, the
    rate of its last two marks was still high; the window since its last mark tells."""
    state = ServerState(started=0.0)

    def beat(now: float, cpu: float) -> bool:
        state.apply(Sample(v=1, rank=1, t=0.0, pid=7, phase="setup", cpu_s=cpu), now)
        return cpu_growing(state.ranks[1], now)

    stopped = 10.0  # 10 s of work at 0.3 of a core, one beat every 0.5 s
    assert [beat(i / 2, 2.0 + 0.15 * i) for i in range(21)][2:] == [True] * 19
    cpu = 2.0 + 0.15 * 20
    for i in range(1, 41):  # then asleep: the agent's own ~6 ms a second
        assert beat(stopped + i / 2, cpu + 0.003 * i) == (i / 2 <= 2.5), i / 2
