"""A ticking server's diagnosis (``Diagnosis``): the per-tick rules every call, the rules
that read only identities and liveness when those change, the drifting measurements
(memory, step rates) about once a second; between runs a rule's alerts stand."""

from __future__ import annotations

from typing import Any

import ddpwatch.diagnosis.facts as facts_module
import ddpwatch.diagnosis.rules as rules
from ddpwatch.core.protocol import Collective, CollectiveCounts, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts.census import take_census
from ddpwatch.diagnosis.facts.ranks import wait_key
from ddpwatch.diagnosis.rules import RULES, SLOW_S, Diagnosis, diagnose
from ddpwatch.state.state import ServerState

TH = Thresholds()
GIB = 1 << 30
T0 = 1000.0


def beat(state: ServerState, rank: int, at: float, **fields: object) -> None:
    """One heartbeat of a 4-rank, one-host job, applied as the collector does."""
    base: dict[str, object] = {
        "world_size": 4, "local_rank": rank, "host": "node0", "pid": 100 + rank,
        "device": f"cuda:{rank}", "device_index": rank, "device_count": 4, "step": 20,
        "avg_step_time_s": 0.1, "gpu_mem_used_bytes": 4 * GIB, "gpu_mem_total_bytes": 80 * GIB,
    }  # fmt: skip
    state.apply(Sample(v=1, rank=rank, t=0.0, **{**base, **fields}), at)  # type: ignore[arg-type]


def kinds(alerts: list) -> list[tuple[str, tuple[int, ...]]]:
    return [(a.kind, a.ranks) for a in alerts]


def test_every_rule_has_a_cadence() -> None:
    assert {r.every for r in RULES} == {"tick", "change", "slow"}
    by_name = {r.__name__: r.every for r in RULES}
    # what names a hung or dead rank must never wait for a slower cadence
    for name in ("rule_cascade", "rule_straggler", "rule_stalled", "rule_relay_lost"):
        assert by_name[name] == "tick", name


def test_a_ticking_server_first_gives_exactly_what_diagnose_gives() -> None:
    state = ServerState(started=T0)
    for rank in range(4):
        waiting = Collective(op="all_reduce", seq=9, since_s=20.0, source="py")
        counts = CollectiveCounts(py=9 if rank != 2 else 8)
        beat(state, rank, T0 + 20, collective=None if rank == 2 else waiting, collectives=counts)
    beat(state, 3, T0 + 20, gpu_mem_used_bytes=40 * GIB, device="cuda:0", device_index=0)
    expected = diagnose(state, T0 + 20.2, TH)
    assert {a.kind for a in expected} >= {"straggler", "uneven_memory", "duplicate_device"}
    assert kinds(Diagnosis()(state, T0 + 20.2, TH)) == kinds(expected)


def test_a_new_rank_on_a_taken_gpu_is_flagged_at_the_next_tick() -> None:
    state = ServerState(started=T0)
    diagnosis = Diagnosis()
    for rank in range(3):
        beat(state, rank, T0)
    assert not [a for a in diagnosis(state, T0 + 0.1, TH) if a.kind == "duplicate_device"]
    beat(state, 3, T0 + 0.2, device="cuda:1", device_index=1)  # joins on rank 1's GPU
    found = [a for a in diagnosis(state, T0 + 0.25, TH) if a.kind == "duplicate_device"]
    assert [a.ranks for a in found] == [(3,)]


def test_a_slow_rule_keeps_its_alert_until_its_next_run() -> None:
    """Memory evens out (no identity changes): ``diagnose`` clears uneven_memory at once, a
    ticking server at its next slow run, ``SLOW_S`` after the last."""
    state = ServerState(started=T0)
    for rank in range(4):
        beat(state, rank, T0, gpu_mem_used_bytes=(40 if rank == 0 else 4) * GIB)
    diagnosis = Diagnosis()
    assert ("uneven_memory", (0,)) in kinds(diagnosis(state, T0, TH))
    beat(state, 0, T0 + 0.2)  # back to 4 GiB like the others
    assert ("uneven_memory", (0,)) not in kinds(diagnose(state, T0 + 0.25, TH))
    assert ("uneven_memory", (0,)) in kinds(diagnosis(state, T0 + 0.25, TH))  # stands
    for rank in range(4):
        beat(state, rank, T0 + SLOW_S - 0.1)
    assert ("uneven_memory", (0,)) not in kinds(diagnosis(state, T0 + SLOW_S, TH))


def test_a_clock_set_back_runs_everything_again() -> None:
    state = ServerState(started=T0)
    for rank in range(4):
        beat(state, rank, T0, gpu_mem_used_bytes=(40 if rank == 0 else 4) * GIB)
    diagnosis = Diagnosis()
    diagnosis(state, T0, TH)
    for rank in range(4):
        beat(state, rank, T0 - 50)  # evened, and the server's clock went back a minute
    assert ("uneven_memory", (0,)) not in kinds(diagnosis(state, T0 - 50, TH))


def test_the_census_groups_one_collective_however_it_is_written() -> None:
    """``take_census`` groups ranks by their collective's raw fields (``WaitIndex``) and
    works out ``wait_key`` once per group; spellings of one collective still make one group,
    exactly as ``wait_key`` rank by rank groups them, from the index the state keeps as
    heartbeats arrive as from one built from the records."""
    state = ServerState(started=T0)
    spellings = [
        Collective(op="nccl:all_reduce", since_s=1.0),  # no number: grouped by op
        Collective(op="ALLREDUCE", since_s=1.0),
        Collective(op="_allreduce_base", since_s=1.0),
        Collective(op="broadcast", seq=3, since_s=1.0, source="fr", group=None),
        Collective(op="broadcast", seq=3, since_s=1.0, source="fr", group="0"),
        Collective(op="all_gather", seq=3, since_s=1.0, source="fr", group="0"),  # same number
        Collective(op="all_gather", seq=3, since_s=1.0, source="py"),
    ]
    for rank, collective in enumerate(spellings):
        beat(state, rank, T0, collective=collective)
    records = list(state.ranks.values())
    by_rank: dict[object, list[int]] = {}
    for r in records:
        assert r.collective is not None
        by_rank.setdefault(wait_key(r.collective), []).append(r.rank)
    for waits in (None, state.waits):
        census = take_census(records, T0 - 10, lambda r: False, waits)
        assert {k: list(v.members) for k, v in census.waits.items()} == by_rank
        assert list(census.waits) == list(by_rank)
    assert by_rank == {
        ("op", "allreduce"): [0, 1, 2],
        ("fr", "0", 3): [3, 4, 5],
        ("py", None, 3): [6],
    }


def test_the_thresholds_take_their_turn_with_the_paced_rules(monkeypatch: Any) -> None:
    """At 131,072 ranks the budget pays one pass over every rank a second: the job's
    step-time thresholds (a pass too) and a paced rule fell on the same tick every second,
    270 ms of it. Here 4 ranks get that budget: never two passes on one tick, and both the
    thresholds and every paced rule come round."""
    monkeypatch.setattr(rules, "RANK_SCANS_PER_S", 4)
    renewed: list[float] = []
    real = facts_module.effective_stall_after

    def counted(state: ServerState, th: Thresholds) -> float:
        renewed.append(state.received)
        return real(state, th)

    monkeypatch.setattr(facts_module, "effective_stall_after", counted)
    state = ServerState(started=T0)
    diagnosis = Diagnosis()
    ticks = 8 * (len(rules.PACED_RULES) + 2)  # two rounds of a second each
    for tick in range(ticks):
        now = T0 + tick * 0.25
        for rank in range(4):
            beat(state, rank, now)
        before = len(renewed)
        diagnosis(state, now, TH)
        passes = len(renewed) - before + sum(at == now for at in diagnosis._ran.values())
        assert passes <= 1 or tick == 0, f"tick {tick}: {passes} passes over every rank"
    assert len(renewed) >= 3  # the first tick's, and in turn
    assert set(diagnosis._ran) == {rule.__name__ for rule in rules.PACED_RULES}
