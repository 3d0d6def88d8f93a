"""The wait index the server keeps as heartbeats arrive (``state/waits.py``) is exactly the
one built from the records, and a ticking diagnosis that reads it names exactly the ranks a
one-shot ``diagnose`` names.

The index lets a tick at 65,536 ranks read a few groups instead of regrouping every rank;
a rank misplaced in it would be a wrong culprit, so these tests replay random streams with
every change the index must follow: entering, staying in and leaving collectives, numbered
or not, spelled several ways, called with other sizes; crashes and exits inside them; a
restarted worker (a new pid) taking over its rank; silences; and judging the state as of a
time before some reports (a server behind its queue).
"""

from __future__ import annotations

import random
from typing import Any

import pytest

from ddpwatch.core.protocol import (
    AnyMessage,
    Collective,
    CollectiveCounts,
    ErrorInfo,
    Event,
    Hello,
    Sample,
)
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.rules import TICK_RULES, Diagnosis, diagnose
from ddpwatch.state.state import ServerState
from ddpwatch.state.waits import WaitIndex

TH = Thresholds()
T0 = 5000.0
WORLD = 12
COLLECTIVES = [
    Collective(op="all_reduce", seq=7, source="py", shape=[4], dtype="float32"),
    Collective(op="all_reduce", seq=7, source="py", shape=[5], dtype="float32"),  # other size
    Collective(op="broadcast", seq=7, source="py", shape=[4], dtype="float32"),  # other op
    Collective(op="all_reduce", seq=8, source="py", shape=[4], dtype="float32"),
    Collective(op="nccl:all_reduce"),  # no number: grouped by op
    Collective(op="ALLREDUCE"),
    Collective(op="all_gather", seq=3, source="fr", group="0"),
    Collective(op="all_gather", seq=3, source="fr"),  # the default group, spelled another way
    Collective(op="barrier", seq=3, source="fr", group="1"),
]
CRASH = ErrorInfo(type="RuntimeError", message="CUDA error: an illegal memory access")


def _message(rng: random.Random, rank: int, pids: dict[int, int]) -> AnyMessage:
    roll = rng.random()
    if roll < 0.03:  # the worker restarts: a new process for the rank
        pids[rank] += 1000
        return Hello(v=1, rank=rank, t=0.0, pid=pids[rank], world_size=WORLD, host="node0")
    if roll < 0.05:
        return Event(
            v=1,
            rank=rank,
            t=0.0,
            event="crash",
            error=CRASH,
            collective=rng.choice([None, *COLLECTIVES]),
        )
    if roll < 0.07:
        return Event(v=1, rank=rank, t=0.0, event="exit", exit_code=rng.choice([0, 1, -15]))
    collective = rng.choice([None, None, *COLLECTIVES])
    if collective is not None:
        collective = Collective(
            **{**_fields(collective), "since_s": round(rng.uniform(0.0, 12.0), 3)}
        )
    py = rng.choice([5, 6, 7, 8, 9])
    return Sample(
        v=1,
        rank=rank,
        t=0.0,
        pid=pids[rank],
        world_size=WORLD,
        host="node0",
        step=rng.choice([10, 11, 12]),
        collective=collective,
        collectives=rng.choice([None, CollectiveCounts(py=py, fr={"0": py - 4, "1": py - 5})]),
        pg_timeout_s=rng.choice([None, 600.0]),
    )


def _fields(c: Collective) -> dict[str, Any]:
    return {name: getattr(c, name) for name in c.__struct_fields__}


def _stream(seed: int, n: int) -> list[tuple[float, AnyMessage]]:
    rng = random.Random(seed)
    pids = {rank: 100 + rank for rank in range(WORLD)}
    at, out = T0, []
    for _ in range(n):
        at += rng.choice([0.0, 0.01, 0.3, 1.5])  # some ranks fall silent between reports
        rank = rng.randrange(WORLD)
        out.append((at, _message(rng, rank, pids)))
    return out


def snapshot(index: WaitIndex) -> dict[str, Any]:
    """What the index says, order aside: per group, its members (as record objects), when
    each began waiting and how they called it; the idle and finished ranks."""
    return {
        "groups": {
            place: (
                {rank: id(record) for rank, record in group.members.items()},
                dict(group.starts),
                group.calls(),
            )
            for place, group in index.groups.items()
        },
        "idle": {rank: id(record) for rank, record in index.idle.items()},
        "finished": {rank: id(record) for rank, record in index.finished.items()},
    }


@pytest.mark.parametrize("seed", range(12))
def test_the_kept_index_is_the_one_built_from_the_records(seed: int) -> None:
    state = ServerState(started=T0)
    for at, message in _stream(seed, 1500):
        state.apply(message, at)
        kept = state.waits
        built = WaitIndex.of(state.ranks.values())
        assert snapshot(kept) == snapshot(built)
        for place, group in kept.groups.items():  # the kept latest never goes down
            assert group.latest >= built.groups[place].latest


def _what_facts_say(facts: Facts) -> dict[str, Any]:
    census = facts.census
    straggle = facts.straggle
    mismatch = facts.mismatch
    if straggle is not None:  # its age as ``collective_age`` says, rank by rank
        ages = [r.collective_age(facts.now) for r in straggle.waiting]
        assert straggle.age == pytest.approx(max(a for a in ages if a is not None), abs=1e-9)
    return {
        "live": [r.rank for r in census.live],
        "quiet": [r.rank for r in census.quiet],
        "finished": [r.rank for r in census.finished],
        "idle": sorted(r.rank for r in census.idle),
        "waits": {key: sorted(group.members) for key, group in census.waits.items()},
        "straggle": None
        if straggle is None
        else (
            straggle.seq,
            straggle.age,
            straggle.waiting_ranks(),
            [r.rank for r in straggle.culprits],
            straggle.timeout_left,
            straggle.ops(),
        ),
        "mismatch": None
        if mismatch is None
        else (
            mismatch.key,
            [(call, sorted(r.rank for r in who)) for call, who in mismatch.calls],
            sorted(r.rank for r in mismatch.culprits),
        ),
        "blocked": sorted(facts.cascade.blocked),
        "alerts": [alert.to_dict() for alert in _tick_alerts(facts)],
    }


def _tick_alerts(facts: Facts) -> list[Any]:
    return [a for rule in TICK_RULES for a in rule(facts.state, facts.clock, facts.th, facts)]


@pytest.mark.parametrize("seed", range(12))
def test_reading_the_kept_index_names_exactly_what_a_full_pass_names(seed: int) -> None:
    """At random moments (some before the last reports: a server behind its queue judges
    the ranks as of when it last caught up), the facts every per-tick rule reads, and the
    alerts, are the same from the kept index as from one built from the records."""
    rng = random.Random(1000 + seed)
    state = ServerState(started=T0)
    checked = named = 0
    for n, (at, message) in enumerate(_stream(seed, 1200)):
        state.apply(message, at)
        if n % 7:
            continue
        now = at + rng.choice([0.0, 0.5, 3.0, 9.0, 30.0])
        state.heard_until = rng.choice([None, at, at - 1.0, at - 4.0])
        full = Facts(state, now, TH)
        kept = Facts(state, now, TH, waits=state.waits)
        said = _what_facts_say(full)
        assert _what_facts_say(kept) == said
        checked += 1
        named += bool(said["alerts"])
    assert checked > 100 and named > 10  # the streams do raise alerts to compare


def _beat(
    rank: int, step: int, py: int, collective: Collective | None = None, world: int | None = None
) -> Sample:
    return Sample(
        v=1,
        rank=rank,
        t=0.0,
        pid=100 + rank,
        world_size=world,
        host="node0",
        step=step,
        collective=collective,
        collectives=CollectiveCounts(py=py),
    )


def _hang(world: int, culprit: int, at: float) -> ServerState:
    """Every rank but ``culprit`` in all_reduce #7 for 20 s; ``culprit`` still at #6."""
    state = ServerState(started=T0)
    in_it = Collective(op="all_reduce", seq=7, source="py", since_s=20.0)
    for rank in range(world):
        stuck = rank != culprit
        state.apply(_beat(rank, 40, 7 if stuck else 6, in_it if stuck else None, world), at)
    return state


def test_a_ticking_server_names_the_straggler_as_diagnose_does_and_follows_it_out() -> None:
    state = _hang(64, culprit=41, at=T0 + 20)
    diagnosis = Diagnosis()
    expected = [(a.kind, a.ranks) for a in diagnose(state, T0 + 20.2, TH)]
    assert ("straggler", (41,)) in expected
    assert [(a.kind, a.ranks) for a in diagnosis(state, T0 + 20.2, TH)] == expected
    # the straggler enters: everyone leaves the collective, and no one is left to blame
    for rank in range(64):
        state.apply(_beat(rank, 41, 7), T0 + 20.4)
    assert not state.waits.groups
    assert [a for a in diagnosis(state, T0 + 20.5, TH) if a.kind == "straggler"] == []


def test_a_restarted_worker_takes_its_ranks_place_in_the_collective() -> None:
    state = _hang(4, culprit=3, at=T0 + 20)
    old = state.ranks[2]
    state.apply(Hello(v=1, rank=2, t=0.0, pid=9999, world_size=4, host="node0"), T0 + 20.1)
    assert state.ranks[2] is not old
    assert 2 in state.waits.idle
    assert all(2 not in group.members for group in state.waits.groups.values())
    waiting = Collective(op="all_reduce", seq=7, source="py", since_s=0.1)
    state.apply(Sample(v=1, rank=2, t=0.0, pid=9999, collective=waiting), T0 + 20.2)
    (group,) = state.waits.groups.values()
    assert group.members[2] is state.ranks[2]
    assert 2 not in state.waits.idle
