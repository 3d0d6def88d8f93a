"""Attribution: a rank is named for collective #N only on its own evidence.

Each rank's heartbeat carries how many collectives it has entered (the flight recorder's
per-group sequence and the agent's Python-level count). These tests feed real protocol
messages through ``ServerState.apply`` at chosen server times, the way the collector does,
and check who diagnosis names, including in the races that used to blame a rank that had
already passed the collective (a barrier released while the waiters' heartbeats were still
in flight).
"""

from __future__ import annotations

from typing import Any

import pytest

from ddpwatch.core.protocol import Collective, CollectiveCounts, ErrorInfo, Event, Sample
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.ranks import rank_state
from ddpwatch.diagnosis.rules import diagnose
from ddpwatch.server.document import status_document
from ddpwatch.state.state import ServerState

NOW = 50_000.0
TH = Thresholds()

LOADER_STACK = """\
  File "/home/ann/train.py", line 40, in main
    for batch in loader:
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 733, in __next__
    data = self._next_data()
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1480, in _next_data
    idx, data = self._get_data()
  File "/usr/lib/python3.11/multiprocessing/connection.py", line 440, in _poll
    r = wait([self], timeout)
"""


def beat(rank: int, step: int = 100, world: int = 3, **fields: Any) -> Sample:
    return Sample(
        v=1,
        rank=rank,
        t=0.0,
        world_size=world,
        local_rank=rank,
        host="node0",
        pid=100 + rank,
        step=step,
        step_time_s=0.05,
        avg_step_time_s=0.05,
        **fields,
    )


def counts(py: int, fr: int | None = None, **groups: int) -> CollectiveCounts:
    return CollectiveCounts(py=py, fr=None if fr is None else {"0": fr, **groups})


def in_barrier(seq: int, since: float, source: str = "py", **extra: Any) -> Collective:
    return Collective(op="barrier", seq=seq, since_s=since, source=source, **extra)


def feed(state: ServerState, at: float, *messages: Sample | Event) -> None:
    for message in messages:
        state.apply(message, at)


def alerts_at(state: ServerState, at: float) -> list[Alert]:
    return diagnose(state, at, TH)


def named(alerts: list[Alert]) -> set[int]:
    return {rank for alert in alerts for rank in alert.ranks}


def test_the_rank_that_has_not_entered_is_named_and_the_one_that_passed_never_is() -> None:
    """A barrier released while rank 0's heartbeat still says it waits: rank 2 has passed
    barrier #57 (its count says so) and must not be named; rank 1, asleep before it, is."""
    state = ServerState(started=NOW - 100)
    feed(
        state,
        NOW - 0.3,
        beat(0, collective=in_barrier(57, 19.7), collectives=counts(57)),
        beat(1, collectives=counts(56)),  # asleep before the barrier
        beat(2, step=101, collectives=counts(58)),  # released, already one further
    )
    alerts = alerts_at(state, NOW)
    straggler = [a for a in alerts if a.kind == "straggler"]
    assert [(a.ranks, a.waiting) for a in straggler] == [((1,), (0,))]
    assert named(alerts) == {1}

    # rank 1 wakes up and enters #57: nobody is named while rank 0's last beat is stale
    feed(state, NOW + 0.2, beat(1, collectives=counts(57)))
    assert named(alerts_at(state, NOW + 0.3)) == set()


def test_a_report_older_than_the_collective_names_nobody_until_fresh_data_arrives() -> None:
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 10.0, beat(1, collectives=counts(56)))  # last heard before #57 began
    feed(
        state,
        NOW - 0.2,
        beat(0, collective=in_barrier(57, 3.0), collectives=counts(57)),
        beat(2, collective=in_barrier(57, 3.0), collectives=counts(57)),
    )
    th = Thresholds(silent_after=30.0)  # rank 1 still counts as live, only its news is old
    assert [a for a in diagnose(state, NOW, th) if a.kind == "straggler"] == []
    feed(state, NOW, beat(1, collectives=counts(56)))  # fresh: still has not entered it
    straggler = [a for a in diagnose(state, NOW + 0.1, th) if a.kind == "straggler"]
    assert [a.ranks for a in straggler] == [(1,)]


def test_flight_recorder_sequence_is_compared_per_group() -> None:
    """DDP's own all-reduce is seen only by the flight recorder: its per-group number decides,
    and a rank that is not in the waiters' group is never named."""
    state = ServerState(started=NOW - 100, ranks={})
    waiting = Collective(op="allreduce", seq=171, since_s=5.0, source="fr", group="0")
    feed(
        state,
        NOW - 0.2,
        beat(0, collective=waiting, collectives=counts(40, 171)),
        beat(1, collectives=counts(40, 170)),  # in forward: has not enqueued #171
        beat(2, collective=waiting, collectives=counts(40, 171)),
    )
    found = Facts(state, NOW, TH).straggle
    assert found is not None and [r.rank for r in found.culprits] == [1]

    other_group = Collective(op="allreduce", seq=9, since_s=5.0, source="fr", group="5")
    feed(
        state,
        NOW - 0.1,
        beat(0, collective=other_group, collectives=counts(40, 171, **{"5": 9})),
        beat(1, collectives=counts(40, 171)),  # not a member of group 5
        beat(2, collective=other_group, collectives=counts(40, 171, **{"5": 9})),
    )
    found = Facts(state, NOW, TH).straggle
    assert found is not None and found.culprits == []


def test_publishers_without_counts_keep_the_step_based_reading() -> None:
    state = ServerState(started=NOW - 100)
    feed(
        state,
        NOW - 0.2,
        beat(0, collective=Collective(op="all_reduce", seq=12, since_s=4.0)),
        beat(1),
        beat(2, collective=Collective(op="all_reduce", seq=12, since_s=4.0)),
    )
    straggler = [a for a in alerts_at(state, NOW) if a.kind == "straggler"]
    assert [(a.ranks, a.waiting) for a in straggler] == [((1,), (0, 2))]


def test_busy_rank_zero_says_when_the_others_time_out() -> None:
    """Rank 0 saves a checkpoint alone while ranks 1 and 2 wait in a barrier."""
    state = ServerState(started=NOW - 100)
    feed(
        state,
        NOW - 0.2,
        beat(0, phase="checkpoint", collectives=counts(9)),
        beat(1, collective=in_barrier(10, 360.0), collectives=counts(10), pg_timeout_s=1800.0),
        beat(2, collective=in_barrier(10, 360.0), collectives=counts(10), pg_timeout_s=1800.0),
    )
    alert = next(a for a in alerts_at(state, NOW) if a.kind == "straggler")
    assert alert.ranks == (0,) and alert.waiting == (1, 2)
    assert "in 'checkpoint'" in alert.message
    assert "ranks 1, 2 will time out in 24 min" in alert.message
    assert "raise timeout= in init_process_group" in alert.hint


GLOO_RECV_TIMEOUT = ErrorInfo(
    type="RuntimeError",
    message="[../third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:78] Timed out waiting "
    "8000ms for recv operation to complete",
)


def timed_out(rank: int, place: Collective) -> Event:
    return Event(
        v=1, rank=rank, t=0.0, event="crash", error=GLOO_RECV_TIMEOUT, collective=place, step=20
    )


def _checkpoint_timeout(
    place: Collective, done: int, stale: Collective | None = None, **groups: int
) -> ServerState:
    """LLaMA-Factory #2424: rank 0 saves alone (its counts say it has not entered ``place``)
    until ranks 1 and 2 time out in it after 8 s; ``stale``: the collective before ``place``
    that rank 0's heartbeats still show in flight (gloo's flight recorder, seen under load)."""
    state = ServerState(started=NOW - 100)
    mine = {"pg_timeout_s": 8.0, "step": 20}
    extra = {"collective": stale} if stale is not None else {}
    for at in (NOW - 8.0, NOW - 4.0, NOW - 0.6):
        feed(
            state,
            at,
            beat(0, phase="checkpoint", collectives=counts(done, done, **groups), **mine, **extra),
            beat(1, collective=place, collectives=counts(done + 1, done + 1, **groups), **mine),
            beat(2, collective=place, collectives=counts(done + 1, done + 1, **groups), **mine),
        )
    feed(state, NOW - 0.1, timed_out(1, place), timed_out(2, place))
    return state


@pytest.mark.parametrize(
    "place",
    [
        in_barrier(46, 8.0),  # the others' barrier (a Python collective)
        Collective(op="gloo:all_reduce", seq=46, since_s=8.0, source="fr", group="0"),  # DDP's
    ],
    ids=["barrier", "ddp-allreduce"],
)
def test_a_timeout_keeps_the_blame_on_the_rank_it_waited_for(place: Collective) -> None:
    """The victims' timeouts ("Timed out waiting 8000ms for recv") are the consequence: the
    alert stays a straggler alert on rank 0, then and once torchrun has stopped it."""
    state = _checkpoint_timeout(place, 45)
    (alert,) = [a for a in alerts_at(state, NOW) if a.severity == "error"]
    assert (alert.kind, alert.ranks, alert.waiting) == ("straggler", (0,), (1, 2))
    assert alert.message.startswith("ranks 1, 2 timed out after 8.0 s in "), alert.message
    assert "waiting for rank 0, which had not entered it: in 'checkpoint' at step 20" in (
        alert.message
    )
    assert "the timeout is the consequence" in alert.hint
    feed(state, NOW + 1.0, Event(v=1, rank=0, t=0.0, event="exit", signal="SIGTERM", exit_code=-15))
    later = alerts_at(state, NOW + 2.0)
    assert [(a.kind, a.ranks, a.waiting) for a in later] == [("straggler", (0,), (1, 2))]
    assert "it was stopped after them" in later[0].message


def test_a_timeout_keeps_the_blame_where_the_rank_still_shows_the_collective_before() -> None:
    """Measured in a loaded full run (``rank0-checkpoint-timeout --no-barrier``): rank 0, in
    its checkpoint, still showed DDP's all-reduce #45 in flight (gloo's flight recorder lags),
    which the others had long passed. A collective behind the one they timed out in holds
    nobody: rank 0 is the one they waited for, named while it lives, not "ranks 1, 2
    crashed"."""
    place = Collective(op="gloo:all_reduce", seq=46, since_s=8.0, source="fr", group="0")
    stale = Collective(op="gloo:all_reduce", seq=45, since_s=7.9, source="fr", group="0")
    state = _checkpoint_timeout(place, 45, stale=stale)
    errors = [a for a in alerts_at(state, NOW) if a.severity == "error"]
    assert [(a.kind, a.ranks, a.waiting) for a in errors] == [("straggler", (0,), (1, 2))], [
        a.message for a in errors
    ]


PEER_GONE = ErrorInfo(
    type="RuntimeError",
    message="[../third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by peer "
    "[127.0.0.1]:61125",
)


@pytest.mark.parametrize(
    "beat_inside", [None, "checkpoint", "data"], ids=["crash-only", "beat-then-crash", "moved-on"]
)
def test_the_rank_waited_for_that_enters_after_the_timeouts_and_fails_keeps_the_blame(
    beat_inside: str | None,
) -> None:
    """The same, where torchrun is slow to stop rank 0 (on a loaded machine it took 9 s):
    rank 0 ends its checkpoint, enters the barrier its peers timed out in, and fails there
    ("Connection closed by peer"). It entered after they gave up: still the one they waited
    for, not a rank that crashed on its own and left ranks 1, 2 to blame. Where it said a
    phase of its next step meanwhile ('data', seen under load), the alert still says where it
    was when they gave up: the verdict had "kept ranks 1, 2 waiting in 'data'"."""
    place = in_barrier(46, 8.0)
    state = _checkpoint_timeout(place, 45)
    inside = Collective(op=place.op, seq=46, since_s=0.05, source=place.source, group=place.group)
    if beat_inside is not None:
        moved = beat(0, phase=beat_inside, collective=inside, collectives=counts(46, 46), step=20)
        feed(state, NOW + 4.9, moved)
    crash = Event(v=1, rank=0, t=0.0, event="crash", error=PEER_GONE, collective=inside, step=20)
    feed(state, NOW + 5.0, crash)
    errors = [a for a in alerts_at(state, NOW + 5.5) if a.severity == "error"]
    assert [(a.kind, a.ranks, a.waiting) for a in errors] == [("straggler", (0,), (1, 2))], [
        a.message for a in errors
    ]
    assert errors[0].phase == "checkpoint"
    assert "waiting for rank 0, which had not entered it: in 'checkpoint' at step 20" in (
        errors[0].message
    )


def test_a_timeout_in_a_subgroup_blames_the_member_that_had_not_entered_it() -> None:
    """Group "1" holds ranks 0, 2 only: rank 1's count for it is absent, so it is not named."""
    place = Collective(op="gloo:all_reduce", seq=7, since_s=8.0, source="fr", group="1")
    state = ServerState(started=NOW - 100)
    mine = {"pg_timeout_s": 8.0, "step": 20}
    for at in (NOW - 8.0, NOW - 0.6):
        feed(
            state,
            at,
            beat(0, collective=place, collectives=counts(30, 30, **{"1": 7}), **mine),
            beat(1, phase="train", collectives=counts(30, 30), **mine),
            beat(2, phase="data", collectives=counts(30, 30, **{"1": 6}), **mine),
        )
    feed(state, NOW - 0.1, timed_out(0, place))
    errors = [a for a in alerts_at(state, NOW) if a.severity == "error"]
    assert [(a.kind, a.ranks) for a in errors] == [("straggler", (2,))]
    assert errors[0].message.startswith("rank 0 timed out after 8.0 s in gloo:all_reduce #7")


def _subgroup_cascade(at: float) -> ServerState:
    """PyTorch #130102's shape: rank 2 reads slowly; rank 0 waits for it in all_reduce #1 of
    subgroup "1" (ranks 0, 2); rank 1 waits for rank 0 in the world's all_reduce #46."""
    pair = Collective(op="all_reduce[pg 1]", seq=1, since_s=5.0, source="fr", group="1")
    world = Collective(op="all_reduce", seq=46, since_s=4.9, source="fr", group="0")
    state = ServerState(started=NOW - 100)
    feed(
        state,
        at,
        beat(0, step=20, collective=pair, collectives=counts(20, 45, **{"1": 1})),
        beat(1, step=20, collective=world, collectives=counts(21, 46)),
        beat(2, step=20, phase="data", collectives=counts(20, 45, **{"1": 0})),
    )
    return state


def test_a_rank_blocked_in_a_subgroup_is_a_victim_and_the_chain_names_the_culprit() -> None:
    """Rank 0 has not entered the world's all_reduce, but it waits in the subgroup for rank 2:
    a victim. Rank 2, in no collective, is the culprit, whichever collective is read first;
    rank 1, not in the subgroup, is never named for it."""
    state = _subgroup_cascade(NOW - 0.2)
    (alert,) = [a for a in alerts_at(state, NOW) if a.kind == "straggler"]
    assert (alert.ranks, alert.waiting) == ((2,), (0, 1)), alert.message
    assert "rank 0 waits in all_reduce[pg 1] #1 for rank 2" in alert.message, alert.message
    assert "rank 2 is in 'data' at step 20" in alert.message


def test_a_rank_just_released_from_a_wait_is_not_named_for_the_next_collective() -> None:
    """Rank 2 entered the subgroup's collective at last; rank 0, released, heads for the
    world's all_reduce #46 that rank 1 waits in. Its report that it has not entered #46,
    from the moment of its release, names nobody for 1.5 s; a later one would."""
    state = _subgroup_cascade(NOW - 6.0)
    world = Collective(op="all_reduce", seq=46, since_s=10.0, source="fr", group="0")
    feed(
        state,
        NOW - 0.1,
        beat(0, step=20, collectives=counts(20, 45, **{"1": 1})),
        beat(1, step=20, collective=world, collectives=counts(21, 46)),
        beat(2, step=20, collectives=counts(20, 45, **{"1": 1})),
    )
    culprits = named([a for a in alerts_at(state, NOW) if a.kind == "straggler"])
    assert 0 not in culprits
    feed(state, NOW + 1.9, beat(0, step=20, collectives=counts(20, 45, **{"1": 1})))
    assert 0 in named([a for a in alerts_at(state, NOW + 2.0) if a.kind == "straggler"])


def test_timeouts_in_different_collectives_name_no_rank_they_waited_for() -> None:
    """Ambiguous evidence (rank 1 timed out in barrier #46, rank 2 in #47): the timeouts
    stay as they are rather than a guess."""
    state = _checkpoint_timeout(in_barrier(46, 8.0), 45)
    state.ranks[2].final_collective = in_barrier(47, 8.0)
    assert 0 not in named(alerts_at(state, NOW))


def test_a_rank_waiting_for_its_dataloader_is_named_with_data_loading_as_the_cause() -> None:
    state = ServerState(started=NOW - 100)
    feed(
        state,
        NOW - 0.2,
        beat(0, collective=in_barrier(30, 6.0), collectives=counts(30)),
        beat(1, collectives=counts(29)),
        beat(2, collective=in_barrier(30, 6.0), collectives=counts(30)),
        Event(v=1, rank=1, t=0.0, event="stack", stack=LOADER_STACK),
    )
    alert = next(a for a in alerts_at(state, NOW) if a.kind == "straggler")
    assert alert.ranks == (1,)
    assert "waiting for its DataLoader" in alert.message and "train.py:40" in alert.message
    assert alert.hint.startswith("data loading:")


def test_a_dead_rank_keeps_its_last_collective_but_no_live_timer() -> None:
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 5, beat(1, collective=in_barrier(68, 1.0), collectives=counts(68)))
    feed(state, NOW - 4, Event(v=1, rank=1, t=0.0, event="exit", exit_code=3))
    record = state.ranks[1]
    assert record.collective is None and record.collective_age(NOW) is None
    assert record.final_collective is not None and record.final_collective.seq == 68
    entry = status_document(state, [], NOW, TH).ranks[1]
    assert entry.state == "exited" and entry.collective is None and entry.exit_code == 3


def test_a_rank_stopped_by_the_launcher_is_stopped_not_exited() -> None:
    state = ServerState(started=NOW - 100)
    feed(
        state,
        NOW - 5,
        beat(0, step=50),
        beat(1, step=49),
        beat(2, step=50),
        Event(v=1, rank=1, t=0.0, event="exit", exit_code=3, step=50),
        Event(v=1, rank=0, t=0.0, event="exit", signal="SIGTERM", exit_code=-15),
        Event(
            v=1,
            rank=2,
            t=0.0,
            event="crash",
            error=ErrorInfo(
                type="RuntimeError",
                message="[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Connection closed "
                "by peer [127.0.0.1]:41234",
            ),
        ),
    )
    states = {r.rank: rank_state(r, NOW, TH, 10.0) for r in state.ranks.values()}
    assert states == {0: "stopped", 1: "exited", 2: "crashed"}
    alerts = alerts_at(state, NOW)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("exited", (1,), (0, 2))]
    message = alerts[0].message
    assert "rank 1 exited with code 3" in message and "step 50" in message
    assert "rank 2 failed because of it" in message
    assert "rank 0 was stopped by the launcher after it" in message


# --------------------------------------------------------------------------- the agent's evidence


def test_wrappers_count_default_group_collectives_and_keep_what_failed() -> None:
    """The agent's side of the evidence, on a real one-rank gloo group: the count, the
    contributed shape and dtype, subgroups left uncounted, and the collective an exception
    left (what a crash event reports)."""
    import torch
    import torch.distributed as dist

    from ddpwatch.agent.collectives import CollectiveWrappers
    from ddpwatch.agent.progress import Progress
    from ddpwatch.core.ports import free_port_pair

    progress = Progress()
    wrappers = CollectiveWrappers(progress)
    port = free_port_pair()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    wrappers.install(dist)
    try:
        dist.all_reduce(torch.ones(3, 2))
        dist.all_gather([torch.zeros(5)], torch.ones(5))
        dist.barrier(group=dist.group.WORLD)
        assert progress.collective_seq == 3
        subgroup = dist.new_group([0])
        dist.all_reduce(torch.ones(1), group=subgroup)
        assert progress.collective_seq == 3  # another group's numbers do not compare

        progress.enter_collective("all_gather", torch.ones(4, dtype=torch.float16))
        seen = progress.in_flight()
        progress.exit_collective()
        assert seen is not None
        assert (seen.op, seen.seq, seen.source, seen.shape, seen.dtype) == (
            "all_gather", 4, "py", [4], "float16"
        )  # fmt: skip
        with pytest.raises(RuntimeError):
            dist.all_gather([torch.zeros(2)], torch.ones(3))  # sizes that cannot match
        failed = progress.failed_collective
        assert failed is not None and (failed.op, failed.seq, failed.shape) == (
            "all_gather",
            5,
            [3],
        )
        assert progress.collective_op is None and progress.collective_depth == 0

    finally:
        wrappers.restore(dist)
        dist.destroy_process_group()


def test_enqueued_counts_read_every_group_and_skip_what_is_unreadable() -> None:
    from ddpwatch.agent.collectives import enqueued_counts

    status = {
        "0": {"last_enqueued_collective": "171", "last_completed_collective": "170"},
        "5": {"last_enqueued_collective": 9},
        "7": {"last_enqueued_collective": "x"},
        "8": None,
    }
    assert enqueued_counts(status) == {"0": 171, "5": 9}
    # groups this rank is in that the recorder does not list yet: none enqueued there
    assert enqueued_counts(status, ["0", "5", "6"]) == {"0": 171, "5": 9, "6": 0}


def test_member_groups_name_the_groups_of_this_rank_as_the_recorder_does(port: int) -> None:
    """torch keeps no group for a rank outside it; the recorder names groups the same way."""
    import torch.distributed as dist

    from ddpwatch.agent.collectives import member_groups

    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1
    )
    try:
        dist.new_group([0])
        assert member_groups() == ["0", "1"]
    finally:
        dist.destroy_process_group()
    assert member_groups() == []


# --------------------------------------------------------------------------- mismatches


GLOO_SIZE_ERROR = ErrorInfo(
    type="RuntimeError",
    message="[../third_party/gloo/gloo/transport/tcp/pair.cc:...] invalid tensor size at "
    "index 0 (expected (8), got (4))",  # the error text quoted in the issue
)


def gathered(numel: int, seq: int = 40) -> Collective:
    return Collective(op="all_gather", seq=seq, source="py", shape=[numel], dtype="float32")


def test_size_mismatch_names_the_odd_rank_even_when_its_peers_raised_the_error() -> None:
    """Rank 2 passes 5 elements to all_gather where ranks 0 and 1 pass 4. The ranks that
    receive its data raise the size error; rank 2 is the odd one out all the same."""
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 2, beat(0), beat(1), beat(2))
    for rank, numel in ((0, 4), (1, 4)):
        crash = Event(
            v=1, rank=rank, t=0.0, event="crash", error=GLOO_SIZE_ERROR, collective=gathered(numel)
        )
        feed(state, NOW - 1.5, crash)
    feed(
        state,
        NOW - 1.4,
        Event(v=1, rank=2, t=0.0, event="exit", signal="SIGTERM", exit_code=-15,
              collective=gathered(5)),
    )  # fmt: skip
    alerts = alerts_at(state, NOW)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("collective_mismatch", (2,), (0, 1))]
    message = alerts[0].message
    assert "rank 2 called all_gather with 5 elements (float32) at collective #40" in message
    assert "ranks 0, 1 called all_gather with 4 elements (float32)" in message


def test_live_op_mismatch_uses_one_counter_only() -> None:
    """Rank 0 reduces a metric that ranks 1 and 2 never reduce: at Python collective #12 it
    is in all_reduce while they are in barrier. A flight-recorder #12 is another collective."""
    state = ServerState(started=NOW - 100)
    reduce = Collective(op="all_reduce", seq=12, since_s=3.0, source="py", shape=[1])
    barrier = Collective(op="barrier", seq=12, since_s=3.0, source="py")
    feed(
        state,
        NOW - 0.2,
        beat(0, collective=reduce, collectives=counts(12)),
        beat(1, collective=barrier, collectives=counts(12)),
        beat(2, collective=barrier, collectives=counts(12)),
    )
    alerts = alerts_at(state, NOW)
    mismatch = [a for a in alerts if a.kind == "collective_mismatch"]
    assert [(a.ranks, a.waiting) for a in mismatch] == [((0,), (1, 2))]
    assert "rank 0 called all_reduce at collective #12 where ranks 1, 2 called barrier" in (
        mismatch[0].message
    )
    assert named(alerts) == {0}

    # rank 1 now reports a flight-recorder #12: not comparable, so ranks 0 and 2 tie
    other = Collective(op="allreduce", seq=12, since_s=3.0, source="fr", group="0")
    feed(state, NOW, beat(1, collective=other, collectives=counts(12, 12)))
    assert named(alerts_at(state, NOW + 0.1)) == set()


def test_a_tie_names_no_culprit() -> None:
    state = ServerState(started=NOW - 100, ranks={})
    feed(
        state,
        NOW - 0.2,
        beat(0, world=2, collective=Collective(op="broadcast", seq=3, since_s=4.0, source="py",
                                               shape=[8], dtype="float32")),
        beat(1, world=2, collective=Collective(op="broadcast", seq=3, since_s=4.0, source="py",
                                               shape=[6], dtype="float32")),
    )  # fmt: skip
    alerts = [a for a in alerts_at(state, NOW) if a.kind == "collective_mismatch"]
    assert [(a.ranks, a.waiting) for a in alerts] == [((), (0, 1))]
    assert "different calls at collective #3" in alerts[0].message


def test_a_mismatch_error_without_calls_to_compare_names_no_rank() -> None:
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 2, beat(0), beat(1), beat(2))
    error = ErrorInfo(
        type="RuntimeError",
        message="Received data size doesn't match expected size. Is there a distributed "
        "collective mismatch?",
    )
    feed(state, NOW - 1, Event(v=1, rank=0, t=0.0, event="crash", error=error))
    alerts = alerts_at(state, NOW)
    assert [(a.kind, a.ranks) for a in alerts] == [("collective_mismatch", ())]


def test_a_rendezvous_timeout_blames_the_rank_that_never_came_not_the_host_that_waited() -> None:
    """torchrun started 2 processes for a world of 3: rank 0's store gives up with "2/3
    clients joined". Rank 2 never came (it would run on a second node); rank 0 is a victim."""
    state = ServerState(started=NOW - 100)
    early = [
        beat(rank, world=3, phase="rendezvous", local_world_size=2, step=None) for rank in (0, 1)
    ]
    feed(state, NOW - 40, *early)
    timeout = ErrorInfo(
        type="torch.distributed.DistStoreError",
        message="Timed out after 31 seconds waiting for clients. 2/3 clients joined.",
    )
    feed(state, NOW - 5, Event(v=1, rank=0, t=0.0, event="crash", error=timeout))
    feed(state, NOW - 4, Event(v=1, rank=1, t=0.0, event="exit", signal="SIGTERM"))
    alerts = alerts_at(state, NOW)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("not_connected", (2,), (0, 1))]
    assert "(expected on node 1, 2 ranks per node)" in alerts[0].message


def test_a_rank_that_calls_an_extra_collective_is_named_before_anything_breaks() -> None:
    """Rank 0 all-reduces a metric only on itself at step 20 (Lightning `self.log(...,
    sync_dist=True)` under `if self.global_rank == 0`, as in Lightning-AI/pytorch-lightning
    issues about hangs with rank-zero-only logging): by the end of step 24 it has entered one
    collective more than the others, while every collective still completes."""
    state = ServerState(started=NOW - 100)
    for rank in range(3):
        extra = 1 if rank == 0 else 0
        marks = [(8, 16), (16, 32), (24, 48 + extra)]
        feed(
            state, NOW - 0.3, beat(rank, step=25, collectives=CollectiveCounts(py=50, marks=marks))
        )
    alerts = alerts_at(state, NOW)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("collective_mismatch", (0,), (1, 2))]
    assert "rank 0 had entered 1 more collective than ranks 1, 2 by the end of step 24" in (
        alerts[0].message
    )


def test_collective_counts_that_agree_or_tie_name_nobody() -> None:
    state = ServerState(started=NOW - 100)
    for rank in range(3):
        marks = [(8, 16), (16, 32)]
        feed(
            state, NOW - 0.3, beat(rank, step=17, collectives=CollectiveCounts(py=33, marks=marks))
        )
    assert alerts_at(state, NOW) == []
    tie = ServerState(started=NOW - 100)
    for rank in range(2):
        marks = [(8, 16 + rank)]
        feed(
            tie,
            NOW - 0.3,
            beat(rank, world=2, step=9, collectives=CollectiveCounts(py=18, marks=marks)),
        )
    assert alerts_at(tie, NOW) == []


def test_an_error_that_names_the_late_rank_blames_it_not_the_rank_that_raised_it() -> None:
    """monitored_barrier on rank 0 names rank 1 (text captured on torch 2.13 gloo by
    tests/scripts/error_texts.py)."""
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 3, beat(0), beat(1), beat(2))
    error = ErrorInfo(
        type="RuntimeError",
        message="[Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms",
    )
    feed(state, NOW - 2, Event(v=1, rank=0, t=0.0, event="crash", error=error))
    alerts = alerts_at(state, NOW)
    crashed = [a for a in alerts if a.kind == "crashed"]
    assert [(a.ranks, a.waiting) for a in crashed] == [((1,), (0,))]
    assert "rank 0 failed with RuntimeError" in crashed[0].message
    assert "naming rank 1" in crashed[0].message


def test_a_rank_aborted_by_gloo_during_a_size_mismatch_is_not_blamed() -> None:
    """Ranks size all_gather's outputs from their own input; rank 2 passes more. gloo aborts
    rank 0, which receives too much (SIGABRT: no report, it just falls silent), and the
    others lose their connection inside all_gather: 4 elements on rank 1, 5 on rank 2."""
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 5, beat(0), beat(1), beat(2))
    reset = ErrorInfo(
        type="RuntimeError",
        message="[../third_party/gloo/gloo/transport/tcp/pair.cc:534] Read error "
        "[127.0.0.1]:52110: Connection reset by peer",
    )
    for rank, numel in ((1, 4), (2, 5)):
        event = Event(
            v=1, rank=rank, t=0.0, event="crash", error=reset, collective=gathered(numel, 7)
        )
        feed(state, NOW - 4.9, event)
    alerts = alerts_at(state, NOW)  # rank 0 has been silent for 5 s
    assert named(alerts) == set(), alerts
    assert [a.kind for a in alerts] == ["collective_mismatch"]
    assert "ranks made different calls at collective #7" in alerts[0].message
    assert "rank 0's call is not known, so which side is odd cannot be told" in alerts[0].message


def test_detail_mismatch_texts_name_the_rank_most_reporters_name() -> None:
    """TORCH_DISTRIBUTED_DEBUG=DETAIL: the majority name the odd rank, the odd one names
    rank 0 (captured on torch 2.13 gloo)."""
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 3, beat(0), beat(1), beat(2))
    text = (
        "Detected mismatch between collectives on ranks. Rank {me} is running collective: "
        "CollectiveFingerPrint(SequenceNumber=3, OpType=ALLREDUCE), but Rank {other} is running "
        "collective: CollectiveFingerPrint(SequenceNumber=3, OpType=BROADCAST)."
    )
    for me, other in ((0, 2), (1, 2), (2, 0)):
        error = ErrorInfo(type="RuntimeError", message=text.format(me=me, other=other))
        feed(state, NOW - 2, Event(v=1, rank=me, t=0.0, event="crash", error=error))
    alerts = alerts_at(state, NOW)
    assert [(a.kind, a.ranks) for a in alerts] == [("collective_mismatch", (2,))]


def test_ranks_released_from_a_long_barrier_have_not_stalled() -> None:
    """Rank 1 slept 20 s before a barrier (the issue's false-blame report). When it releases,
    ranks 0 and 2 leave the barrier before their step count moves: they are not stalled."""
    state = ServerState(started=NOW - 100)
    for at in range(30, 0, -1):  # 20 s in the barrier, heartbeats every second
        feed(
            state,
            NOW - at,
            beat(0, step=20, collective=in_barrier(46, 20.0 - at), collectives=counts(46)),
            beat(1, step=20, collectives=counts(45)),
            beat(2, step=20, collective=in_barrier(46, 20.0 - at), collectives=counts(46)),
        )
    feed(state, NOW, *(beat(rank, step=20, collectives=counts(47)) for rank in range(3)))
    for later in (0.1, 1.0):
        assert alerts_at(state, NOW + later) == []
    assert {rank_state(r, NOW + 1, TH, 10.0) for r in state.ranks.values()} == {"running"}
    # no news at all afterwards: the whole job went quiet together, and nobody is blamed
    quiet = alerts_at(state, NOW + 3.0)
    assert [(a.kind, a.severity, a.ranks) for a in quiet] == [("silent", "warning", ())]


def test_slow_rank_needs_a_lasting_difference_not_one_noisy_step() -> None:
    state = ServerState(started=NOW - 100)
    for step in range(1, 40):
        waits = [0.02, 0.02, 0.02]
        if step == 39:
            waits[2] = 0.0  # one step where rank 2 happened to arrive last
        feed(
            state,
            NOW - (40 - step) * 0.05,
            *(beat(r, step=step, collective_time_s=w) for r, w in enumerate(waits)),
        )
    assert alerts_at(state, NOW) == []


def _stack(line: int) -> Event:
    """Rank 0's stack in its own validation loop: another line each beat while it works."""
    text = f'  File "/home/ann/train.py", line {line}, in validate\n    out = model(x)\n'
    return Event(v=1, rank=0, t=0.0, event="stack", stack=text)


def _solo_work(state: ServerState, start: float, seconds: float, moving: bool) -> None:
    """Rank 0 works alone from ``start`` (its stack moving or not) while ranks 1 and 2 wait
    in barrier #46 for it, heartbeats every 0.5 s."""
    t = start
    while t < start + seconds:
        waited = t - start
        feed(
            state,
            t,
            beat(0, step=40, collectives=counts(45)),
            beat(1, step=40, collective=in_barrier(46, waited), collectives=counts(46)),
            beat(2, step=40, collective=in_barrier(46, waited), collectives=counts(46)),
        )
        if waited >= 5.0:
            feed(state, t, _stack(60 + int(waited * 2) % 7 if moving else 60))
        t += 0.5


def test_a_rank_working_alone_is_busy_not_stalled_and_still_the_straggler() -> None:
    """Rank 0 evaluates alone for 14 s while the others wait in a barrier: it is ``busy``
    (its stack moves), the alert names it as the straggler and says it works, and no
    ``stalled`` alert calls it stuck."""
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 20, *(beat(r, step=40, collectives=counts(45)) for r in range(3)))
    _solo_work(state, NOW - 14, 14.0, moving=True)
    alerts = alerts_at(state, NOW)
    assert {a.kind for a in alerts} == {"straggler"}
    straggler = alerts[0]
    assert straggler.ranks == (0,) and straggler.waiting == (1, 2)
    assert "busy: its stack moves" in straggler.message
    document = status_document(state, alerts, NOW, TH)
    assert [r.state for r in document.ranks] == ["busy", "waiting", "waiting"]


def test_a_stuck_rank_shows_the_same_stack_and_is_stalled() -> None:
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 20, *(beat(r, step=40, collectives=counts(45)) for r in range(3)))
    _solo_work(state, NOW - 14, 14.0, moving=False)
    alerts = alerts_at(state, NOW)
    assert [(a.kind, a.ranks) for a in alerts] == [("straggler", (0,))]
    assert "busy" not in alerts[0].message
    document = status_document(state, alerts, NOW, TH)
    assert document.ranks[0].state == "stalled"


def test_peers_released_after_the_stragglers_last_report_do_not_make_it_stalled() -> None:
    """The straggler (stuck-looking: same stack) enters the barrier; ranks 1 and 2 are
    released and step on before its own next heartbeat: its last report says 12 s without
    progress, but their release says it has moved since. Named ``stalled`` only if its next
    heartbeat still shows no progress."""
    state = ServerState(started=NOW - 100)
    feed(state, NOW - 20, *(beat(r, step=40, collectives=counts(45)) for r in range(3)))
    _solo_work(state, NOW - 12, 12.0, moving=False)
    feed(state, NOW + 0.1, beat(1, step=41, collectives=counts(47)))
    feed(state, NOW + 0.2, beat(2, step=41, collectives=counts(47)))
    assert alerts_at(state, NOW + 0.3) == []
    # its next heartbeat, still at step 40 outside any collective: now it is named
    feed(state, NOW + 0.45, beat(0, step=40, collectives=counts(45)))
    feed(state, NOW + 0.6, beat(1, step=41, collectives=counts(47)))
    assert [(a.kind, a.ranks) for a in alerts_at(state, NOW + 0.7)] == [("stalled", (0,))]


def test_data_loading_is_the_cause_only_with_a_worker_to_wait_for() -> None:
    """With ``num_workers=0`` the batch is made on the main thread: its stack passes through
    the loader into the dataset's own code, and the loader's worker hint would be wrong."""
    from ddpwatch.diagnosis.text import in_data_loading

    no_workers = """\
  File "/home/ann/train.py", line 88, in validate
    for batch in val_loader:
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 733, in __next__
    data = self._next_data()
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 789, in _next_data
    data = self._dataset_fetcher.fetch(index)
  File "/venv/lib/python3.11/site-packages/torch/utils/data/_utils/fetch.py", line 52, in fetch
    data = [self.dataset[idx] for idx in possibly_batched_index]
  File "/home/ann/data.py", line 12, in __getitem__
    return decode(self.paths[i])
"""
    pinned = """\
  File "/home/ann/train.py", line 40, in main
    for batch in loader:
  File "/venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", line 1448, in _get_data
    success, data = self._try_get_data()
  File "/usr/lib/python3.11/queue.py", line 180, in get
    self.not_empty.wait(remaining)
"""
    assert not in_data_loading(no_workers)
    assert in_data_loading(LOADER_STACK) and in_data_loading(pinned)
    state = ServerState(started=NOW - 100)
    feed(
        state,
        NOW - 0.2,
        beat(0, collective=in_barrier(30, 6.0), collectives=counts(30)),
        beat(1, collectives=counts(29)),
        beat(2, collective=in_barrier(30, 6.0), collectives=counts(30)),
        Event(v=1, rank=1, t=0.0, event="stack", stack=no_workers),
    )
    alert = next(a for a in alerts_at(state, NOW) if a.kind == "straggler")
    assert alert.ranks == (1,) and "DataLoader" not in alert.message
    assert not alert.hint.startswith("data loading") and "data.py:12" in alert.message
