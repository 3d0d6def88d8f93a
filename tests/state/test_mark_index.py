"""The marks' tally the server keeps as heartbeats arrive (``state/marks.py``) is exactly the
one built from the records, and the desync rules that read it raise exactly the alerts they
raise from a pass over every rank; so are the ranks flagged unstepped or non-finite
(``state/flags.py``), which the start-up and NaN rules read.

A value left in the tally after its record left would hide a desync (the tally would show two
values where the live ranks agree, or one where they do not); a mark missed, the same. The
streams below change everything the tally follows: marks of every kind, arriving in
overlapping windows, now and then with a rank that skipped or added one; a restarted worker
(a new pid) starting its marks afresh; a launcher's new attempt; crashes, exits, silences.
"""

from __future__ import annotations

import math
import random

import pytest

from ddpwatch.core.protocol import AnyMessage, CollectiveCounts, ErrorInfo, Event, Hello, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.rules import (
    rule_backward_desync,
    rule_batch_desync,
    rule_collective_arguments,
    rule_collective_desync,
    rule_evaluation_desync,
    rule_nan_loss,
    rule_startup_hang,
)
from ddpwatch.state.flags import RankFlags
from ddpwatch.state.marks import MARK_KINDS, MARKS_KEPT, MarkIndex
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState

TH = Thresholds()
T0 = 9000.0
WORLD = 7
KEPT_RULES = (
    rule_nan_loss,
    rule_startup_hang,
    rule_collective_desync,
    rule_collective_arguments,
    rule_evaluation_desync,
    rule_batch_desync,
    rule_backward_desync,
)


def _marks(rng: random.Random, step: int, odd: int) -> list[tuple[int, int]]:
    """A rank's last few marks up to ``step`` (every 8th), its counts ``odd`` off the
    others' from step 40 on."""
    last = step - step % 8
    first = max(0, last - 8 * rng.randrange(1, 6))
    return [(s, 3 * s + (odd if s >= 40 else 0)) for s in range(first, last + 1, 8)]


def _message(
    rng: random.Random, rank: int, pids: dict[int, int], attempt: list[int], job_step: int
) -> AnyMessage:
    """A message of ``rank``'s, whose step is a little behind the job's (lockstep)."""
    roll = rng.random()
    base = {"v": 1, "rank": rank, "t": 0.0}
    if roll < 0.03:  # the worker restarts: a new process, with no marks yet
        pids[rank] += 1000
        return Hello(**base, pid=pids[rank], world_size=WORLD)
    if roll < 0.04:  # the launcher starts its next attempt
        attempt[0] += 1
        pids[rank] += 1000
        return Hello(**base, pid=pids[rank], world_size=WORLD, restart_count=attempt[0] - 1)
    if roll < 0.06:
        error = ErrorInfo(type="RuntimeError", message="boom")
        return Event(**base, event=rng.choice(["crash", "exit"]), error=error, step=job_step)
    if roll < 0.1:  # still starting: no step yet
        return Sample(**base, pid=pids[rank], phase="init_process_group")
    step = max(0, job_step - rng.randrange(12))
    bad = rng.random() < 0.05 and rank == 2  # rank 2's loss or gradients go bad now and then
    health = {
        "loss": math.nan if bad and rng.random() < 0.5 else 1.0,
        "grad_nan_step": step if bad else None,
    }
    odd = 1 if rank == 5 and rng.random() < 0.5 else 0  # rank 5 is off now and then
    kinds = {
        "batch_marks": _marks(rng, step, odd),
        "backward_marks": _marks(rng, step, odd if rng.random() < 0.5 else 0),
        "eval_sync_marks": _marks(rng, step, 0),
    }
    counts = CollectiveCounts(
        py=step, marks=_marks(rng, step, odd), digests=_marks(rng, step, rank == 4)
    )
    chosen = {k: v for k, v in kinds.items() if rng.random() < 0.8}
    return Sample(**base, pid=pids[rank], step=step, collectives=counts, **chosen, **health)


def _tallies(index: MarkIndex) -> dict[str, dict[int, dict[int, int]]]:
    return {
        kind: {step: dict(values) for step, values in tally.items()}
        for kind, tally in index._tallies.items()
    }


@pytest.mark.parametrize("seed", range(12))
def test_the_kept_tally_is_the_one_built_from_the_records(seed: int) -> None:
    rng = random.Random(seed)
    state = ServerState(started=T0)
    pids = {r: 100 + r for r in range(WORLD)}
    attempt = [1]
    now = T0
    raised = 0
    for n in range(700):
        now += rng.choice([0.001, 0.01, 0.3])
        rank = rng.randrange(WORLD)
        if rng.random() < 0.1 and rank % 3 == 0:
            continue  # some ranks go quiet for a while
        state.apply(_message(rng, rank, pids, attempt, n // 2), now)
        assert _tallies(state.marks) == _tallies(MarkIndex.of(state.ranks.values()))
        flags = RankFlags.of(state.ranks.values())
        assert (state.flags.unstepped, state.flags.non_finite) == (
            flags.unstepped,
            flags.non_finite,
        )
        assert all(len(getattr(r, k)) <= MARKS_KEPT for r in state.ranks.values() for k in MARK_KINDS)
        if n % 10 == 0:
            judged = now + rng.choice([0.0, 3.0, 40.0])  # silences count too
            kept_indexes = (state.waits, state.devices, state.marks, state.flags)
            kept = Facts(state, judged, TH, None, *kept_indexes)
            for rule in KEPT_RULES:
                found = rule(state, judged, TH, kept)
                assert found == rule(state, judged, TH), rule.__name__
                raised += len(found)
    assert raised, "the stream never made a desync rule speak: it tests only agreement"


def _record(rank: int, **marks: dict[int, int]) -> RankRecord:
    record = RankRecord(rank=rank, first_seen=T0, last_seen=T0, last_progress=T0)
    for kind, kept in marks.items():
        setattr(record, kind, kept)
    return record


def test_agreement_is_read_at_the_latest_step_every_live_rank_has_marked() -> None:
    agreeing = [_record(r, step_marks={8: 5, 16: 9}) for r in range(3)]
    ahead = _record(3, step_marks={8: 5, 16: 9, 24: 12})
    index = MarkIndex.of([*agreeing, ahead])
    assert index.agreed("step_marks", 4, [])  # step 24 is held by one: step 16 counts
    odd = _record(4, step_marks={8: 5, 16: 10})
    index = MarkIndex.of([*agreeing, ahead, odd])
    assert not index.agreed("step_marks", 5, [])
    assert index.agreed("step_marks", 4, [odd])  # rank 4 crashed: the live ones agree
    assert not index.agreed("step_marks", 4, [agreeing[0]])  # rank 0 did: rank 4 is odd
    assert index.agreed("drawn_marks", 5, [])  # nobody marked batches: nothing to compare
    unmarked = _record(5)
    index = MarkIndex.of([*agreeing, odd, unmarked])
    assert index.agreed("step_marks", 5, [])  # a live rank with no marks: no common step


def test_a_heartbeat_folds_only_the_marks_it_adds_and_keeps_the_newest() -> None:
    index = MarkIndex()
    record = _record(0)
    index.keep(record, "step_marks", [(8, 1), (16, 2)])
    index.keep(record, "step_marks", [(8, 1), (16, 2), (24, 3)])
    assert record.step_marks == {8: 1, 16: 2, 24: 3}
    index.keep(record, "step_marks", [(s, s) for s in range(32, 32 + 8 * MARKS_KEPT, 8)])
    assert len(record.step_marks) == MARKS_KEPT and min(record.step_marks) == 32
    assert _tallies(index) == _tallies(MarkIndex.of([record]))
    index.drop(record)
    assert _tallies(index) == _tallies(MarkIndex())
