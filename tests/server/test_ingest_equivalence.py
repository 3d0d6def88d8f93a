"""Ingest gives exactly the records the protocol says, however fast it is made.

The server's ingest path (``Collector._receive`` → ``ServerState.apply``) is tuned for CPU
per heartbeat; these tests pin down what it must still do, field by field, on recorded
sequences with every case the hot path has a shortcut for: steps that move or not, progress
through forwards and collectives, NaN bookkeeping, identity repeated or changed, stacks,
crashes, exits, logs, checkpoints, a new process for a rank, step marks past their bound,
measurements left out; and through a real ``Collector``: direct frames and relays' batches,
admission, which path a rank's last frame took, and the coalescing of a backlog (which
heartbeats are applied, which only counted). The expected values are worked out by hand from
``docs/protocol.md`` and ``state/state.py``'s rules; where a test compares with
``ServerState.apply``, it is on the subset of messages worked out by hand.
"""

from __future__ import annotations

import math
import random
import time
from array import array
from collections import deque
from dataclasses import fields
from typing import Any

import msgspec
import pytest
import zmq
from conftest import AppliedState, free_port_pair, push_frames

from ddpwatch.core.protocol import (
    AnyMessage,
    Batch,
    CallSeen,
    CallWindow,
    Collective,
    CollectiveCounts,
    ErrorInfo,
    Event,
    Hello,
    Sample,
    encode,
    plain_beat,
)
from ddpwatch.server import ingest
from ddpwatch.server.collector import Collector
from ddpwatch.server.ingest import _holdable, superseded
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState
from ddpwatch.state.step_times import StepTimes

NAN = float("nan")
IDENT: dict[str, Any] = {
    "local_rank": 0,
    "world_size": 2,
    "local_world_size": 2,
    "node_rank": 0,
    "host": "node-a",
    "pid": 100,
    "launcher": "torchrun",
    "job_id": "j1",
    "backend": "nccl",
    "device": "cuda:0",
    "device_uuid": "GPU-0",
}


def snapshot(record: RankRecord) -> dict[str, Any]:
    """Every field of a record: deques as lists, dicts as their items in order, NaN as a
    string (so that two snapshots compare equal)."""

    def plain(value: Any) -> Any:
        if isinstance(value, float) and math.isnan(value):
            return "nan"
        if isinstance(value, tuple):
            return tuple(plain(v) for v in value)
        if isinstance(value, (list, deque, array)):
            return [plain(v) for v in value]
        if isinstance(value, dict):
            return list(value.items())
        return value

    return {f.name: plain(getattr(record, f.name)) for f in fields(RankRecord)}


LAUNCH_FIELDS = (
    "master_addr",
    "master_port",
    "init_method",
    "run_id",
    "script",
    "script_hash",
    "cuda_version",
    "nccl_version",
    "box",
)


def identity_key(**changed: Any) -> tuple[Any, ...]:
    """The identity fields of ``IDENT`` (with ``changed``) in the protocol's order."""
    ident = {**IDENT, **changed}
    return (
        ident["local_rank"], ident["world_size"], ident["local_world_size"], ident["node_rank"],
        ident["host"], ident["pid"], ident["launcher"], ident["job_id"], ident["backend"],
        None, None, ident["device"], None, None, ident["device_uuid"], None, None, None, None, None,
        False, *(None for _ in LAUNCH_FIELDS),
    )  # fmt: skip


def beat(rank: int = 0, **fields: Any) -> Sample:
    """A heartbeat with the measurements every test sample repeats unless told otherwise."""
    base: dict[str, Any] = {
        "phase": "train",
        "step_time_s": 0.5,
        "avg_step_time_s": 0.5,
        "data_wait_s": 0.01,
        "collective_time_s": 0.1,
        "mem_allocated_bytes": 10,
        "mem_reserved_bytes": 20,
        "mem_peak_bytes": 30,
        "gpu_mem_used_bytes": 40,
        "gpu_mem_total_bytes": 80,
        "gpu_pids": [100],
    }
    return Sample(v=1, rank=rank, t=0.0, **{**base, **fields})


def event(kind: str, rank: int = 0, **fields: Any) -> Event:
    return Event(v=1, rank=rank, t=0.0, event=kind, **fields)


COUNTS_1 = CollectiveCounts(py=1, fr={"0": 2}, marks=[(0, 0)])
COUNTS_3 = CollectiveCounts(py=3, fr={"0": 5}, marks=[(0, 0), (8, 3)])
IN_ALL_REDUCE = Collective(op="all_reduce", seq=2, since_s=0.5, source="py", shape=[4])
CRASHED_IN = Collective(op="all_reduce", seq=9)


def one_rank_life() -> list[tuple[float, AnyMessage]]:
    """Rank 0 from its hello to a checkpoint after its exit, one message per second."""
    return [
        (1.0, Hello(v=1, rank=0, t=0.0, **IDENT)),
        (2.0, beat(step=1, loss=2.0, collectives=COUNTS_1, forwards=1)),
        # not moved, into a collective: no progress
        (3.0, beat(step=1, loss=1.9, collectives=COUNTS_1, forwards=1, collective=IN_ALL_REDUCE)),
        # out of it: progress, though the step is the same
        (4.0, beat(step=1, loss=1.9, collectives=COUNTS_1, forwards=1)),
        (5.0, event("stack", stack="stack-1")),
        # a forward pass is progress; the stack stays: the step did not move
        (6.0, beat(step=1, loss=1.9, collectives=COUNTS_1, forwards=2)),
        # moved with a NaN loss and no nan_step: the step is the bound
        (7.0, beat(step=2, loss=NAN, collectives=COUNTS_3, forwards=3, collective_time_s=0.3)),
        (8.0, beat(step=3, loss=NAN, collectives=COUNTS_3, forwards=4)),  # the bound stays
        (9.0, beat(step=4, loss=NAN, nan_step=3, collectives=COUNTS_3, forwards=5)),  # exact
        (10.0, beat(step=5, loss=1.0, collectives=COUNTS_3, forwards=6)),  # finite: cleared
        # the identity changes (a new device): applied, a new generation
        (11.0, beat(**{**IDENT, "device": "cuda:1"}, phase="eval", step=5, loss=1.0, forwards=6)),
        # the same identity again: nothing new
        (12.0, beat(**{**IDENT, "device": "cuda:1"}, phase="eval", step=5, loss=1.0, forwards=6)),
        (
            13.0,
            event(
                "crash",
                error=ErrorInfo(type="RuntimeError", message="boom"),
                stack="tb",
                step=7,
                phase="train",
                collective=CRASHED_IN,
            ),
        ),
        (14.0, beat(step=8, loss=1.0, forwards=7)),  # dead: the crash's stack stays
        (15.0, event("exit", exit_code=1)),
        (16.0, event("log", text="a\nb\nc")),
        (17.0, event("checkpoint", path="/ckpt/1", step=8)),
        (18.0, event("unknown-kind", step=3)),  # counted, nothing else (a lower step is kept)
    ]


def _step_times(*timed: tuple[float, int]) -> StepTimes:
    found = StepTimes()
    for per_step_s, steps in timed:
        found.add(per_step_s, steps)
    return found


def expected_after_life() -> dict[str, Any]:
    """Rank 0's record after ``one_rank_life``, by hand."""
    return {
        "rank": 0,
        "first_seen": 1.0,
        "last_seen": 18.0,
        **IDENT,
        "device": "cuda:1",
        "torch_version": None,
        "cuda_visible_devices": None,
        "device_index": None,
        "device_name": None,
        "device_pci_bus_id": None,
        "device_count": None,
        "pg_timeout_s": None,
        "restart_count": None,
        "rendezvous": None,
        "simulated": False,
        **dict.fromkeys(LAUNCH_FIELDS),
        "attempt": 1,
        "relayed": False,
        "identity_key": identity_key(device="cuda:1"),
        "phase": "train",
        "phase_since": 13.0,
        "compile_reason": None,
        "cpu_s": None,
        "cpu_grew_at": None,
        "cpu_mark_s": None,
        "cpu_rate": None,
        "step": 8,
        "loss": 1.0,
        "step_time_s": 0.5,
        "avg_step_time_s": 0.5,
        "data_wait_s": 0.01,
        "collective_time_s": 0.1,
        "input_wait_s": None,
        "compute_s": None,
        "grad_wait_s": None,
        "collective": None,
        "collective_seen": None,
        "collectives": None,  # the last sample (t=14) sent none
        "sample_seen": 14.0,
        # steps 1, 2, 3, 4, 5, 8 (the sample at t=11 did not move), 0.1 s in collectives but
        # 0.3 at step 2, each after its step gap (the first since the server's time 0)
        "beats": [
            *_beat(2.0, 0.1),
            *_beat(5.0, 0.3),
            *_beat(1.0, 0.1),
            *_beat(1.0, 0.1),
            *_beat(1.0, 0.1),
            *_beat(4.0, 0.1),
        ],
        # steps 2-5 one a beat, at their own 0.5 s; 6-8 in one beat the sender's clock
        # (t=0 throughout) cannot time
        "step_times": _step_times((0.5, 4)),
        "timed_step": 8,
        "timed_sent": 0.0,
        "step_marks": [(0, 0), (8, 3)],
        "call_digests": [],  # this life sent no call digests
        "call_windows": [],
        "forwards": 7,
        "batch_marks": None,  # this life drew no batches from a DataLoader
        "drawn_marks": [],
        "backward_marks": None,  # nor ran a backward
        "backwards_marked": [],
        "eval_sync_marks": None,  # nor evaluated through a buffer-broadcasting DDP model
        "evals_marked": [],
        "mem_allocated_bytes": 10,
        "mem_reserved_bytes": 20,
        "mem_peak_bytes": 30,
        "gpu_mem_used_bytes": 40,
        "gpu_mem_total_bytes": 80,
        "gpu_pids": [100],
        "host_rss_bytes": None,
        "workers_rss_bytes": None,
        "host_available_bytes": None,
        "host_total_bytes": None,
        "cgroup_limit_bytes": None,
        "cgroup_used_bytes": None,
        "host_mem_points": None,
        "first_step": 1,
        "first_step_at": 2.0,
        "last_progress": 14.0,
        "last_step_at": 14.0,
        "wait_ended_at": 4.0,  # out of the all-reduce it had waited in for 0.5 s at t=3
        "wait_ended_s": 1.5,
        "stack": "tb",
        "stack_moved_at": None,  # one stack, then a step: it never moved at one step
        "error": ErrorInfo(type="RuntimeError", message="boom"),
        "error_time": 13.0,
        "exit_code": 1,
        "exit_signal": None,
        "exit_time": 15.0,
        "final_collective": CRASHED_IN,
        "nan_step": None,
        "nan_exact": False,
        "grad_nan_step": None,
        "checkpoint_paths": ["/ckpt/1"],
        "phases": [("train", 2.0), ("eval", 11.0), ("train", 13.0)],
        "log_tail": ["a", "b", "c"],
    }


def _beat(gap: float, waited: float) -> list[Any]:
    """One ``records.Beat`` of ``beat()``'s: 0.5 s steps, 0.01 s data wait, no step split."""
    return [gap, 0.5, waited, "nan", "nan", "nan", 0.01, 1.0]


def test_a_ranks_life_lands_field_by_field() -> None:
    state = ServerState(started=0.0)
    generations = []
    progress = []
    for at, message in one_rank_life():
        state.apply(message, at)
        generations.append(state.generation)
        progress.append(state.ranks[0].last_progress)
    assert generations == [2, 2, 2, 2, 2, 2, 2, 2, 2, 2, 3, 3, 4, 4, 5, 5, 6, 6]
    assert progress == [1, 2, 2, 4, 4, 6, 7, 8, 9, 10, 10, 10, 10, 14, 14, 14, 14, 14]
    assert (state.received, state.rejected, state.first_report) == (18, 0, 1.0)
    assert snapshot(state.ranks[0]) == expected_after_life()


def test_midway_values_nan_bound_exact_and_the_stack() -> None:
    state = ServerState(started=0.0)
    seen = []
    for at, message in one_rank_life()[:10]:
        state.apply(message, at)
        r = state.ranks[0]
        seen.append((r.nan_step, r.nan_exact, r.stack, r.collective_seen, r.last_step_at))
    assert seen == [
        (None, False, None, None, 0.0),
        (None, False, None, None, 2.0),
        (None, False, None, 3.0, 2.0),
        (None, False, None, None, 2.0),
        (None, False, "stack-1", None, 2.0),
        (None, False, "stack-1", None, 2.0),
        (2, False, None, None, 7.0),
        (2, False, None, None, 8.0),
        (3, True, None, None, 9.0),
        (None, False, None, None, 10.0),
    ]


def test_a_new_process_for_a_rank_starts_its_record_afresh() -> None:
    state = ServerState(started=0.0)
    for at, message in one_rank_life():
        state.apply(message, at)
    old = state.ranks[0]
    state.apply(beat(**{**IDENT, "pid": 101}, step=1, loss=3.0, forwards=1), 19.0)
    record = state.ranks[0]
    # a new record, a new identity, and a new attempt (the process before had ended)
    assert record is not old and state.generation == 6 + 3
    assert (record.attempt, state.attempt, state.past_attempts[0].records[0]) == (2, 2, old)
    expected = snapshot(RankRecord(rank=0, first_seen=19.0, last_seen=19.0))
    expected.update(
        {
            **IDENT,
            "pid": 101,
            "identity_key": identity_key(pid=101),
            "phase": "train",
            "phase_since": 19.0,
            "phases": [("train", 19.0)],
            "step": 1,
            "loss": 3.0,
            "step_time_s": 0.5,
            "avg_step_time_s": 0.5,
            "data_wait_s": 0.01,
            "collective_time_s": 0.1,
            "beats": _beat(19.0, 0.1),
            "forwards": 1,
            "mem_allocated_bytes": 10,
            "mem_reserved_bytes": 20,
            "mem_peak_bytes": 30,
            "gpu_mem_used_bytes": 40,
            "gpu_mem_total_bytes": 80,
            "gpu_pids": [100],
            "sample_seen": 19.0,
            "last_progress": 19.0,
            "last_step_at": 19.0,
            "first_step": 1,
            "first_step_at": 19.0,
            "timed_step": 1,
            "attempt": 2,
        }
    )
    assert snapshot(record) == expected
    assert state.received == 19


def test_step_marks_keep_the_32_latest_whatever_repeats() -> None:
    state = ServerState(started=0.0)
    record_marks = []
    batches: list[list[tuple[int, int]] | None] = [
        [(8 * k, k) for k in range(1, 41)],  # 40 marks: the 8 lowest go
        [(8 * k, k) for k in range(1, 41)],  # the same again
        [(8 * k, k + 1) for k in range(1, 41)],  # new counts for the same steps
        [(0, 0)],  # lower than all kept: in and out again
        [(0, 0)],
        None,  # no marks: nothing changes
        [(1000, 7)],  # a higher one pushes out the lowest
        [(1000, 7)],
        [(1000, 8), (1000, 9)],  # the last of a step wins
    ]
    for n, marks in enumerate(batches):
        counts = CollectiveCounts(py=n, marks=marks)
        state.apply(beat(step=n, collectives=counts), float(n + 1))
        record_marks.append(list(state.ranks[0].step_marks.items()))
    first = [(8 * k, k) for k in range(9, 41)]
    second = [(8 * k, k + 1) for k in range(9, 41)]
    assert record_marks[:2] == [first, first]
    assert record_marks[2:6] == [second] * 4
    assert record_marks[6:8] == [[*second[1:], (1000, 7)]] * 2
    assert record_marks[8] == [*second[1:], (1000, 9)]
    assert state.ranks[0].collectives == CollectiveCounts(py=8, marks=[(1000, 8), (1000, 9)])


def test_measurements_replace_the_last_ones_and_lists_keep_their_values() -> None:
    state = ServerState(started=0.0)
    shape = Collective(op="all_reduce", seq=4, since_s=0.1, shape=[2, 3], dtype="float32")
    seen = []
    for n, fields_ in enumerate(
        [
            {"gpu_pids": [100], "collective": shape},
            {"gpu_pids": [100], "collective": Collective(op="all_reduce", seq=4, since_s=0.6,
                                                          shape=[2, 3], dtype="float32")},
            {"gpu_pids": [100, 200], "collective": Collective(op="all_reduce", seq=4,
                                                              shape=[3, 3])},
            {"gpu_pids": None, "mem_allocated_bytes": None},
            {"gpu_pids": []},
        ]
    ):  # fmt: skip
        state.apply(beat(step=1, **fields_), float(n + 1))
        r = state.ranks[0]
        seen.append((r.gpu_pids, r.collective, r.collective_seen, r.mem_allocated_bytes))
    assert seen == [
        ([100], shape, 1.0, 10),
        ([100], Collective(op="all_reduce", seq=4, since_s=0.6, shape=[2, 3], dtype="float32"),
         2.0, 10),
        ([100, 200], Collective(op="all_reduce", seq=4, shape=[3, 3]), 3.0, 10),
        (None, None, None, None),
        ([], None, None, 10),
    ]  # fmt: skip
    # the same op, seq and source is the same collective, whatever its shape: only leaving
    # it (t=4) is progress after the first step
    assert state.ranks[0].last_progress == 4.0


# ---------------------------------------------------------------- through the real collector


def _collect(port: int, frames: list[bytes], total: int, **options: Any) -> AppliedState:
    """Every frame through a real ``Collector`` whose clock stands at 1000.0."""
    state = AppliedState(started=0.0)
    collector = Collector(state, lambda: b"{}", "127.0.0.1", port, clock=lambda: 1000.0, **options)
    try:
        reject = [encode(beat(rank=1, step=99)), b"second part"]  # one, counted
        push_frames(port, [*frames, reject])
        deadline = time.monotonic() + 10
        while state.received + state.rejected < total and time.monotonic() < deadline:
            collector.poll(0.1)
    finally:
        collector.close()
    return state


def test_direct_frames_land_as_if_applied_one_by_one(port: int) -> None:
    """Each rank's samples and events in order, without a rank seen twice in a row of samples
    (so that how ZeroMQ splits them into receives cannot coalesce any)."""
    messages: list[AnyMessage] = [
        Hello(v=1, rank=0, t=0.0, **IDENT),
        beat(rank=1, **{**IDENT, "pid": 101, "local_rank": 1}, step=3, loss=NAN),
        beat(rank=0, step=1, loss=2.0, collectives=COUNTS_1, forwards=1),
        event("stack", rank=1, stack="s"),
        beat(rank=2, **{**IDENT, "pid": 102}, step=1),  # beyond max_ranks=2: refused
        event("crash", rank=0, error=ErrorInfo(type="E"), collective=CRASHED_IN),
        beat(rank=1, step=4, loss=NAN, nan_step=3),
        event("exit", rank=0, exit_code=0),
    ]
    frames = [encode(m) for m in messages]
    frames.insert(3, b"\x81\xa1v\x01")  # valid MessagePack, not a message
    state = _collect(port, frames, len(frames) + 1, max_ranks=2)
    assert (state.received, state.rejected) == (len(messages) - 1, 1 + 1 + 1)
    reference = ServerState(started=0.0)
    for message in messages:
        if message.rank != 2:
            reference.apply(message, 1000.0)
    assert sorted(state.ranks) == [0, 1]
    for rank in (0, 1):
        assert snapshot(state.ranks[rank]) == snapshot(reference.ranks[rank])
    assert state.generation == reference.generation
    assert state.ranks[1].nan_step == 3 and state.ranks[1].nan_exact
    assert state.ranks[0].exit_time == 1000.0 and state.ranks[0].final_collective == CRASHED_IN


def test_a_relay_batch_is_coalesced_per_rank_exactly_as_documented(port: int) -> None:
    """One batch, so one receive: of a known rank's samples only the newest is applied, plus
    any with a NaN loss or an identity the next one leaves out; events keep their place."""
    ident1 = {**IDENT, "pid": 101, "local_rank": 1}
    first: list[AnyMessage] = [beat(rank=0, **IDENT, step=1), beat(rank=1, **ident1, step=1)]
    backlog: list[AnyMessage] = [
        beat(rank=0, step=2, loss=1.0),  # superseded by step 3: dropped
        beat(rank=0, step=3, loss=NAN),  # NaN: applied though superseded
        beat(rank=1, step=2),  # applied before rank 1's event
        event("stack", rank=1, stack="s1"),
        beat(rank=0, step=4, loss=1.0),  # dropped
        beat(rank=0, **{**IDENT, "device": "cuda:3"}, step=5),  # identity: applied
        beat(rank=0, step=6, loss=0.5),  # dropped
        beat(rank=0, step=7, loss=0.4, forwards=7),  # the newest: applied last
        beat(rank=1, step=3),  # dropped
        beat(rank=1, step=4, forwards=4),  # the newest: applied
        Hello(v=1, rank=3, t=0.0, **{**IDENT, "pid": 103}),  # a new rank: applied at once
        beat(rank=3, step=1),  # a sample of a rank known by then: coalesced (the newest)
    ]
    ages = [2_000_000, 0, 0, 1_000, 0, 0, 0, 500_000, 0, 0, 90_000_000, 0]
    batches = [
        Batch(v=1, relay="node-a:1", t=0.0, host="node-a", seq=0, frames=[encode(m) for m in first],
              ages_us=[0, 0]),
        Batch(v=1, relay="node-a:1", t=0.0, host="node-a", seq=2,
              frames=[encode(m) for m in backlog] + [b"junk"], ages_us=[*ages, 0], rejected=3,
              dropped=1),
    ]  # fmt: skip
    total = 2 + len(backlog) + 3 + 1 + 1  # the relay's rejects, the junk, the multipart
    state = _collect(port, [encode(b) for b in batches], total)
    assert (state.received, state.rejected) == (2 + len(backlog), 3 + 1 + 1)

    at = [1000.0 - min(age, 60_000_000) / 1e6 for age in ages]
    applied = [(m, 1000.0) for m in first] + [
        (backlog[i], at[i]) for i in (2, 3, 1, 5, 10, 7, 9, 11)
    ]
    reference = ServerState(started=0.0)
    for message, when in applied:
        reference.apply(message, when)
    for rank in (0, 1, 3):
        got, want = snapshot(state.ranks[rank]), snapshot(reference.ranks[rank])
        assert got.pop("relayed") and not want.pop("relayed")
        assert got == want
    assert reference.received + 4 == state.received  # four superseded: counted, not applied
    assert state.generation == reference.generation
    assert state.steps(0) == [1, 3, 5, 7]
    assert state.ranks[3].first_seen == 940.0  # held 90 s: dated a minute back, no more
    relay = state.relays["node-a:1"]
    assert (relay.batches, relay.frames, relay.dropped, relay.lost_batches) == (2, 15, 1, 1)
    assert relay.ranks == {0, 1, 3}


@pytest.mark.parametrize("world", [None, 5])
def test_admission_counts_ranks_beyond_the_cap_as_rejected(port: int, world: int | None) -> None:
    """Without ``--max-ranks`` the cap follows the largest world size seen (plus a margin)."""
    from ddpwatch.server import collector as collector_module

    margin = collector_module.RANK_MARGIN
    ranks = range(0, (world or 1) + margin + 3)
    messages = [beat(rank=r, step=1, world_size=world) for r in ranks]
    state = _collect(port, [encode(m) for m in messages], len(messages) + 1)
    kept = (world + margin) if world else len(messages)
    assert (state.received, state.rejected) == (kept, len(messages) - kept + 1)
    assert sorted(state.ranks) == list(range(kept))


def test_a_known_ranks_heartbeat_still_answers_for_its_world_size(port: int) -> None:
    """A heartbeat of a rank already tracked is admitted, unless the world size it tells is
    more than the server could track; and the size it tells widens the cap for new ranks."""
    from ddpwatch.server import collector as collector_module

    margin = collector_module.RANK_MARGIN
    messages: list[AnyMessage] = [
        Hello(v=1, rank=0, t=0.0, host="a"),  # no world size: up to 1,024 ranks
        beat(rank=0, step=1, world_size=5),  # now 5 + margin
        *[beat(rank=r, step=1) for r in range(1, 5 + margin + 3)],
    ]
    state = _collect(port, [encode(m) for m in messages], len(messages) + 1)
    assert len(state.ranks) == 5 + margin
    assert (state.received, state.rejected) == (5 + margin + 1, 3 + 1)

    capped = [Hello(v=1, rank=0, t=0.0, host="a"), beat(rank=0, step=1, world_size=3)]
    state = _collect(port, [encode(m) for m in capped], len(capped) + 1, max_ranks=2)
    assert (state.received, state.rejected) == (1, 1 + 1)  # more than --max-ranks: refused
    assert state.ranks[0].step is None and state.ranks[0].world_size is None


def test_relayed_says_how_the_last_frame_came(port: int) -> None:
    def relayed(*messages: AnyMessage) -> bytes:
        return encode(Batch(v=1, relay="n:1", t=0.0, frames=[encode(m) for m in messages]))

    frames = [
        encode(Hello(v=1, rank=0, t=0.0, **IDENT)),
        relayed(beat(rank=0, step=1), Hello(v=1, rank=1, t=0.0, pid=7)),
        encode(beat(rank=1, step=1)),
    ]
    state = _collect(port, frames, 4 + 1)
    assert (state.ranks[0].relayed, state.ranks[1].relayed) == (True, False)
    state = _collect(port, [*frames, relayed(beat(rank=1, step=2)), encode(beat(step=2))], 6 + 1)
    assert (state.ranks[0].relayed, state.ranks[1].relayed) == (False, True)


class _Queued:
    """Frames already queued on the collector's socket, taken in one receive (a backlog),
    without the timing of a real socket: ``recv`` as ``zmq.Socket.recv`` answers."""

    class Part:
        more = False

        def __init__(self, data: bytes) -> None:
            self.bytes = data

    def __init__(self, frames: list[bytes]) -> None:
        self.frames = list(frames)

    def recv(self, flags: int = 0, copy: bool = True) -> Any:
        if not self.frames:
            raise zmq.Again()
        frame = self.frames.pop(0)
        return frame if copy else self.Part(frame)

    def getsockopt(self, option: int) -> int:
        return 0


def test_a_backlog_of_direct_frames_is_coalesced_per_rank(port: int) -> None:
    """The same rules as in a relay's batch, for frames that came one by one."""
    now = 1000.0
    state = AppliedState(started=0.0)
    collector = Collector(state, lambda: b"{}", "127.0.0.1", port, clock=lambda: now)
    ident1 = {**IDENT, "pid": 101, "local_rank": 1}
    first: list[AnyMessage] = [
        Hello(v=1, rank=0, t=0.0, **IDENT),
        Hello(v=1, rank=1, **ident1, t=0),
    ]
    backlog: list[AnyMessage] = [
        beat(rank=0, step=2, loss=1.0),  # dropped: superseded
        beat(rank=0, step=3, loss=NAN),  # NaN: applied though superseded
        beat(rank=1, step=2),  # dropped
        beat(rank=0, **{**IDENT, "device": "cuda:3"}, step=4),  # identity: applied
        beat(rank=0, step=5),  # applied before rank 0's event
        event("stack", rank=0, stack="s"),
        beat(rank=1, step=3),  # rank 1's last heartbeat of the receive
        beat(rank=0, step=6, loss=0.5),  # dropped: the next one is rank 0's last
        beat(rank=0, step=7, forwards=6),  # rank 0's last
        event("exit", rank=1, exit_code=0),
    ]
    socket = collector._pull
    try:
        for frames in ([encode(m) for m in first], [encode(m) for m in backlog] + [b"junk"]):
            collector._pull = _Queued(frames)  # type: ignore[assignment]
            collector._receive()
    finally:
        collector._pull = socket
        collector.close()
    assert (state.received, state.rejected) == (2 + len(backlog), 1)
    reference = ServerState(started=0.0)
    for message in [*first, *(backlog[i] for i in (1, 3, 4, 5, 6, 8, 9))]:
        reference.apply(message, now)
    for rank in (0, 1):
        assert snapshot(state.ranks[rank]) == snapshot(reference.ranks[rank])
    assert reference.received + 3 == state.received
    assert state.steps(0) == [3, 4, 5, 7]


def test_apply_leaves_the_messages_as_they_came() -> None:
    """The record keeps the equal lists it already holds (fewer objects for the garbage
    collector), but never by changing a message it was given."""
    state = ServerState(started=0.0)
    messages = [
        beat(
            step=n,
            collective=Collective(op="all_reduce", seq=n, shape=[4, 4]),
            collectives=CollectiveCounts(py=n, marks=[(8, 8), (16, 16)]),
            gpu_pids=[100],
        )
        for n in (1, 2, 3)
    ]

    def parts(m: Any) -> tuple[Any, ...]:
        return (m.collective, m.collective.shape, m.collectives, m.collectives.marks, m.gpu_pids)

    before = [parts(m) for m in messages]
    encoded = [encode(m) for m in messages]
    for n, message in enumerate(messages):
        state.apply(message, float(n))
    assert [encode(m) for m in messages] == encoded
    for was, now in zip(before, [parts(m) for m in messages], strict=True):
        assert all(a is b for a, b in zip(was, now, strict=True))
    record = state.ranks[0]
    assert record.collective == messages[2].collective
    assert record.collectives == messages[2].collectives
    assert record.gpu_pids is messages[0].gpu_pids  # equal since: the first list is kept
    assert record.collective is not None and record.collective.shape is before[0][1]


# ---------------------------------------------------------------- a server far behind sheds


def _random_backlog(rng: random.Random, ranks: int, length: int) -> list[AnyMessage]:
    """A backlog of ``ranks`` known ranks in every shape shedding must tell apart: plain
    heartbeats (most), NaN, infinite and int losses, identities repeated or with a new pid,
    events and hellos between heartbeats, ranks never seen before."""
    messages: list[AnyMessage] = []
    steps = [1] * (ranks + 2)
    for _ in range(length):
        rank = rng.randrange(ranks + 2)  # the last two are new to the server
        steps[rank] += rng.random() < 0.7
        fields: dict[str, Any] = {"step": steps[rank], "loss": rng.choice([1.0, 0.5, None])}
        roll = rng.random()
        if roll < 0.04:
            fields["loss"] = rng.choice([NAN, math.inf, 2])
        elif roll < 0.08:
            fields.update(IDENT, pid=100 + rank + rng.choice([0, 0, 1000]), local_rank=rank)
        elif roll < 0.10:
            fields["device"] = "cuda:1"  # one identity field alone
        elif roll < 0.13:
            kind, extra = rng.choice(
                [
                    ("stack", {"stack": "line 1"}),
                    ("log", {"text": "x"}),
                    ("phase", {"phase": "eval"}),
                ]
            )
            messages.append(event(kind, rank=rank, **extra))
            continue
        elif roll < 0.14:
            messages.append(Hello(v=1, rank=rank, t=0.0, **{**IDENT, "pid": 100 + rank}))
            continue
        if rng.random() < 0.2:
            fields["collective"] = Collective(op="all_reduce", seq=steps[rank], since_s=0.1)
        messages.append(beat(rank=rank, **fields))
    return messages


class _Recorded:
    """What a ``Recorder`` is given: every rank frame, with its time, in order."""

    def __init__(self) -> None:
        self.frames: list[tuple[float, bytes]] = []

    def frame(self, t: float, data: bytes) -> None:
        self.frames.append((t, data))

    def route(self, t: float, batch: bytes = b"") -> None:
        """How the frames after came (``Recorder.route``): not what this test compares."""


def _take_in_one_receive(
    port: int,
    frames: list[bytes],
    messages: int,
    shedding: bool,
    ranks: int,
    recorder: _Recorded | None = None,
) -> ServerState:
    """The known ranks' identities, then ``frames`` (``messages`` rank messages, all valid)
    in one receive of a collector behind its queue: for 100 s (it sheds) or just now (it
    coalesces only). The clock stands still."""
    state = ServerState(started=0.0)
    clock = lambda: 1000.0  # noqa: E731
    collector = Collector(state, lambda: b"{}", "127.0.0.1", port, clock=clock, recorder=recorder)
    try:
        push_frames(port, [encode(beat(rank=r, **{**IDENT, "pid": 100 + r})) for r in range(ranks)])
        deadline = time.monotonic() + 10
        while state.received < ranks and time.monotonic() < deadline:
            collector.poll(0.1)
        push_frames(port, frames)
        time.sleep(0.5)  # all queued: one receive takes them
        collector._behind = True
        state.heard_until = 1000.0 - (100.0 if shedding else 1.0)
        collector.poll(1.0)
        assert state.received + state.rejected == ranks + messages  # all in that receive
    finally:
        collector.close()
    return state


@pytest.mark.parametrize("seed", range(8))
def test_a_server_far_behind_sheds_only_what_coalescing_would_not_apply(
    port: int, seed: int
) -> None:
    """Far behind (``collector.SHED_AFTER_S``) the server reads the superseded plain
    heartbeats by their head alone. The records must come out exactly as coalescing leaves
    them (same receive, same clock), field by field, for every rank; only ``shed`` differs.
    Half the backlogs come through a relay's batches."""
    rng = random.Random(seed)
    ranks = 12
    messages = _random_backlog(rng, ranks, 600)
    frames = [encode(m) for m in messages]
    if seed % 2:  # through relays: batches of 1-40 frames, each frame aged
        batched = []
        while frames:
            cut = frames[: rng.randint(1, 40)]
            frames = frames[len(cut) :]
            ages = [rng.randrange(500_000) for _ in cut]
            batched.append(
                encode(
                    Batch(v=1, relay="node:1", t=0.0, seq=len(batched), frames=cut, ages_us=ages)
                )
            )
        frames = batched
    total = len(messages)
    coalesced = _take_in_one_receive(port, frames, total, shedding=False, ranks=ranks)
    shed = _take_in_one_receive(free_port_pair(), frames, total, shedding=True, ranks=ranks)
    assert coalesced.shed == 0 and shed.shed > 100  # most heartbeats here are plain
    assert (shed.received, shed.rejected) == (coalesced.received, coalesced.rejected)
    assert sorted(shed.ranks) == sorted(coalesced.ranks)
    for rank in coalesced.ranks:
        assert snapshot(shed.ranks[rank]) == snapshot(coalesced.ranks[rank]), rank
    assert shed.generation == coalesced.generation


def test_call_digests_and_windows_are_kept_like_the_marks() -> None:
    """``collectives.digests`` fold into the record like ``marks``; ``collectives.window``
    keeps the latest 4 windows' calls, by step (``rule_collective_arguments`` reads both)."""
    state = ServerState(started=0.0)
    call = CallSeen(seq=9, op="broadcast", dtype="float32", numel=4, root=0)
    for n in range(6):
        step = 8 * (n + 1)
        counts = CollectiveCounts(
            py=step,
            marks=[(step, step)],
            digests=[(step - 8, n), (step, n + 1)] if n else [(step, n + 1)],
            window=CallWindow(step=step, calls=[call]),
        )
        state.apply(beat(step=step, collectives=counts), float(n + 1))
        repeated = state.ranks[0].collectives
        state.apply(beat(step=step, collectives=counts), float(n + 1.5))  # the same again
        assert state.ranks[0].collectives is not None
        assert state.ranks[0].collectives.window is repeated.window  # type: ignore[union-attr]
    record = state.ranks[0]
    assert record.call_digests == {8 * (k + 1): k + 1 for k in range(6)}
    assert record.call_windows == {step: [call] for step in (24, 32, 40, 48)}


def test_the_windows_closed_between_two_heartbeats_are_kept_too() -> None:
    """A step faster than heartbeats closes several windows between two: ``earlier`` tells
    each one, so two ranks' descriptions meet at the mark where their digests first differ;
    once folded they are not kept on the counts."""
    state = ServerState(started=0.0)
    call = CallSeen(seq=9, op="all_reduce", dtype="float32", numel=1, reduce_op="max")
    counts = CollectiveCounts(
        py=24,
        marks=[(8, 8), (16, 16), (24, 24)],
        digests=[(8, 1), (16, 2), (24, 3)],
        window=CallWindow(step=24, calls=[call]),
        earlier=[CallWindow(step=8, calls=[call]), CallWindow(step=16, calls=[call])],
    )
    state.apply(beat(step=24, collectives=counts), 1.0)
    record = state.ranks[0]
    assert record.call_windows == {8: [call], 16: [call], 24: [call]}
    assert record.collectives is not None and record.collectives.earlier is None


# ---------------------------------------------------------------- superseded relay batches


def _hinted(relay: str, seq: int, messages: list[AnyMessage], rng: random.Random) -> Batch:
    """A relay's batch as ``relay.Relay._send`` builds it: each frame's rank, and where its
    plain heartbeats are (``Batch.ranks``, ``Batch.plain``)."""
    return Batch(
        v=1,
        relay=relay,
        t=0.0,
        seq=seq,
        frames=[encode(m) for m in messages],
        ages_us=[rng.randrange(500_000) for _ in messages],
        ranks=[m.rank for m in messages],
        plain=[i for i, m in enumerate(messages) if plain_beat(m)],
    )


def _through_relays(rng: random.Random, messages: list[AnyMessage], by_rank: bool) -> list[Batch | AnyMessage]:
    """``messages`` as two relays and the ranks themselves would send them, each rank's in
    order: by rank (even ranks through relay a, odd through b, the two new ranks directly),
    or each message by a path drawn at random (ranks that move between relays and back)."""
    open_: dict[str, list[AnyMessage]] = {"a:1": [], "b:1": []}
    seqs = dict.fromkeys(open_, 0)
    sent: list[Batch | AnyMessage] = []
    last_path: dict[int, str] = {}

    def close(relay: str) -> None:
        if open_[relay]:
            sent.append(_hinted(relay, seqs[relay], open_[relay], rng))
            seqs[relay] += 1
            open_[relay] = []

    for message in messages:
        rank = message.rank
        if by_rank:
            path = "direct" if rank >= 12 else ("a:1", "b:1")[rank % 2]
        else:
            path = rng.choice(["a:1", "a:1", "b:1", "direct"])
        was = last_path.get(rank)
        if was is not None and was != path and was != "direct":
            close(was)  # a rank's frames leave in order whatever its path
        last_path[rank] = path
        if path == "direct":
            sent.append(message)
        else:
            open_[path].append(message)
            if rng.random() < 0.08:
                close(path)
    for relay in open_:
        close(relay)
    return sent


@pytest.mark.parametrize("shedding", [False, True])
@pytest.mark.parametrize("seed", range(6))
def test_a_batch_superseded_by_its_relays_next_leaves_the_records_as_coalescing(
    port: int, seed: int, shedding: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Behind, a receive that holds two batches of one relay leaves out, unread, the older
    one's heartbeats that the newer supersedes (``ingest.superseded``). The records must
    come out exactly as from the same batches without the relays' hints (nothing left out
    unread), field by field; only ``shed`` differs. Two relays and direct frames, ranks
    fixed to a path or moving between them, coalescing or shedding."""
    rng = random.Random(seed)
    ranks = 12
    messages = _random_backlog(rng, ranks, 600)
    sent = _through_relays(rng, messages, by_rank=seed % 2 == 0)
    hinted = [encode(m) for m in sent]
    unhinted = [
        encode(msgspec.structs.replace(m, ranks=[], plain=[]) if isinstance(m, Batch) else m)
        for m in sent
    ]
    total = len(messages)
    recorded = _Recorded() if seed % 3 == 0 else None  # recorded: every frame, in its place
    want_recorded = _Recorded() if recorded is not None else None
    want = _take_in_one_receive(
        port, unhinted, total, shedding=shedding, ranks=ranks, recorder=want_recorded
    )
    left_out: list[int] = []

    def counted(*args: Any) -> set[int]:
        found = superseded(*args)
        left_out.append(len(found))
        return found

    monkeypatch.setattr(ingest, "superseded", counted)
    got = _take_in_one_receive(
        free_port_pair(), hinted, total, shedding=shedding, ranks=ranks, recorder=recorded
    )
    if recorded is not None and want_recorded is not None:
        assert recorded.frames == want_recorded.frames
        assert len(recorded.frames) == ranks + total
    assert (got.received, got.rejected) == (want.received, want.rejected)
    assert sorted(got.ranks) == sorted(want.ranks)
    for rank in want.ranks:
        assert snapshot(got.ranks[rank]) == snapshot(want.ranks[rank]), rank
    assert got.generation == want.generation
    assert sum(left_out) > 10  # some were left out unread: counted as shed
    if shedding:  # most of them it sheds anyway (not one after a heartbeat that is not plain)
        assert want.shed <= got.shed < want.shed + sum(left_out)
    else:
        assert got.shed == want.shed + sum(left_out)
    for name, relay in want.relays.items():
        assert (got.relays[name].batches, got.relays[name].frames) == (relay.batches, relay.frames)


def _batch(messages: list[AnyMessage], **told: Any) -> Batch:
    hints = {
        "ranks": [m.rank for m in messages],
        "plain": [i for i, m in enumerate(messages) if plain_beat(m)],
    }
    return Batch(v=1, relay="r:1", t=0.0, frames=[encode(m) for m in messages], **{**hints, **told})


def test_what_a_newer_batch_supersedes_by_hand() -> None:
    """Only a known rank's last frame in the older batch, a plain heartbeat, whose first
    frame in the newer batch is a plain heartbeat too."""
    older = _batch(
        [
            beat(rank=0, step=1),  # not rank 0's last here
            beat(rank=0, step=2),  # superseded
            beat(rank=1, step=1, loss=NAN),  # not plain
            beat(rank=2, step=1),  # rank 2's first in the newer batch is an event
            beat(rank=3, step=1),  # rank 3 is not in the newer batch
            beat(rank=4, step=1),  # not known before the receive
            beat(rank=5, step=1, pid=7),  # tells its identity
            event("log", rank=6, text="x"),  # an event
            beat(rank=7, step=1),  # rank 7's first in the newer batch tells its identity
        ]
    )
    newer = _batch(
        [
            event("stack", rank=2, stack="s"),
            beat(rank=2, step=2),
            *(beat(rank=r, step=3) for r in (0, 1, 4, 5, 6)),
            beat(rank=7, step=2, pid=9),
        ]
    )
    assert superseded(older, newer, known=set(range(8)) - {4}) == {1}
    assert superseded(older, older, known=range(8)) == {1, 3, 4, 5, 8}
    # the usual: the same ranks, one plain heartbeat each, in both
    node = _batch([beat(rank=r, step=1) for r in range(8)])
    assert superseded(node, node, known=set(range(8)) - {4}) == set(range(8)) - {4}
    twice = _batch([beat(rank=r % 4, step=1) for r in range(8)])  # a rank twice: its last
    assert superseded(twice, twice, known=range(8)) == {4, 5, 6, 7}


def test_a_batch_whose_hints_do_not_fit_its_frames_is_read_whole() -> None:
    messages: list[AnyMessage] = [beat(rank=0, step=1), beat(rank=1, step=1)]
    assert _holdable(_batch(messages))
    assert not _holdable(_batch(messages, ranks=[0]))  # a rank for each frame, or none
    assert not _holdable(_batch(messages, plain=[2]))  # a position past the frames
    assert not _holdable(_batch([]))


def test_a_receive_whose_holding_raises_takes_every_frame_all_the_same(
    port: int, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Holding batches is new code on the collector's reading path: if it raises (a bug),
    the failure is counted and logged like a frame's, and the records come out as from
    batches with no hints (every frame taken, coalesced as it comes), not lost."""
    rng = random.Random(7)
    ranks = 12
    messages = _random_backlog(rng, ranks, 300)
    sent = _through_relays(rng, messages, by_rank=True)
    hinted = [encode(m) for m in sent]
    unhinted = [
        encode(msgspec.structs.replace(m, ranks=[], plain=[]) if isinstance(m, Batch) else m)
        for m in sent
    ]
    want = _take_in_one_receive(port, unhinted, len(messages), shedding=False, ranks=ranks)

    def broken(*args: Any) -> set[int]:
        raise RuntimeError("a bug in superseded")

    monkeypatch.setattr(ingest, "superseded", broken)
    got = _take_in_one_receive(
        free_port_pair(), hinted, len(messages), shedding=False, ranks=ranks
    )
    assert got.failed >= 1 and want.failed == 0
    assert (got.received, got.rejected) == (want.received, want.rejected)
    for rank in want.ranks:
        assert snapshot(got.ranks[rank]) == snapshot(want.ranks[rank]), rank
