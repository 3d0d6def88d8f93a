"""The progress family (``diagnosis/rules/progress.py``): stalled ranks, step skew, the first
non-finite loss, skipped batches, slow ranks and checkpoint conflicts."""

from __future__ import annotations

import math
from typing import Any

import pytest
from lockstep import (
    NOW,
    STACK,
    TH,
    beats,
    job,
    kinds,
    only,
    rank,
    state_of,
    waiting_in,
)

from ddpwatch.core.protocol import Sample
from ddpwatch.diagnosis.rules import (
    diagnose,
    rule_backward_desync,
    rule_batch_desync,
    rule_checkpoint_conflict,
    rule_nan_loss,
    rule_slow_rank,
    rule_stalled,
    rule_step_skew,
)
from ddpwatch.state.state import ServerState


def test_stalled_exact_message() -> None:
    state = job(4, step=311)
    state.ranks[2] = rank(2, step=311, stack=STACK, last_progress=NOW - 14.2)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.severity, a.ranks) for a in alerts] == [("stalled", "error", (2,))]
    assert alerts[0].message == (
        "rank 2 has made no progress for 14.2 s at step 311 in phase 'forward', train.py:88"
    )


@pytest.mark.parametrize(
    "changes",
    [
        {"last_progress": NOW - 5},  # not long enough
        {"last_progress": NOW - 14, "step": None},  # still starting: startup_hang's business
        {"last_progress": NOW - 14, **waiting_in("all_reduce", 3, 0.01)},  # in a collective
        {"last_progress": NOW - 14, "avg_step_time_s": 8.0},  # slow steps: 5 x median 4.05 s
    ],
)
def test_stalled_quiet(changes: dict[str, Any]) -> None:
    state = job(2)
    state.ranks[1] = rank(1, 2, **changes)
    assert rule_stalled(state, NOW, TH) == []


def test_every_rank_compiling_is_no_stall_however_long() -> None:
    """Issue #32: a cold torch.compile on every rank (~20 s on 2 cores, minutes on a large
    model) was a ``stalled`` error, raised and cleared 16 times in 15 s as its ranks changed."""
    state = job(3, step=1, phase="compiling", phase_since=NOW - 30, last_progress=NOW - 30)
    assert rule_stalled(state, NOW, TH) == []
    assert diagnose(state, NOW, TH) == []  # nor any other alert naming ranks
    minutes = job(3, step=1, phase="compiling", phase_since=NOW - 600, last_progress=NOW - 600)
    assert diagnose(minutes, NOW, TH) == []
    state.ranks[2] = rank(2, 3, step=1, phase="backward", last_progress=NOW - 30)  # stuck
    assert only(rule_stalled(state, NOW, TH), "stalled").ranks == (2,)


def test_a_compile_that_ends_is_progress() -> None:
    """Leaving 'compiling' after 16 s (a cold inductor cache) is no stall until the step
    ends: seen as one 'stalled' alert, raised and cleared within 0.25 s."""
    state = ServerState(started=NOW - 60)
    for at, phase in ((NOW - 16.0, "compiling"), (NOW - 0.1, "backward")):
        for r in range(2):
            state.apply(Sample(v=1, rank=r, t=at, world_size=2, phase=phase, step=1), at)
    assert state.ranks[0].last_progress == NOW - 0.1
    assert rule_stalled(state, NOW, TH) == []


def test_stalled_many_ranks_is_one_alert() -> None:
    state = job(16, last_progress=NOW - 30)
    alert = only(rule_stalled(state, NOW, TH), "stalled")
    assert alert.ranks == tuple(range(16))
    assert alert.message.startswith("ranks 0-15 have made no progress for up to 30.0 s")


def test_step_skew() -> None:
    state = job(4)
    state.ranks[3] = rank(3, step=450)
    alert = only(rule_step_skew(state, NOW, TH), "step_skew")
    assert (alert.severity, alert.ranks) == ("warning", (3,))
    assert "50 steps behind rank 0" in alert.message
    state.ranks[3] = rank(3, step=490)  # within 3 + (0.5 + 0.5) / 0.1 = 13 steps
    assert rule_step_skew(state, NOW, TH) == []


@pytest.mark.parametrize(
    "outsider",
    [
        {"step": None},  # no step yet
        {"step": 100, "last_seen": NOW - 1.8},  # heard, but before the last two heartbeats
        {"step": 100, "last_progress": NOW - 60.0},  # idle past the stall threshold
    ],
)
def test_step_skew_names_the_same_rank_whichever_ranks_it_leaves_out(
    outsider: dict[str, Any],
) -> None:
    """Most runs find every live rank fresh and stepping, which one C loop per field tells;
    a rank whose step is no evidence of where it is now is left out, and the rank behind is
    named in the same words."""
    state = job(5)
    state.ranks[3] = rank(3, world=5, step=450)
    expected = only(rule_step_skew(state, NOW, TH), "step_skew")
    assert (expected.ranks, "50 steps behind rank 0" in expected.message) == ((3,), True)
    state.ranks[4] = rank(4, world=5, **outsider)
    assert rule_step_skew(state, NOW, TH) == [expected]
    state.ranks[3] = rank(3, world=5, step=495)  # in lockstep again: nobody behind
    assert rule_step_skew(state, NOW, TH) == []


def test_step_skew_allows_for_a_server_behind_its_queue() -> None:
    """``benchmarks/scale.py`` with 65,536 ranks for 60 s through per-node relays, on a server
    short of CPU: it had read some relays' backlogs further than others', so the heartbeats it
    held were sent up to its lag apart, and step_skew named 64,287 lockstep ranks behind the
    freshest. Steps sampled that far apart are no evidence of a skew; a gap larger than the
    lag explains still is."""
    state = job(4)  # step 500, 0.1 s steps
    state.heard_until = NOW - 20.0  # its queue last found empty 20 s ago
    state.ranks[3] = rank(3, step=350)  # last heard 15 s of steps before the others
    assert rule_step_skew(state, NOW, TH) == []
    state.ranks[3] = rank(3, step=250)  # 3 + (0.5 + 0.5 + 20) / 0.1 = 213 steps at most
    assert only(rule_step_skew(state, NOW, TH), "step_skew").ranks == (3,)
    state.heard_until = None  # caught up: the 50-step gap of test_step_skew is one again
    state.ranks[3] = rank(3, step=450)
    assert only(rule_step_skew(state, NOW, TH), "step_skew").ranks == (3,)


def test_step_skew_reads_each_ranks_step_at_the_time_its_sender_dated_it() -> None:
    """``scale.py --node-fault late``: one node's frames spend 2 s in transit, which no age
    from its relay says, and step_skew named its 8 lockstep ranks 8 steps behind the others.
    By the senders' clocks their steps are 2 s older than the leads': 20 steps at 0.1 s. A
    gap that the dates do not explain is still named, in the same words; a sender whose clock
    runs ahead is never made to look further behind."""
    state = job(4, timed_step=500, timed_sent=NOW - 0.3)
    state.ranks[3] = rank(3, step=480, timed_step=480, timed_sent=NOW - 2.3)
    assert rule_step_skew(state, NOW, TH) == []  # 20 steps behind, dated 2 s earlier
    state.ranks[3] = rank(3, step=480)  # the same gap, undated (an older agent, a replay)
    assert only(rule_step_skew(state, NOW, TH), "step_skew").ranks == (3,)
    state.ranks[3] = rank(3, step=450, timed_step=450, timed_sent=NOW - 2.3)
    alert = only(rule_step_skew(state, NOW, TH), "step_skew")  # 50 behind: 30 unexplained
    assert alert.ranks == (3,) and "up to 50 steps behind rank 0" in alert.message
    state.ranks[3] = rank(3, step=480, timed_step=480, timed_sent=NOW + 5.0)  # clock ahead
    assert only(rule_step_skew(state, NOW, TH), "step_skew").ranks == (3,)


def test_nan_loss_message() -> None:
    state = job(4)
    state.ranks[2] = rank(2, loss=math.nan, nan_step=311)
    alert = only(diagnose(state, NOW, TH), "nan_loss")
    assert alert.message == "rank 2 loss is nan since step 311 while ranks 0, 1, 3 are finite"
    everywhere = job(2, loss=math.inf, nan_step=7)
    alert = only(rule_nan_loss(everywhere, NOW, TH), "nan_loss")
    assert alert.message == "ranks 0, 1 loss is inf since step 7"
    assert rule_nan_loss(job(2), NOW, TH) == []


def test_nan_loss_names_the_rank_that_went_bad_first() -> None:
    state = job(3, loss=math.nan, nan_step=9, nan_exact=True)
    state.ranks[1] = rank(1, 3, loss=math.nan, nan_step=8, nan_exact=True)  # DDP spread it
    alert = only(rule_nan_loss(state, NOW, TH), "nan_loss")
    assert (alert.ranks, alert.waiting) == ((1,), (0, 2))
    assert alert.message == "rank 1 loss is nan since step 8 and ranks 0, 2 followed from step 9"


def test_nan_loss_from_heartbeat_steps_only_names_no_first_rank() -> None:
    """The issue's report: heartbeats sample the loss every ~20 steps, so a heartbeat's step
    is only a bound on the first bad one, and an order between ranks cannot be read from it."""
    state = job(3, loss=math.nan, nan_step=9)
    state.ranks[1] = rank(1, 3, loss=math.nan, nan_step=8)
    alert = only(rule_nan_loss(state, NOW, TH), "nan_loss")
    assert (alert.ranks, alert.waiting) == ((), (0, 1, 2))
    assert "which rank went first is not known" in alert.message


def test_nan_loss_waits_for_a_rank_that_has_not_reported_past_the_step() -> None:
    """Rank 0's NaN (spread from rank 1) arrives before rank 1's own report: say nothing until
    rank 1, still last heard at step 10, reports past step 16."""
    state = job(3, step=20)
    state.ranks[0] = rank(0, 3, step=20, loss=math.nan, nan_step=16, nan_exact=True)
    state.ranks[1] = rank(1, 3, step=10)
    assert rule_nan_loss(state, NOW, TH) == []
    state.ranks[1] = rank(1, 3, step=20, loss=math.nan, nan_step=15, nan_exact=True)
    alert = only(rule_nan_loss(state, NOW, TH), "nan_loss")
    assert (alert.ranks, alert.waiting) == ((1,), (0,))


def test_a_rank_not_yet_heard_past_the_step_after_is_not_called_finite() -> None:
    """Rank 1's gradients went bad at step 15; DDP puts them in every rank's step 16. Rank 0,
    last heard at step 15, may be NaN already: "while rank 0 is finite" was said of it under
    load, its NaN report a moment behind. Once it reports step 16 finite, it is."""
    state = job(3, step=15)
    state.ranks[1] = rank(1, 3, step=16, loss=math.nan, nan_step=16, grad_nan_step=15, nan_exact=True)
    state.ranks[2] = rank(2, 3, step=16, loss=math.nan, nan_step=16, nan_exact=True)
    alert = only(rule_nan_loss(state, NOW, TH), "nan_loss")
    assert alert.ranks == (1,) and "finite" not in alert.message.split("(its loss was finite)")[1]
    state.ranks[0] = rank(0, 3, step=16)
    alert = only(rule_nan_loss(state, NOW, TH), "nan_loss")
    assert alert.message.endswith("while rank 0 is finite")


def test_nan_loss_names_the_rank_whose_own_gradients_went_bad_first() -> None:
    """A bad sample gives rank 2 infinite gradients from a finite loss at step 14; DDP's
    all-reduce spreads them, and every loss, rank 2's too, is NaN from step 15: by losses alone
    all three tie. Rank 2's own gradients, before the all-reduce, name it."""
    spread = {"step": 20, "loss": math.nan, "nan_step": 15, "nan_exact": True}
    state = job(3, grad_nan_step=15, **spread)
    state.ranks[2] = rank(2, 3, grad_nan_step=14, **spread)
    alert = only(rule_nan_loss(state, NOW, TH), "nan_loss")
    assert (alert.ranks, alert.waiting) == ((2,), (0, 1))
    assert alert.message == (
        "rank 2's own gradients were not finite at step 14 (its loss was finite); ranks 0, 1 "
        "received them through DDP's all-reduce and their loss is nan since step 15"
    )
    assert "rank 2 at step 14" in alert.hint
    # its own loss not reported bad yet: still the origin
    state.ranks[2] = rank(2, 3, step=20, loss=1.0, grad_nan_step=14)
    assert only(rule_nan_loss(state, NOW, TH), "nan_loss").ranks == (2,)
    # without gradient reports, the old answer: a tie at step 15, all three named
    assert only(rule_nan_loss(job(3, **spread), NOW, TH), "nan_loss").ranks == (0, 1, 2)


def test_nan_loss_from_gradients_waits_for_ranks_not_past_the_step() -> None:
    """Rank 0 still last heard at step 13: its own gradients of step 14 are not known, and it
    may be an origin too. Nothing is said until it reports step 14."""
    spread = {"step": 20, "loss": math.nan, "nan_step": 15, "nan_exact": True}
    state = job(3, grad_nan_step=15, **spread)
    state.ranks[2] = rank(2, 3, grad_nan_step=14, **spread)
    state.ranks[0] = rank(0, 3, step=13)
    assert rule_nan_loss(state, NOW, TH) == []
    state.ranks[0] = rank(0, 3, grad_nan_step=14, **spread)  # both, on their own
    alert = only(rule_nan_loss(state, NOW, TH), "nan_loss")
    assert (alert.ranks, alert.waiting) == ((0, 2), (1,))
    assert alert.message.startswith("the own gradients of ranks 0, 2 were not finite at step 14")


def test_gradients_alone_raise_no_nan_alert() -> None:
    """Infinite gradients with finite losses everywhere: a GradScaler's overflow, which it
    skips; nothing spread."""
    state = job(3, step=20)
    state.ranks[1] = rank(1, 3, step=20, grad_nan_step=19)
    assert rule_nan_loss(state, NOW, TH) == []


def test_a_loss_that_went_bad_before_any_gradient_keeps_its_message() -> None:
    state = job(3, loss=math.nan, nan_step=9, nan_exact=True, grad_nan_step=9)
    state.ranks[1] = rank(1, 3, loss=math.nan, nan_step=8, nan_exact=True, grad_nan_step=8)
    alert = only(rule_nan_loss(state, NOW, TH), "nan_loss")
    assert (alert.ranks, alert.waiting) == ((1,), (0, 2))
    assert alert.message == "rank 1 loss is nan since step 8 and ranks 0, 2 followed from step 9"


def test_a_relay_that_dies_changes_no_verdict_about_its_ranks() -> None:
    """#26: a healthy job of 3 ranks at 40 steps/s reports through its node's relay, which is
    killed. Ranks 1, 2 are back on the direct path at once, rank 0 only 2.6 s later (its
    relayed step the last news of it until then): step_skew named rank 0 "114 steps behind
    rank 1" in 3 of 3 runs. A step sent that long ago says nothing of where a rank is now."""
    state = ServerState(started=NOW - 60)

    def beat(rank: int, at: float, relayed: bool) -> None:
        state.apply(
            Sample(v=1, rank=rank, t=at, pid=100 + rank, world_size=3, phase="forward",
                   step=int((at - NOW + 60) * 40), step_time_s=0.025, avg_step_time_s=0.025),
            at,
        )  # fmt: skip
        state.ranks[rank].relayed = relayed

    t = NOW - 20.0
    while t <= NOW - 2.5:  # the relay's last batch: every rank at the same step
        for r in range(3):
            beat(r, t, relayed=True)
        t += 0.5
    for at in (NOW - 2.6, NOW - 2.1, NOW - 1.6, NOW - 1.1, NOW - 0.6, NOW - 0.1):
        for r in (1, 2):
            beat(r, at, relayed=False)
    named = [a for a in diagnose(state, NOW, TH) if a.ranks]
    assert named == [], [a.message for a in named]
    beat(0, NOW + 0.1, relayed=False)  # its first heartbeat on the new path
    named = [a for a in diagnose(state, NOW + 0.2, TH) if a.ranks]
    assert named == [], [a.message for a in named]


def test_a_rank_that_skipped_a_batch_is_named_though_its_steps_agree() -> None:
    """PyTorch #44353 in a loop whose only collective is DDP's all-reduce: rank 1 caught an
    exception and skipped batch 20. Its steps and all-reduces still pair up with the others'
    (no collective count differs, no step gap), but by step 24 it has drawn 25 batches from
    its DataLoader where they drew 24."""
    marks = {8: 8, 16: 16, 24: 24}
    state = job(3, drawn_marks=dict(marks))
    assert rule_batch_desync(state, NOW, TH) == []  # in step: nothing to say
    state.ranks[1] = rank(1, 3, drawn_marks={8: 8, 16: 16, 24: 25})
    alert = only(rule_batch_desync(state, NOW, TH), "step_skew")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (1,), (0, 2))
    assert alert.message.startswith(
        "rank 1 had drawn 1 batch more than ranks 0, 2 from its DataLoader by step 24 (25 "
        "against 24)"
    ), alert.message
    assert "skip on every rank together" in alert.hint


@pytest.mark.parametrize(
    "marks",
    [
        [{8: 8}, {8: 9}],  # two ranks: which one is odd cannot be told
        [{8: 8}, {8: 8}, {8: 9}, {8: 9}],  # a tie
        [{8: 8, 16: 16}, {8: 8, 16: 16}, {8: 8}],  # a rank that has not marked step 16 yet
    ],
)
def test_batch_marks_name_nobody_without_a_clear_majority(marks: list[dict[int, int]]) -> None:
    state = state_of(*(rank(r, len(marks), drawn_marks=m) for r, m in enumerate(marks)))
    assert rule_batch_desync(state, NOW, TH) == []


def test_a_rank_with_another_number_of_backwards_per_step_is_named_without_a_dataloader() -> None:
    """Synthetic data, no DataLoader to count: rank 1 skipped its optimizer step after a
    backward at step 20 (a skip decided on its own loss: NVIDIA-NeMo/Automodel #2468), so by
    its step 24 it has run 25 backwards where the others ran 24; an uneven accumulation
    under no_sync shows the same way, more per step."""
    marks = {8: 8, 16: 16, 24: 24}
    state = job(3, backwards_marked=dict(marks))
    assert rule_backward_desync(state, NOW, TH) == []  # in step: nothing to say
    state.ranks[1] = rank(1, 3, backwards_marked={8: 8, 16: 16, 24: 25})
    alert = only(rule_backward_desync(state, NOW, TH), "step_skew")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (1,), (0, 2))
    assert alert.message.startswith(
        "rank 1 had run 1 backward pass more than ranks 0, 2 by step 24 (25 against 24) while "
        "its steps still pair up with theirs"
    ), alert.message
    assert "skip on every rank together" in alert.hint
    # where the DataLoaders tell it, they say it (one alert, the batch count's)
    for r, drawn in ((0, 24), (1, 25), (2, 24)):
        state.ranks[r].drawn_marks = {24: drawn}
    assert rule_backward_desync(state, NOW, TH) == []
    assert only(rule_batch_desync(state, NOW, TH), "step_skew").ranks == (1,)


def test_the_same_accumulation_on_every_rank_names_nobody() -> None:
    """4 micro-batches a step on every rank (3 under no_sync): 4 backwards a step each."""
    state = job(3, backwards_marked={8: 32, 16: 64, 24: 96})
    assert rule_backward_desync(state, NOW, TH) == []


def test_step_skew_after_a_pause_uses_the_current_step_rate() -> None:
    # the average still holds a 20 s pause; the job now runs 20 steps/s again
    state = job(3, avg_step_time_s=1.0, step_time_s=0.05)
    state.ranks[1] = rank(1, 3, step=490, avg_step_time_s=1.0, step_time_s=0.05)
    assert rule_step_skew(state, NOW, TH) == []


def test_slow_rank() -> None:
    state = job(4, beats=beats(step=0.2, waited=0.1))
    state.ranks[3] = rank(3, beats=beats(step=0.2, waited=0.01))
    alert = only(diagnose(state, NOW, TH), "slow_rank")
    assert alert.ranks == (3,) and alert.waiting == (0, 1, 2)
    assert alert.message == (
        "rank 3 enters its collectives ~90 ms after ranks 0-2 every step: the job runs at "
        "5.0 steps/s instead of ~9.1"
    )


@pytest.mark.parametrize(
    "times",
    [
        (0.10, 0.10, 0.09, 0.11),  # balanced
        (0.01, 0.01, 0.001, 0.01),  # collectives are a small share of the 0.2 s step
        (0.10, 0.10, 0.01, 0.01),  # half the ranks "slow": not one straggling rank
    ],
)
def test_slow_rank_quiet(times: tuple[float, ...]) -> None:
    state = state_of(*(rank(r, beats=beats(step=0.2, waited=t)) for r, t in enumerate(times)))
    assert rule_slow_rank(state, NOW, TH) == []


def test_slow_rank_waits_for_windows_past_warm_up() -> None:
    """9 heartbeats still hold the first steps (DataLoader workers starting): say nothing
    yet, as seen on a healthy rank 0 just before another rank's real fault."""
    state = job(4, beats=beats(9, step=0.2, waited=0.1))
    state.ranks[3] = rank(3, beats=beats(9, step=0.2, waited=0.01))
    assert rule_slow_rank(state, NOW, TH) == []
    state.ranks[3].beats = beats(10, step=0.2, waited=0.01)
    assert rule_slow_rank(state, NOW, TH) == []  # the others' windows are young still


def test_slow_rank_counts_the_heartbeats_a_paced_relays_beats_stand_for() -> None:
    """Through relays at pace 4, each beat is a rank's newest of 4 heartbeats: 5 beats stand
    for 20 and settle, as 10 direct ones do; 4 (16 heartbeats) are too few for a median, and
    5 direct ones too young."""
    for n, pace, named in ((5, 4.0, True), (4, 4.0, False), (5, 1.0, False), (5, 2.0, True)):
        state = job(4, beats=beats(n, step=0.2, waited=0.1, gap=0.5 * pace, stands_for=pace))
        state.ranks[3] = rank(
            3, beats=beats(n, step=0.2, waited=0.01, gap=0.5 * pace, stands_for=pace)
        )
        assert kinds(rule_slow_rank(state, NOW, TH)) == (["slow_rank"] if named else []), n


def test_slow_rank_names_no_paced_rank_on_a_minority_of_its_beats() -> None:
    """Five paced beats, two of them short waits (jitter, or the last to arrive twice): the
    median still waits as the others do."""
    window = beats(3, step=0.2, waited=0.1, gap=2.0, stands_for=4.0)
    window += beats(2, step=0.2, waited=0.01, gap=2.0, stands_for=4.0)
    state = job(4, beats=beats(5, step=0.2, waited=0.1, gap=2.0, stands_for=4.0))
    state.ranks[3] = rank(3, beats=window)
    assert rule_slow_rank(state, NOW, TH) == []


def test_slow_rank_counts_no_beat_before_an_episode() -> None:
    """A step gap past the collective limit (a stall, a stop) starts every window afresh:
    10 beats of rank 3 lagging before it, 9 after, are not enough."""
    episode = beats(1, step=0.2, waited=0.1, gap=14.0)
    state = job(4, beats=beats(step=0.2, waited=0.1) + episode + beats(9, step=0.2, waited=0.1))
    lagging = beats(step=0.2, waited=0.01)
    state.ranks[3] = rank(3, beats=lagging + episode + beats(9, step=0.2, waited=0.01))
    assert rule_slow_rank(state, NOW, TH) == []
    for r in state.ranks.values():
        assert r.beats is not None
        r.beats += r.beats[-len(episode) :]  # a tenth beat since the episode
    assert kinds(rule_slow_rank(state, NOW, TH)) == ["slow_rank"]


def _split(
    grad: float, compute: float, data: float = 0.001, collective: float = 0.001
) -> dict[str, Any]:
    """A settled rank's step split: DDP's gradient wait, compute, input wait (medians)."""
    window = beats(
        step=0.24, waited=collective + grad, grad_wait=grad, compute=compute, input_wait=data
    )
    return {"beats": window, "grad_wait_s": grad, "compute_s": compute, "input_wait_s": data}


def test_slow_rank_waited_for_inside_ddps_gradient_all_reduce() -> None:
    """TraceML #252: rank 1's backward takes 200 ms more. DDP's all-reduce evens out the step
    times; the only difference is the others' wait inside backward, which no wrapper of
    torch.distributed sees (``grad_wait_s``)."""
    state = job(3, **_split(0.2, 0.035))
    state.ranks[1] = rank(1, 3, **_split(0.003, 0.235))
    alert = only(diagnose(state, NOW, TH), "slow_rank")
    assert alert.ranks == (1,) and alert.waiting == (0, 2)
    assert alert.message == (
        "rank 1 enters DDP's gradient all-reduce ~197 ms after ranks 0, 2 every step (its "
        "compute takes 235 ms, theirs 35 ms): the job runs at 4.2 steps/s instead of ~25"
    )
    assert alert.hint.startswith("rank 1 computes slower than the others")


def test_slow_rank_by_its_input() -> None:
    """TraceML #252's control: rank 2's input pipeline is 160 ms a batch slower."""
    state = job(4, **_split(0.16, 0.07))
    state.ranks[2] = rank(2, 4, **_split(0.002, 0.07, data=0.162))
    alert = only(diagnose(state, NOW, TH), "slow_rank")
    assert alert.ranks == (2,) and alert.waiting == (0, 1, 3)
    assert "(its input wait takes 162 ms, theirs 1 ms)" in alert.message
    assert alert.hint.startswith("rank 2 waits 162 ms per step for its input")


def test_slow_rank_adds_the_waits_in_collectives_and_in_ddp() -> None:
    """A job with a metric all-reduce too: the others wait partly in each."""
    state = job(3, **_split(0.05, 0.03, collective=0.05))
    state.ranks[0] = rank(0, 3, **_split(0.001, 0.13))
    alert = only(diagnose(state, NOW, TH), "slow_rank")
    assert alert.ranks == (0,)
    assert "~98 ms after ranks 1, 2" in alert.message


@pytest.mark.parametrize(
    ("waits", "why"),
    [
        ((0.01, 0.012, 0.009, 0.011), "balanced"),
        ((0.012, 0.012, 0.0, 0.012), "the others lose 5 % of the step: not worth a word"),
        ((0.2, 0.2, 0.002, 0.002), "half the ranks slow: no one rank the others wait for"),
    ],
)
def test_slow_rank_quiet_with_ddp_waits(waits: tuple[float, ...], why: str) -> None:
    state = state_of(*(rank(r, **_split(w, 0.03)) for r, w in enumerate(waits)))
    assert rule_slow_rank(state, NOW, TH) == [], why


def test_slow_rank_never_names_a_rank_that_cannot_see_ddps_wait() -> None:
    """A rank whose agent reports no gradient wait (older, or its model on a GPU) would look
    like the one that never waits: it is left out, never named."""
    state = job(4, **_split(0.2, 0.035))
    untimed = beats(step=0.24, waited=0.001, compute=0.035, input_wait=0.001)
    state.ranks[3] = rank(3, **{**_split(0.0, 0.035), "beats": untimed})
    assert rule_slow_rank(state, NOW, TH) == []


def _simulate(extra_s: float, seconds: float, seed: int) -> list[tuple[float, tuple[int, ...]]]:
    """Three lockstep ranks whose steps each arrive at DDP's all-reduce with a few ms of
    jitter (rank 1 ``extra_s`` later from 10 s on), each waiting for the last; heartbeats
    every 0.5 s carry the averages of their steps, as the agent sends them; the rule runs
    every second. Returns (seconds after the onset, culprits) of each run that named one."""
    import random

    rng = random.Random(seed)
    state = ServerState(started=NOW - 1000)
    start = NOW - seconds
    t, named = start, []
    while t < NOW:
        sums = [[0.0, 0.0] for _ in range(3)]  # per rank: step, wait
        for _ in range(10):  # 10 steps a beat
            late = extra_s if t - start >= 10 else 0.0
            arrive = [0.03 + rng.uniform(0, 0.006) + (late if r == 1 else 0.0) for r in range(3)]
            for r in range(3):
                sums[r][0] += max(arrive) + 0.001
                sums[r][1] += max(arrive) - arrive[r] + 0.001
        step = int((t - start) * 20) + 1
        for r in range(3):
            step_s, wait = (v / 10 for v in sums[r])
            beat = Sample(
                v=1, rank=r, t=0.0, world_size=3, host="node0", pid=100 + r, step=step,
                step_time_s=step_s, avg_step_time_s=step_s, collective_time_s=0.0,
                grad_wait_s=wait, compute_s=step_s - wait, input_wait_s=0.0,
            )  # fmt: skip
            state.apply(beat, t)
        if round((t - start) * 2) % 2 == 0:
            found = rule_slow_rank(state, t + 0.01, TH)
            if found:
                named.append((t - start - 10, found[0].ranks))
        t += 0.5
    return named


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_slow_rank_is_named_within_10_s_once_it_costs_a_tenth(seed: int) -> None:
    named = _simulate(0.0045, 40.0, seed)  # ~11 % of a 40 ms step
    assert named and named[0][0] <= 10.0, named
    assert {ranks for _, ranks in named} == {(1,)}  # never another rank
    first = named[0][0]
    assert [at for at, _ in named] == [at for at in range(int(first), 30)], named  # no flapping


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_slow_rank_quiet_for_a_healthy_job_and_below_a_twentieth(seed: int) -> None:
    assert _simulate(0.0, 60.0, seed) == []
    assert _simulate(0.0015, 60.0, seed) == []  # ~4 % of the step


def test_checkpoint_conflict() -> None:
    state = job(3)
    state.ranks[0].checkpoint_paths = ["ckpt/last.pt"]
    state.ranks[1].checkpoint_paths = ["ckpt/last.pt"]
    state.ranks[2].checkpoint_paths = ["ckpt/rank2.pt"]
    alert = only(rule_checkpoint_conflict(state, NOW, TH), "checkpoint_conflict")
    assert (alert.severity, alert.ranks) == ("warning", (0, 1))
    assert "ckpt/last.pt" in alert.message
    state.ranks[1].checkpoint_paths = ["ckpt/rank1.pt"]
    assert rule_checkpoint_conflict(state, NOW, TH) == []


def test_step_skew_after_a_long_barrier_reads_the_fastest_rank() -> None:
    """Benchmark rank0-checkpoint: rank 0 left a 25 s barrier first and ran 5 steps before
    rank 2's next heartbeat; rank 2's last step time is the wait itself. Not a skew."""
    state = job(3, step=21, step_time_s=25.0, avg_step_time_s=1.2)
    state.ranks[0] = rank(0, 3, step=26, step_time_s=0.03, avg_step_time_s=1.2)
    assert rule_step_skew(state, NOW, TH) == []
    state.ranks[2] = rank(2, 3, step=21 - 60, step_time_s=0.03, avg_step_time_s=0.03)
    assert kinds(rule_step_skew(state, NOW, TH)) == ["step_skew"]  # a real gap still shows


@pytest.mark.parametrize("step", [1, None])
def test_a_compile_far_longer_than_a_cold_one_is_a_warning(step: int | None) -> None:
    """A compile that never ends (``dynamic=True``, PyTorch #118492; max-autotune under DDP,
    #140395) raised nothing, at the first step (step None) as later: after 20 min, a
    warning that says it is compiling; 10 min is a cold compile still."""
    ten = job(3, step=step, phase="compiling", phase_since=NOW - 600, last_progress=NOW - 600)
    assert diagnose(ten, NOW, TH) == []
    state = job(3, step=step, phase="compiling", phase_since=NOW - 1500, last_progress=NOW - 1500)
    state.ranks[1] = rank(
        1, 3, step=step, phase="compiling", phase_since=NOW - 1300, last_progress=NOW - 1300
    )
    alerts = [a for a in diagnose(state, NOW, TH) if a.ranks]
    found = only(alerts, "stalled")
    where = "at step 1" if step else "before its first step"
    assert (found.severity, found.ranks) == ("warning", (0, 1, 2))
    assert found.message == (
        f"ranks 0-2 have been compiling (torch.compile) for up to 25 min {where}: a cold "
        "compile takes minutes, this one may never end"
    )
    assert "#118492" in found.hint
