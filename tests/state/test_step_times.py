"""A rank's median step (``state/step_times.py``): one step one vote, over its whole run.

#33: the report of a run whose 3,180 steps of 3,440 took ~8 ms said "median step 0.205 s"
for every rank: a median over heartbeats, each one a vote whether it ended 62 fast steps or
one slow one."""

from __future__ import annotations

import random
import statistics

import pytest

from ddpwatch.core.protocol import Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.server.document import status_document
from ddpwatch.state.state import ServerState
from ddpwatch.state.step_times import StepTimes

T0 = 1_800_000_000.0


def test_the_median_is_every_steps_median_within_a_percent() -> None:
    rng = random.Random(7)
    for _ in range(200):
        found, steps = StepTimes(), []
        for _ in range(rng.randint(1, 80)):
            per_step = rng.choice([0.008, 0.205, 0.4, rng.uniform(0.0005, 30.0)])
            count = rng.randint(1, 70)
            found.add(per_step, count)
            steps += [per_step] * count
        assert found.steps == len(steps)
        assert found.median_s == pytest.approx(statistics.median_low(steps), rel=0.01)


def test_nothing_timed_is_no_median_and_noise_is_no_step() -> None:
    found = StepTimes()
    assert found.median_s is None
    found.add(0.0, 5)
    found.add(float("nan"), 5)
    found.add(0.1, 0)
    assert found.median_s is None and found.steps == 0


def test_a_heartbeat_times_its_steps_by_the_senders_clock() -> None:
    """Steps 2-61 in one heartbeat, 0.5 s after the one before by the sender's clock (the
    server's says 3 s: a relay held it): 60 steps of 8.3 ms. One step alone: its own time.
    Nothing for the first step, a beat that moved nothing, a counter that went back."""
    state = ServerState(started=T0)
    for step, sent, now, own in ((1, 10.0, T0, 9.0), (61, 10.5, T0 + 3, 0.01),
                                 (61, 11.0, T0 + 4, 0.01), (62, 11.2, T0 + 5, 0.3),
                                 (40, 11.7, T0 + 6, 0.01)):  # fmt: skip
        state.apply(_beat(0, step, sent, own), now)
    times = state.ranks[0].step_times
    assert times is not None and times.steps == 61
    assert times.median_s == pytest.approx(0.5 / 60)
    assert times == _times((0.5 / 60, 60), (0.3, 1))


def _times(*timed: tuple[float, int]) -> StepTimes:
    found = StepTimes()
    for per_step, steps in timed:
        found.add(per_step, steps)
    return found


def _beat(rank: int, step: int, sent: float, step_time: float) -> Sample:
    return Sample(v=1, rank=rank, t=sent, pid=100 + rank, world_size=2, step=step,
                  step_time_s=step_time)  # fmt: skip


def test_a_run_of_fast_steps_and_a_slow_tail_has_the_fast_median() -> None:
    """The newcomer's run: 3,180 steps of 8 ms (62 a heartbeat), then 260 of ~0.4 s (one a
    heartbeat, the rank waiting for its data). Most heartbeats end one slow step; most steps
    are fast: the median step is 8 ms, not the slow steps' time."""
    state = ServerState(started=T0)
    now, step = T0, 0
    for rank in (0, 1):
        state.apply(_beat(rank, 0, now, 0.008), now)
    for _ in range(52):  # 52 beats x ~61 steps of 8 ms
        now += 0.5
        step += 61
        for rank in (0, 1):
            state.apply(_beat(rank, step, now, 0.008), now)
    fast = step
    for _ in range(260):  # then one step of 0.4 s a beat
        now += 0.4
        step += 1
        for rank in (0, 1):
            state.apply(_beat(rank, step, now, 0.4), now)
    assert fast > step - fast  # most steps fast, most beats slow
    document = status_document(state, [], now, Thresholds())
    medians = [r.median_step_s for r in document.ranks]
    assert medians == [round(0.5 / 61, 6)] * 2  # one time each: exact (to the µs)
