"""``slow_rank`` over heartbeats as the agent sends them (``ServerState.apply``): a rank slow
on most steps is named; a one-off stall or stop is not (issue #33, item 2: the demo's rank 1
after its 8 s stall, rank 3 after its SIGSTOP, and the "instead of ~1000000" pace)."""

from __future__ import annotations

from collections.abc import Sequence

from lockstep import NOW, TH

from ddpwatch.core.protocol import Sample
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.rules import rule_slow_rank
from ddpwatch.state.state import ServerState

BEAT_S = 0.5
COMM_S = 0.001  # the all-reduce itself, which every rank waits for


def _play(
    steps: Sequence[Sequence[float]],
    data_s: float | Sequence[float] = 0.1,
    stopped: tuple[int, int] | None = None,
    split: bool = True,
) -> list[Alert]:
    """A DDP job whose ranks compute ``steps[n][r]`` seconds in step n+1 after ``data_s`` of
    waiting for data (one for all, or per rank) (the demo's sleep between steps), then wait in DDP's all-reduce for the
    last of them. Heartbeats every 0.5 s carry the averages of the steps that ended since the
    last one (else repeat it, as the agent does); ``stopped`` = (rank, step index): that rank
    sends nothing while that step lasts (SIGSTOP); ``split``: the agent times DDP's wait
    (else only a Python-level all-reduce's: an agent without the step split). The rule runs
    every second; returns every alert it raised."""
    world = len(steps[0])
    data = [data_s] * world if isinstance(data_s, float) else list(data_s)
    state = ServerState(started=NOW - 1000)
    ends, t = [], NOW
    for own in steps:
        t += _step_s(data, own)
        ends.append(t)
    sent: list[Sample | None] = [None] * world
    done, avg = 0, [0.1] * world
    found: list[Alert] = []
    beat = NOW + BEAT_S
    while beat <= ends[-1]:
        first, done = done, sum(1 for end in ends if end <= beat)
        for r in range(world):
            if stopped is not None and r == stopped[0] and _within(ends, stopped[1], beat):
                continue
            if done > first:
                sent[r], avg[r] = _averages(r, steps[first:done], (data, split), done, avg[r])
            if sent[r] is not None:
                state.apply(sent[r], beat)  # type: ignore[arg-type]
        if round((beat - NOW) / BEAT_S) % 2 == 0:
            found += rule_slow_rank(state, beat + 0.01, TH)
        beat += BEAT_S
    return found


def _within(ends: list[float], index: int, t: float) -> bool:
    start = ends[index - 1] if index else NOW
    return start < t <= ends[index] + BEAT_S  # and the beat after: it was still stopped


def _step_s(data: Sequence[float], own: Sequence[float]) -> float:
    """A step's time: until the last rank, its data and compute done, ends the all-reduce."""
    return max(d + o for d, o in zip(data, own, strict=True)) + COMM_S


def _averages(
    r: int,
    steps: Sequence[Sequence[float]],
    how: tuple[Sequence[float], bool],
    step: int,
    avg: float,
) -> tuple[Sample, float]:
    """Rank ``r``'s heartbeat after ``steps`` ended: per-step averages, as the agent sends
    them (the last step's wait in Python-level collectives, without the step split)."""
    data, split = how
    times = [_step_s(data, own) for own in steps]
    waits = [t - data[r] - own[r] for t, own in zip(times, steps, strict=True)]
    for t in times:
        avg += 0.1 * (t - avg)
    grad = sum(waits) / len(steps)
    compute = sum(t - w for t, w in zip(times, waits, strict=True)) / len(steps)
    sample = Sample(
        v=1, rank=r, t=0.0, world_size=len(steps[0]), host="node0", pid=100 + r, step=step,
        step_time_s=times[-1], avg_step_time_s=avg, data_wait_s=data[r],
        collective_time_s=0.0 if split else waits[-1],
        grad_wait_s=grad if split else None, compute_s=compute if split else None,
    )  # fmt: skip
    return sample, avg


def _steady(
    n: int, world: int = 4, late: tuple[int, float] | None = None, own_s: float = 0.02
) -> list[list[float]]:
    """``n`` steps of ``own_s`` compute (``late``: one rank that much longer every step)."""
    own = [own_s] * world
    if late is not None:
        own[late[0]] += late[1]
    return [list(own) for _ in range(n)]


def test_one_stall_then_normal_steps_is_no_slow_rank() -> None:
    """The demo: rank 1 sleeps 8 s once (the straggler alert's business), then steps like
    the others. It was named "~262 ms after ranks 0, 2, 3 every step" for many seconds."""
    stall = _steady(1)
    stall[0][1] += 8.0
    found = _play(_steady(100) + stall + _steady(200))
    assert found == [], [a.message for a in found]


def test_a_stopped_rank_is_no_slow_rank_once_it_resumes() -> None:
    """The demo: rank 3 SIGSTOP'd for 14 s, silent, then resumed. It was named "~1123 ms
    after ranks 0-2 every step ... 4.1 steps/s instead of ~1000000"."""
    stop = _steady(1)
    stop[0][3] += 14.0
    found = _play(_steady(100) + stop + _steady(200), stopped=(3, 100))
    assert found == [], [a.message for a in found]


def test_a_rank_late_every_step_is_named() -> None:
    found = _play(_steady(200, late=(2, 0.2)))
    assert found, "never named"
    assert {a.ranks for a in found} == {(2,)}
    assert found[-1].message == (
        "rank 2 enters DDP's gradient all-reduce ~200 ms after ranks 0, 1, 3 every step (its "
        "compute takes 320 ms, theirs 120 ms): the job runs at 3.1 steps/s instead of ~8.3"
    )
    assert found[-1].hint.startswith("rank 2 computes slower than the others")


def test_data_waits_alike_are_not_the_slow_ranks_fix() -> None:
    """Every rank waits 100 ms for data (the demo's sleep): the slow rank is not told to
    give its DataLoader more workers (the demo's rank 1 was, live)."""
    found = _play(_steady(200, late=(2, 0.15)), split=False)
    assert found and {a.ranks for a in found} == {(2,)}
    assert "for data" not in found[-1].hint, found[-1].hint


def test_a_data_wait_of_its_own_is_the_slow_ranks_fix() -> None:
    """Only the slow rank waits for data, 150 ms a step: its median wait is the hint's."""
    found = _play(_steady(200), data_s=(0.0, 0.0, 0.15, 0.0), split=False)
    assert found and {a.ranks for a in found} == {(2,)}
    assert found[-1].hint == (
        "rank 2 waits 150 ms per step for data, the others 0 ms: give its DataLoader more "
        "workers or faster storage"
    )


def test_a_rank_late_after_a_stall_is_named_on_the_steps_after_it() -> None:
    """A stall first, then a rank really slow every step: named from fresh evidence."""
    stall = _steady(1)
    stall[0][1] += 8.0
    found = _play(_steady(50) + stall + _steady(200, late=(1, 0.2)))
    assert found and {a.ranks for a in found} == {(1,)}
    assert "~200 ms after" in found[-1].message


def test_no_pace_without_steps_of_the_others_own() -> None:
    """The others' steps are all waiting (their own work ~0): the pace without the slow
    rank cannot be told, so no "instead of ~1000" (or ~1000000) steps/s."""
    found = _play(_steady(200, late=(2, 0.2), own_s=0.0), data_s=0.0)
    assert found and {a.ranks for a in found} == {(2,)}
    assert found[-1].message.endswith(": the job runs at 5.0 steps/s"), found[-1].message
