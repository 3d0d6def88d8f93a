"""``RankRecord`` (``state/records.py``) declares every protocol field the server keeps, refuses
any other, and every field of a ``Sample`` and a ``Hello`` lands on it."""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest


def test_the_rank_record_declares_every_protocol_field_it_keeps() -> None:
    from ddpwatch.core.protocol import Hello, Sample
    from ddpwatch.state.records import STORED_FIELDS, RankRecord

    declared = {f.name for f in fields(RankRecord)}
    wire = set(Hello.__struct_fields__) | set(Sample.__struct_fields__)
    assert set(STORED_FIELDS) == wire - {"v", "t"}
    assert set(STORED_FIELDS) <= declared


def test_the_rank_record_refuses_a_field_it_does_not_declare() -> None:
    from ddpwatch.state.records import RankRecord

    with pytest.raises(TypeError):
        RankRecord(rank=0, first_seen=0.0, last_seen=0.0, bogus=1)  # type: ignore[call-arg]
    record = RankRecord(rank=0, first_seen=0.0, last_seen=0.0)
    with pytest.raises(AttributeError):
        record.bogus = 1  # type: ignore[attr-defined]
    assert not hasattr(record, "__dict__")


def test_every_field_of_a_sample_and_a_hello_lands_on_the_record() -> None:
    from ddpwatch.core.protocol import Collective, CollectiveCounts, Hello, Sample
    from ddpwatch.state.records import STORED_FIELDS
    from ddpwatch.state.state import ServerState

    identity: dict[str, Any] = {
        "local_rank": 1,
        "world_size": 4,
        "local_world_size": 2,
        "node_rank": 0,
        "host": "node-a",
        "pid": 4242,
        "launcher": "torchrun",
        "job_id": "j1",
        "backend": "nccl",
        "torch_version": "2.4.0",
        "cuda_visible_devices": "0,1",
        "device": "cuda:1",
        "device_index": 1,
        "device_name": "H100",
        "device_uuid": "GPU-1",
        "device_pci_bus_id": "0000:01:00.0",
        "device_count": 2,
        "pg_timeout_s": 600.0,
        "restart_count": 1,
        "rendezvous": "standalone",
        "simulated": True,
        "master_addr": "node-a",
        "master_port": "29500",
        "init_method": "env://",
        "run_id": "j1",
        "script": "/home/ann/train.py",
        "script_hash": "9f2c4e1a7b3d5f60",
        "cuda_version": "12.8",
        "nccl_version": "2.27.3",
        "box": "2-4242-0123456789abcdef.box",
    }
    measured: dict[str, Any] = {
        "phase": "forward",
        "cpu_s": 12.5,
        "step": 7,
        "loss": 1.5,
        "step_time_s": 0.2,
        "avg_step_time_s": 0.25,
        "data_wait_s": 0.01,
        "collective_time_s": 0.03,
        "input_wait_s": 0.02,
        "compute_s": 0.15,
        "grad_wait_s": 0.05,
        "collective": Collective(op="all_reduce", seq=3, since_s=0.5, source="py"),
        "collectives": CollectiveCounts(py=3),
        "nan_step": 6,
        "grad_nan_step": 5,
        "forwards": 8,
        "compile_reason": "tensor 'x' size mismatch at index 0. expected 4, actual 8",
        "batch_marks": [(8, 9)],
        "backward_marks": [(8, 8)],
        "eval_sync_marks": [(8, 0)],
        "mem_allocated_bytes": 1,
        "mem_reserved_bytes": 2,
        "mem_peak_bytes": 3,
        "gpu_mem_used_bytes": 4,
        "gpu_mem_total_bytes": 5,
        "gpu_pids": [4242],
        "host_rss_bytes": 6,
        "workers_rss_bytes": 7,
        "host_available_bytes": 8,
        "host_total_bytes": 9,
        "cgroup_limit_bytes": 10,
        "cgroup_used_bytes": 11,
    }
    # a new wire field fails here until this test (and the record) know it
    assert set(identity) | set(measured) | {"rank"} == set(STORED_FIELDS)
    state = ServerState(started=0.0)
    state.apply(Hello(v=1, rank=1, t=0.0, **identity), 1.0)
    record = state.ranks[1]
    assert {name: getattr(record, name) for name in identity} == identity
    state.apply(Sample(v=1, rank=1, t=0.0, **identity, **measured), 2.0)
    record = state.ranks[1]
    expected = {**identity, **measured, "rank": 1}
    assert {name: getattr(record, name) for name in STORED_FIELDS} == expected


def test_the_early_hellos_phase_never_puts_a_rank_back() -> None:
    """'starting' is a process's first phase only: an early beat that arrives after the
    agent's first word (another socket) leaves the phase, and its clock, as they were."""
    from ddpwatch.core.protocol import Sample
    from ddpwatch.state.state import ServerState

    state = ServerState(started=0.0)
    state.apply(Sample(v=1, rank=1, t=0.0, pid=7, phase="starting", cpu_s=0.2), 1.0)
    state.apply(Sample(v=1, rank=1, t=0.0, pid=7, phase="rendezvous", cpu_s=3.0), 5.0)
    state.apply(Sample(v=1, rank=1, t=0.0, pid=7, phase="starting", cpu_s=2.9), 5.1)
    record = state.ranks[1]
    assert (record.phase, record.phase_since) == ("rendezvous", 5.0)
    assert [name for name, _ in record.phases] == ["starting", "rendezvous"]


def test_the_record_notes_when_the_ranks_cpu_time_last_grew() -> None:
    from ddpwatch.core.protocol import Sample
    from ddpwatch.state.state import ServerState

    state = ServerState(started=0.0)
    for now, cpu in ((1.0, 0.20), (1.5, 0.25), (2.0, 0.35), (2.5, 0.36), (9.0, 0.37)):
        state.apply(Sample(v=1, rank=0, t=0.0, pid=7, phase="starting", cpu_s=cpu), now)
    record = state.ranks[0]
    assert (record.cpu_s, record.cpu_grew_at) == (0.37, 2.0)  # 0.1 s of CPU from 0.20 on
    assert record.cpu_rate == pytest.approx(0.15)  # 0.15 s of CPU from 1.0 to 2.0
    state.apply(Sample(v=1, rank=0, t=0.0, pid=7, phase="starting", cpu_s=0.05), 9.5)
    assert (record.cpu_mark_s, record.cpu_grew_at, record.cpu_rate) == (0.05, 9.5, None)


def test_a_window_keeps_sixteen_heartbeats_counting_what_each_paced_beat_stands_for() -> None:
    """A paced relay's beat stands for its pace of heartbeats (``Beat.STANDS_FOR``): a window
    of pace-4 beats keeps 5 of them (``MIN_BEATS``, 20 heartbeats), not 16 (64), so it
    follows a change as soon as a direct rank's does; direct beats keep 16."""
    import math

    from ddpwatch.state.records import BEAT_WIDTH, BEATS, MIN_BEATS, Beat, note_beat, stands_for

    def one(pace: float) -> tuple[float, ...]:
        values = [math.nan] * BEAT_WIDTH
        values[Beat.GAP], values[Beat.STANDS_FOR] = 0.5 * pace, pace
        return tuple(values)

    direct = None
    for _ in range(40):
        direct = note_beat(direct, one(1.0))
    assert direct is not None and len(direct) == BEATS * BEAT_WIDTH
    paced = None
    for _ in range(40):
        paced = note_beat(paced, one(4.0))
    assert paced is not None and len(paced) == MIN_BEATS * BEAT_WIDTH
    assert stands_for(paced) == 20.0
    paced2 = None
    for _ in range(40):
        paced2 = note_beat(paced2, one(2.0))
    assert paced2 is not None and stands_for(paced2) == BEATS == 2 * len(paced2) / BEAT_WIDTH
    assert direct is not None
    for _ in range(3):  # the pace slows: the window keeps 16 heartbeats' worth
        direct = note_beat(direct, one(4.0))
    assert stands_for(direct) >= BEATS and stands_for(direct) - direct[Beat.STANDS_FOR] < BEATS


def test_a_heartbeat_through_a_paced_relay_stands_for_its_pace() -> None:
    from ddpwatch.core.protocol import Sample
    from ddpwatch.state.records import Beat
    from ddpwatch.state.state import ServerState

    state = ServerState(started=0.0)
    for step in range(1, 4):
        if step > 1:
            state.ranks[0].relayed = 4  # as ingest notes it, from the batch, before applying
        beat = Sample(v=1, rank=0, t=float(step), step=step, collective_time_s=0.01)
        state.apply(beat, float(step))
    beats = state.ranks[0].beats
    assert beats is not None
    assert list(beats[Beat.STANDS_FOR :: len(Beat)]) == [1.0, 4.0, 4.0]
    # 2 s apart at pace 4 is a beat's gap, not an episode: the 3 beats skipped are left out
    state.apply(Sample(v=1, rank=0, t=5.0, step=4, collective_time_s=0.01), 5.0)
    assert beats[Beat.GAP - len(Beat)] == 0.5
