"""Collective arguments compared across ranks (#34): the reduce op and root of a collective in
flight, and each window's calls between two marks where the backend ran on and no rank
blocked, and ranks that passed a collective the others hang in. Public reports: an all_reduce
whose reduce op differs on one rank completes under gloo (measured), a broadcast whose ``src``
differs hangs; NCCL's reduce with a ``dst`` that differs finishes, later work hangs
(pytorch/pytorch#39706); an all_reduce whose dtype differs on one rank gives wrong values under
NCCL (pytorch/pytorch#150248) or hangs (pytorch/pytorch#150433)."""

from __future__ import annotations

from typing import Any

import pytest
from lockstep import NOW, TH, only, rank, state_of

from ddpwatch.core.protocol import CallSeen, Collective, ErrorInfo
from ddpwatch.diagnosis.facts.mismatch import odd_calls
from ddpwatch.diagnosis.rules import (
    diagnose,
    rule_collective_arguments,
    rule_collective_desync,
    rule_collective_mismatch,
)
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState

BROADCAST_0 = CallSeen(seq=17, op="broadcast", dtype="float32", numel=4, root=0)
BROADCAST_1 = CallSeen(seq=17, op="broadcast", dtype="float32", numel=4, root=1)
REDUCED = CallSeen(seq=18, op="all_reduce", dtype="float32", numel=1, reduce_op="sum")


def marked(r: int, world: int, digest: int, calls: list[CallSeen], **changes: Any) -> RankRecord:
    """A rank that marked steps 8 and 16 with 2 collectives a step; its window to step 16
    digested as ``digest`` (the one to step 8 alike on every rank) and described as
    ``calls``."""
    return rank(
        r,
        world,
        step_marks={8: 16, 16: 32},
        call_digests={8: 1000, 16: digest},
        call_windows={16: calls},
        **changes,
    )


def broadcast_job(world: int = 3, odd: tuple[int, ...] = (2,)) -> ServerState:
    """Ranks broadcast from src 0, the ``odd`` ones from src 1, and the backend ran on."""
    return state_of(
        *(
            marked(
                r, world, 7 if r in odd else 5, [BROADCAST_1 if r in odd else BROADCAST_0, REDUCED]
            )
            for r in range(world)
        )
    )


def test_a_broadcast_from_another_src_on_one_rank_names_it() -> None:
    alert = only(rule_collective_arguments(broadcast_job(), NOW, TH), "collective_mismatch")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (2,), (0, 1))
    assert alert.message == (
        "rank 2's collectives between steps 8 and 16 differ from ranks 0, 1's: rank 2 called "
        "broadcast src=1 with 4 elements (float32) at collective #17 where ranks 0, 1 called "
        "broadcast src=0 with 4 elements (float32), with as many calls: the backend ran on "
        "with no error, so the ranks' data no longer pairs up as the script means"
    )
    assert "src=rank" in alert.hint and "rank 2" in alert.hint
    whole = diagnose(broadcast_job(), NOW, TH)  # every rule: this one alert says it
    assert [(a.kind, a.ranks) for a in whole] == [("collective_mismatch", (2,))]


def test_a_dtype_that_differs_names_the_rank_and_the_reduce_op_only_where_it_differs() -> None:
    half = CallSeen(seq=18, op="all_reduce", dtype="float16", numel=1, reduce_op="sum")
    state = state_of(
        *(marked(r, 4, 5, [BROADCAST_0, REDUCED]) for r in range(3)),
        marked(3, 4, 9, [BROADCAST_0, half]),
    )
    alert = only(rule_collective_arguments(state, NOW, TH), "collective_mismatch")
    assert alert.ranks == (3,)
    assert (
        "rank 3 called all_reduce with 1 element (float16) at collective #18 where ranks 0-2 "
        "called all_reduce with 1 element (float32)"
    ) in alert.message
    maxed = CallSeen(seq=18, op="all_reduce", dtype="float32", numel=1, reduce_op="max")
    state.ranks[3] = marked(3, 4, 9, [BROADCAST_0, maxed])
    alert = only(rule_collective_arguments(state, NOW, TH), "collective_mismatch")
    assert "called all_reduce op=max with 1 element" in alert.message
    assert "ranks 0-2 called all_reduce op=sum with 1 element" in alert.message


def test_an_odd_call_the_others_never_made_and_windows_that_tell_nothing() -> None:
    # the odd call comes later in the window: the others' call at that number is a repeat
    late = CallSeen(seq=25, op="broadcast", dtype="float32", numel=4, root=1)
    state = state_of(
        *(marked(r, 3, 5, [BROADCAST_0, REDUCED]) for r in range(2)),
        marked(2, 3, 7, [BROADCAST_0, REDUCED, late]),
    )
    alert = only(rule_collective_arguments(state, NOW, TH), "collective_mismatch")
    assert "rank 2 called broadcast src=1 with 4 elements (float32) at collective #25 where " in (
        alert.message
    )  # the same op's call: what the others did instead
    scatter = CallSeen(seq=25, op="scatter", dtype="float32", numel=4, root=1)
    state.ranks[2] = marked(2, 3, 7, [BROADCAST_0, REDUCED, scatter])
    alert = only(rule_collective_arguments(state, NOW, TH), "collective_mismatch")
    assert "at collective #25, a call ranks 0, 1 made nowhere in that window" in alert.message
    # the same calls in another order: named, with no call to quote
    state.ranks[2] = marked(2, 3, 7, [REDUCED, BROADCAST_0])
    alert = only(rule_collective_arguments(state, NOW, TH), "collective_mismatch")
    assert alert.message.startswith(
        "rank 2's collectives between steps 8 and 16 differ from ranks 0, 1's, with as many"
    )


def test_no_window_described_at_the_mark_uses_an_earlier_one() -> None:
    state = broadcast_job()
    for r in range(3):  # step 16's windows never arrived; step 8's did, and differed too
        record = state.ranks[r]
        record.call_digests = {8: 7 if r == 2 else 5, 16: 8 if r == 2 else 6}
        record.call_windows = {8: [BROADCAST_1 if r == 2 else BROADCAST_0]}
    alert = only(rule_collective_arguments(state, NOW, TH), "collective_mismatch")
    assert alert.ranks == (2,) and "broadcast src=1" in alert.message


@pytest.mark.parametrize(
    "case",
    [
        "every rank broadcasts from src 1",  # a root that is not 0 is no fault
        "no majority",
        "two ranks",
        "a rank without digests",
        "counts differ",
        "a mismatch in flight",
    ],
)
def test_quiet(case: str) -> None:
    state = broadcast_job()
    if case == "every rank broadcasts from src 1":
        state = broadcast_job(odd=(0, 1, 2))
    elif case == "no majority":
        state = broadcast_job(world=4, odd=(2, 3))
    elif case == "two ranks":
        state = broadcast_job(world=2, odd=(1,))
    elif case == "a rank without digests":
        state.ranks[0].call_digests = {}
    elif case == "counts differ":  # a collective only rank 2 calls: the desync rule's
        state.ranks[2].step_marks = {8: 16, 16: 33}
        assert only(rule_collective_desync(state, NOW, TH), "collective_mismatch").ranks == (2,)
    elif case == "a mismatch in flight":
        for r in range(3):
            call = Collective(op="all_reduce", seq=40, since_s=2.6, shape=[4], dtype="float32")
            if r == 2:
                call = Collective(op="broadcast", seq=40, since_s=2.6, root=1)
            state.ranks[r] = marked(
                r, 3, 7 if r == 2 else 5, [BROADCAST_0], collective=call, collective_seen=NOW - 0.4
            )
        assert only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch").ranks == (2,)
    assert rule_collective_arguments(state, NOW, TH) == []


def test_the_latest_mark_all_ranks_digested_is_compared() -> None:
    state = broadcast_job()
    state.ranks[0].step_marks[24] = 48
    state.ranks[0].call_digests[24] = 123  # only rank 0 has reached step 24: not compared yet
    found = odd_calls(list(state.ranks.values()))
    assert found is not None and (found.step, found.since) == (16, 8)


def blocked_in(r: int, op: str = "broadcast", **fields: Any) -> RankRecord:
    fields.setdefault("seq", 12)
    call = Collective(op=op, since_s=2.6, shape=[4], dtype="float32", **fields)
    return rank(r, collective=call, collective_seen=NOW - 0.4)


def test_a_root_or_reduce_op_that_differs_in_flight_is_a_mismatch() -> None:
    """Ranks blocked in the same numbered collective (NCCL hangs where gloo runs on): the one
    whose root differs is named, the root quoted since it differs."""
    state = state_of(*(blocked_in(r, root=1 if r == 2 else 0) for r in range(3)))
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert alert.ranks == (2,)
    assert alert.message == (
        "rank 2 called broadcast src=1 with 4 elements (float32) at collective #12 where "
        "ranks 0, 1 called broadcast src=0 with 4 elements (float32)"
    )
    state = state_of(
        *(blocked_in(r, "all_reduce", reduce_op="max" if r == 0 else "sum") for r in range(3))
    )
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert alert.ranks == (0,) and "rank 0 called all_reduce op=max with 4" in alert.message
    # the same root everywhere: not quoted, no alert
    state = state_of(*(blocked_in(r, root=1) for r in range(3)))
    assert rule_collective_mismatch(state, NOW, TH) == []


def test_a_tie_in_flight_is_broken_by_the_ranks_that_got_past_it() -> None:
    """A gloo broadcast whose src differs on rank 2 (src=rank): the root, rank 0, and rank 2
    hang in it, each sending to a rank that does not receive; rank 1, which rank 0 reached,
    goes on into DDP's all-reduce (the flight recorder's) and says how it called the broadcast
    (``before``): 2 against 1, rank 2 is named."""

    def hung(r: int, root: int) -> RankRecord:
        return blocked_in(r, source="py", root=root)

    passed = Collective(
        op="all_reduce", seq=90, since_s=2.6, source="fr", group="0",
        before=CallSeen(seq=12, op="broadcast", dtype="float32", numel=4, root=0),
    )  # fmt: skip
    state = state_of(hung(0, 0), rank(1, collective=passed, collective_seen=NOW - 0.4), hung(2, 2))
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert (alert.ranks, alert.waiting) == ((2,), (0, 1))
    assert alert.message == (
        "rank 2 called broadcast src=2 with 4 elements (float32) at collective #12 where "
        "ranks 0, 1 called broadcast src=0 with 4 elements (float32)"
    )
    # the same where the hung ranks report the flight recorder's number (gloo records every
    # collective): the agent gives the Python-level number too, which ``before`` compares with
    state = state_of(
        *(
            blocked_in(r, source="fr", group="0", seq=64, py_seq=12, root=root)
            for r, root in ((0, 0), (2, 2))
        ),
        rank(1, collective=passed, collective_seen=NOW - 0.4),
    )
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert alert.ranks == (2,) and "at collective #64 where ranks 0, 1 called" in alert.message
    # rank 1's last call was another one: it says nothing about #12, and the tie names nobody
    elsewhere = Collective(
        op="all_reduce", seq=90, since_s=2.6, source="fr", group="0",
        before=CallSeen(seq=11, op="broadcast", dtype="float32", numel=4, root=0),
    )  # fmt: skip
    state = state_of(
        hung(0, 0), rank(1, collective=elsewhere, collective_seen=NOW - 0.4), hung(2, 2)
    )
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert alert.ranks == () and "which side is odd cannot be told" in alert.message
    # ranks that agree in flight are not compared with those past it (a healthy job's ranks
    # pass from one collective to the next all the time)
    odd_past = Collective(
        op="all_reduce", seq=90, since_s=2.6, source="fr", group="0",
        before=CallSeen(seq=12, op="broadcast", dtype="float32", numel=4, root=2),
    )  # fmt: skip
    state = state_of(
        hung(0, 0), rank(1, collective=odd_past, collective_seen=NOW - 0.4), hung(2, 0)
    )
    assert rule_collective_mismatch(state, NOW, TH) == []


def test_the_votes_of_ranks_past_it_hold_once_every_rank_is_dead() -> None:
    """Stopped from outside, each rank reports the collective it died in: the two hung in
    the broadcast their Python-level call, rank 1 none (DDP's all-reduce runs in C++); its
    last heartbeat's collective, kept with its ``before``, still breaks the tie."""

    def died(r: int, final: Collective) -> RankRecord:
        return rank(r, exit_time=NOW - 2.0, exit_signal="SIGTERM", final_collective=final)

    hung = [
        Collective(op="broadcast", seq=40, source="py", shape=[1], dtype="float32", root=root)
        for root in (0, 2)
    ]
    ddp = Collective(
        op="allreduce", seq=65, source="fr", group="0",
        before=CallSeen(seq=40, op="broadcast", dtype="float32", numel=1, root=0),
    )  # fmt: skip
    state = state_of(died(0, hung[0]), died(1, ddp), died(2, hung[1]))
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert alert.ranks == (2,) and "where ranks 0, 1 called broadcast src=0" in alert.message


def test_a_broadcast_that_timed_out_keeps_the_blame_on_the_odd_src() -> None:
    """The same broadcast under a process-group timeout (``broadcast-src --pg-timeout 6``,
    measured): ranks 0 and 2 time out in it ("send"), rank 1 in DDP's next all-reduce
    ("recv"), and every rank is dead. Their finals are the flight recorder's numbers with the
    Python call's (``py_seq``), and rank 1's timeout waited for the two held in the broadcast:
    rank 2 stays named, rank 1 is never a crash of its own (seen: "crashed ranks=[1]")."""
    gloo = "[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/unbound_buffer.cc:{}] "

    def timed_out(r: int, final: Collective, what: str, line: int) -> RankRecord:
        error = ErrorInfo(
            type="RuntimeError",
            message=gloo.format(line) + f"Timed out waiting 6000ms for {what} operation to complete",
        )
        return rank(r, 3, error=error, error_time=NOW - 2.0, exit_time=NOW - 1.5, exit_code=1,
                    final_collective=final)  # fmt: skip

    hung = [
        Collective(op="broadcast", seq=64, source="fr", group="0", py_seq=40, shape=[1],
                   dtype="float32", root=root)
        for root in (0, 2)
    ]  # fmt: skip
    ddp = Collective(
        op="allreduce", seq=65, source="fr", group="0",
        before=CallSeen(seq=40, op="broadcast", dtype="float32", numel=1, root=0),
    )  # fmt: skip
    state = state_of(
        timed_out(0, hung[0], "send", 129),
        timed_out(1, ddp, "recv", 78),
        timed_out(2, hung[1], "send", 129),
    )
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks) for a in alerts if a.ranks] == [("collective_mismatch", (2,))]
    assert "where ranks 0, 1 called broadcast src=0" in alerts[0].message


def test_a_rank_gloo_aborted_inside_the_call_votes_with_its_black_box_and_is_no_root() -> None:
    """``metric-dtype`` (pytorch/pytorch#150248's family): rank 1 all-reduces in float64,
    rank 2 waits in float32, and rank 0 was aborted (SIGABRT) inside its float32 call, which
    only its black box tells (``core/boxreader.py``). Rank 1 is named; rank 0, killed inside
    the mismatched collective, is one of its victims, never an ``exited`` root of its own."""

    def reduce(dtype: str) -> Collective:
        return Collective(op="all_reduce", seq=20, source="py", shape=[1], dtype=dtype,
                          reduce_op="sum", since_s=2.0)  # fmt: skip

    aborted = {"exit_time": NOW - 1.0, "exit_signal": "SIGABRT"}
    state = state_of(
        rank(0, 3, **aborted, final_collective=reduce("float32")),
        rank(1, 3, collective=reduce("float64"), collective_seen=NOW - 0.2),
        rank(2, 3, collective=reduce("float32"), collective_seen=NOW - 0.2),
    )
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks) for a in alerts if a.ranks] == [("collective_mismatch", (1,))]
    assert "where ranks 0, 2 called all_reduce with 1 element (float32)" in alerts[0].message
    # the same rank killed by SIGABRT with no mismatch to belong to: a root, and why
    alone = state_of(
        rank(0, 3, **aborted, final_collective=reduce("float32")),
        rank(1, 3, collective=None),
        rank(2, 3, collective=None),
    )
    exited = only(diagnose(alone, NOW, TH), "exited")
    assert exited.ranks == (0,)
    killed = "killed by SIGABRT inside all_reduce with 1 element (float32), collective #20, in"
    assert killed in exited.message
    assert "aborted the process from C++" in exited.hint
