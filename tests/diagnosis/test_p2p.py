"""Point-to-point (``diagnosis/rules/p2p.py``): a rank blocked in a send or receive waits for
its one peer. The peer is named: the stage the others wait for, or the rank whose missing
send deadlocks the job; the blocked ranks never are."""

from __future__ import annotations

from typing import Any

from lockstep import NOW, STACK, TH, rank, state_of

from ddpwatch.core.protocol import Collective, CollectiveCounts
from ddpwatch.diagnosis.rules import diagnose
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState

HEARD = NOW - 0.3


def _in(op: str, age: float, seq: int | None = None, **fields: Any) -> dict[str, Any]:
    """A rank blocked in ``op`` for ``age`` s as of NOW: a DDP all-reduce the flight recorder
    numbers (``seq``), or a send or receive (``peer``, ``tag``)."""
    source = "fr" if seq is not None else "py"
    group = "0" if seq is not None else None
    c = Collective(op=op, seq=seq, since_s=age - 0.4, source=source, group=group, **fields)
    return {"collective": c, "collective_seen": NOW - 0.4}


def _rank(r: int, entered: int, world: int = 3, **changes: Any) -> RankRecord:
    """Rank ``r`` heard just now, having entered ``entered`` collectives of the default group."""
    counts = CollectiveCounts(py=0, fr={"0": entered})
    return rank(r, world, **{"step": 12, "collectives": counts, "sample_seen": HEARD, **changes})


def _judged(*records: RankRecord) -> list[tuple[str, str, tuple[int, ...], tuple[int, ...]]]:
    state: ServerState = state_of(*records)
    return [(a.kind, a.severity, a.ranks, a.waiting) for a in diagnose(state, NOW, TH)]


def _alert(*records: RankRecord) -> Any:
    alerts = diagnose(state_of(*records), NOW, TH)
    assert len(alerts) == 1, alerts
    return alerts[0]


def skipped_send() -> list[RankRecord]:
    """diffusion-pipe#409's shape: rank 0 skipped its send of the targets to rank 1 and went
    on to DDP's all-reduce, with rank 2; rank 1 waits in its receive."""
    return [
        _rank(0, 18, **_in("all_reduce", 12.4, seq=18)),
        _rank(1, 17, **_in("recv", 12.6, peer=0)),
        _rank(2, 18, **_in("all_reduce", 12.3, seq=18)),
    ]


def test_a_send_not_made_names_the_sender_not_the_rank_stuck_in_recv() -> None:
    found = _alert(*skipped_send())
    assert (found.kind, found.severity, found.ranks, found.waiting) == (
        "send_recv_deadlock",
        "error",
        (0,),
        (1, 2),
    )
    assert found.message == (
        "rank 1 waits in recv from rank 0 at step 12 for 12.6 s; rank 0 is in all_reduce #18 "
        "at step 12, which rank 1 must enter: a send rank 0 did not make; rank 2 waits in "
        "all_reduce #18 too"
    )
    assert "rank 0 went on to the collective without its send to rank 1" in found.hint


def test_a_receive_not_made_names_the_receiver() -> None:
    """The other direction: rank 1 blocks in a send that rank 0 never receives."""
    records = skipped_send()
    records[1] = _rank(1, 17, **_in("send", 12.6, peer=0, tag=7))
    found = _alert(*records)
    assert (found.kind, found.ranks, found.waiting) == ("send_recv_deadlock", (0,), (1, 2))
    assert "rank 1 waits in send to rank 0 (tag 7)" in found.message
    assert "a recv rank 0 did not make" in found.message


def test_a_batch_half_not_posted_names_the_rank_with_both_its_neighbours_blocked() -> None:
    """PiPPy #969's shape, round a ring: rank 0 posted nothing, so rank 1's irecv from it and
    rank 2's isend to it never complete while it waits in the all-reduce."""
    found = _alert(
        _rank(0, 18, **_in("all_reduce", 12.4, seq=18)),
        _rank(1, 17, **_in("irecv", 12.6, peer=0)),
        _rank(2, 17, **_in("isend", 12.5, peer=0)),
    )
    assert (found.kind, found.ranks, found.waiting) == ("send_recv_deadlock", (0,), (1, 2))
    assert found.message == (
        "rank 1 waits in irecv from rank 0 at step 12 for 12.6 s; rank 0 is in all_reduce #18 "
        "at step 12, which rank 1 must enter: a send rank 0 did not make; rank 2 waits in "
        "isend to rank 0 too"
    )


def test_a_slow_stage_in_no_collective_is_the_straggler_with_the_stage_on_the_way() -> None:
    """Rank 0 computes (no collective); rank 1 waits for its send, rank 2 in the all-reduce
    for both: rank 0 alone is named, rank 1 is a victim on the way."""
    records = [
        _rank(0, 17, stack=STACK, last_progress=NOW - 12.6),
        _rank(1, 17, **_in("recv", 12.6, peer=0)),
        _rank(2, 18, **_in("all_reduce", 12.4, seq=18)),
    ]
    alerts = diagnose(state_of(*records), NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("straggler", (0,), (1, 2))]
    assert alerts[0].message == (
        "rank 0 has not entered all_reduce #18 that rank 2 has waited in for 12.4 s; rank 1 "
        "waits in recv from rank 0; rank 0 is in 'forward' at step 12, train.py:88"
    )


def test_a_pipeline_with_no_collective_names_the_first_stage_of_the_chain() -> None:
    """Stages 1 and 2 wait to receive from the stage before; stage 0 is stuck in its forward."""
    records = [
        _rank(0, 0, stack=STACK, last_progress=NOW - 12.8),
        _rank(1, 0, **_in("recv", 12.6, peer=0)),
        _rank(2, 0, **_in("recv", 12.7, peer=1)),
    ]
    alerts = diagnose(state_of(*records), NOW, TH)
    assert [(a.kind, a.severity, a.ranks, a.waiting) for a in alerts] == [
        ("straggler", "error", (0,), (1, 2))
    ]
    assert alerts[0].message == (
        "rank 1 in recv from rank 0, rank 2 in recv from rank 1: waiting for up to 12.7 s; "
        "rank 0 is in 'forward' at step 12, train.py:88"
    )
    one = diagnose(state_of(*records[:2], _rank(2, 0, last_progress=NOW - 0.1)), NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in one] == [("straggler", (0,), (1,))]
    assert one[0].message == (
        "rank 1 has waited in recv from rank 0 for 12.6 s; rank 0 is in 'forward' at step 12, "
        "train.py:88"
    )


def test_two_ranks_that_both_receive_first_are_both_named() -> None:
    """pytorch#172668's shape: each waits in a receive from the other."""
    found = _alert(
        _rank(0, 0, **_in("recv", 6.0, peer=1)),
        _rank(1, 0, **_in("recv", 5.9, peer=0)),
        _rank(2, 0, last_progress=NOW - 0.1),
    )
    assert (found.kind, found.ranks) == ("send_recv_deadlock", (0, 1))
    assert found.message.endswith("both receive before either sends")


def test_a_send_and_a_receive_with_other_tags_are_both_named_with_the_tags() -> None:
    found = _alert(
        _rank(0, 0, **_in("send", 6.0, peer=1, tag=3)),
        _rank(1, 0, **_in("recv", 5.9, peer=0, tag=5)),
        _rank(2, 0, last_progress=NOW - 0.1),
    )
    assert (found.kind, found.ranks) == ("send_recv_deadlock", (0, 1))
    assert found.message == (
        "ranks 0 and 1 wait for each other: rank 0 in send to rank 1 (tag 3) at step 12, rank 1 "
        "in recv from rank 0 (tag 5) at step 12, for 6.0 s: the tags differ (3 and 5), so "
        "neither completes"
    )


def test_healthy_pipeline_waits_name_nobody() -> None:
    """A stage waits a little for the one before: shorter than any collective limit."""
    assert _judged(
        _rank(0, 0, last_progress=NOW - 0.1),
        _rank(1, 0, **_in("recv", 0.9, peer=0)),
        _rank(2, 0, **_in("recv", 1.2, peer=1)),
    ) == []


def test_a_peer_not_heard_since_the_wait_began_is_not_named() -> None:
    """Rank 0's last report predates rank 1's wait: it may have sent since."""
    assert _judged(
        _rank(0, 0, last_progress=NOW - 0.1, sample_seen=NOW - 20.0, last_seen=NOW - 0.2),
        _rank(1, 0, **_in("recv", 6.0, peer=0)),
        _rank(2, 0, last_progress=NOW - 0.1),
    ) == []


def test_a_receive_from_any_source_names_nobody() -> None:
    assert [
        kind
        for kind, *_ in _judged(
            _rank(0, 0, last_progress=NOW - 0.1),
            _rank(1, 0, **_in("recv", 6.0)),
            _rank(2, 0, last_progress=NOW - 0.1),
        )
        if kind in ("straggler", "send_recv_deadlock")
    ] == []


def test_a_timeout_in_recv_keeps_the_blame_on_the_peer_that_did_not_send() -> None:
    """The same skipped send under a process-group timeout (8 s): rank 1 times out in its
    recv, ranks 0 and 2 in DDP's all-reduce it never entered. torchrun's "Root Cause" names
    the first to time out; the alert stays on rank 0, the verdict's evidence too."""
    from test_attribution import GLOO_RECV_TIMEOUT, beat, counts, feed

    from ddpwatch.core.protocol import Event

    state = ServerState(started=NOW - 100)
    allreduce = Collective(op="gloo:all_reduce", seq=62, since_s=0.0, source="fr", group="0")
    recv = Collective(op="recv", since_s=0.0, source="py", peer=0)
    timeout = {"pg_timeout_s": 8.0, "step": 20}
    for at, waited in ((NOW - 8.0, 0.2), (NOW - 4.0, 4.2), (NOW - 0.6, 7.6)):
        into = {"since_s": waited}
        feed(
            state,
            at,
            beat(0, collective=Collective(**{**_fields(allreduce), **into}), **timeout,
                 collectives=counts(41, 62)),
            beat(1, collective=Collective(**{**_fields(recv), **into}), **timeout,
                 collectives=counts(41, 61)),
            beat(2, collective=Collective(**{**_fields(allreduce), **into}), **timeout,
                 collectives=counts(41, 62)),
        )  # fmt: skip
    live = diagnose(state, NOW - 0.5, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in live] == [("send_recv_deadlock", (0,), (1, 2))]

    def died(rank: int, place: Collective) -> Event:
        return Event(
            v=1, rank=rank, t=0.0, event="crash", error=GLOO_RECV_TIMEOUT, step=20,
            collective=Collective(**{**_fields(place), "since_s": 8.0}),
        )  # fmt: skip

    feed(state, NOW - 0.2, died(1, recv), died(0, allreduce), died(2, allreduce))
    after = [a for a in diagnose(state, NOW, TH) if a.severity == "error"]
    assert [(a.kind, a.ranks, a.waiting) for a in after] == [("send_recv_deadlock", (0,), (1, 2))]
    assert after[0].message == (
        "rank 1 in recv from rank 0 timed out after 8.0 s: a send rank 0 did not make; it was "
        "in gloo:all_reduce #62, where rank 2 timed out too"
    )


def _fields(c: Collective) -> dict[str, Any]:
    return {name: getattr(c, name) for name in c.__struct_fields__}


def test_a_stage_still_starting_up_is_slow_not_a_straggler() -> None:
    """Stage 0 has not taken its first step and its CPU time grows (importing, building the
    model): stage 1 waits for its first send, which startup_hang tells, not a straggler."""
    records = [
        _rank(0, 0, step=None, phase="model_wrap", last_progress=NOW - 12.8, cpu_rate=0.9,
              cpu_grew_at=NOW - 0.4),
        _rank(1, 0, step=None, **_in("recv", 12.6, peer=0)),
        _rank(2, 0, step=None, **_in("recv", 12.7, peer=1)),
    ]  # fmt: skip
    kinds = [a.kind for a in diagnose(state_of(*records), NOW, TH) if a.ranks]
    assert "straggler" not in kinds and "send_recv_deadlock" not in kinds


def test_a_deadlock_beside_a_late_rank_names_both() -> None:
    """Rank 1 waits in recv from rank 0, which waits in the all-reduce with rank 2; rank 3,
    in no collective, has not entered it either: both ranks the all-reduce waits for are
    named, the one that did not send and the one still elsewhere."""
    records = [
        _rank(0, 18, world=4, **_in("all_reduce", 12.4, seq=18)),
        _rank(1, 17, world=4, **_in("recv", 12.6, peer=0)),
        _rank(2, 18, world=4, **_in("all_reduce", 12.3, seq=18)),
        _rank(3, 17, world=4, stack=STACK, last_progress=NOW - 12.5),
    ]
    alerts = [a for a in diagnose(state_of(*records), NOW, TH) if a.ranks]
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [
        ("send_recv_deadlock", (0, 3), (1, 2))
    ]
    assert alerts[0].message.endswith(
        "; rank 3 has not entered all_reduce #18 either: in 'forward' at step 12, train.py:88"
    ), alerts[0].message
