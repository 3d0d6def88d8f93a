"""The rule set as a whole: the shared helpers (rank lists, locations, rank states), healthy
jobs that raise nothing, the order ``diagnose`` gives, 8,192 ranks, and rules that fail alone.

Records are built directly (``lockstep.job`` makes a healthy lockstep job to perturb); a few
scenarios go through ``ServerState.apply`` with real protocol messages.
"""

from __future__ import annotations

import math
import random
from typing import Any

import pytest
from lockstep import (
    BOOM,
    NOW,
    PEER,
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

from ddpwatch.core.protocol import Collective, Hello, Sample
from ddpwatch.core.vocabulary import ALERT_KINDS as KINDS
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.facts.census import effective_stall_after
from ddpwatch.diagnosis.facts.ranks import rank_state
from ddpwatch.diagnosis.rules import RULES, diagnose, registry
from ddpwatch.diagnosis.text import format_ranks, format_sorted_ranks, location
from ddpwatch.state.state import ServerState

# --------------------------------------------------------------------------- helpers


@pytest.mark.parametrize(
    ("ranks", "text"),
    [
        ([3], "rank 3"),
        ([2, 0], "ranks 0, 2"),
        ([0, 1], "ranks 0, 1"),
        ([0, 1, 3], "ranks 0, 1, 3"),
        ([0, 1, 2], "ranks 0-2"),
        ([0, 1, 2, 3, 4, 5, 9], "ranks 0-5, 9"),
        ([1, 1, 1], "rank 1"),
        ([], "no rank"),
        (range(0, 8192, 2), "ranks 0, 2, 4, 6, 8, 10, 12, 14 and 4088 more"),
        ([*range(4097), *range(4098, 8192)], "ranks 0-4096, 4098-8191"),
    ],
)
def test_format_ranks(ranks: list[int], text: str) -> None:
    assert format_ranks(ranks) == text
    ordered = sorted(set(ranks))  # what a wait group's sorted list holds: the same words
    assert format_sorted_ranks(ordered) == text


@pytest.mark.parametrize(
    ("stack", "where"),
    [
        (STACK, "train.py:88"),
        (None, None),
        ("", None),
        (
            '  File "/x/site-packages/torch/distributed/distributed_c10d.py", line 9, in wait\n',
            None,
        ),
        ('  File "/opt/ddpwatch-demo/train.py", line 5, in <module>\n', "train.py:5"),
        ('  File "<frozen runpy>", line 198, in _run_module_as_main\n', None),
        ('  File "C:\\work\\train.py", line 12, in main\n', "train.py:12"),
        (
            "Traceback (most recent call last):\n"
            '  File "/w/train.py", line 30, in <module>\n'
            '  File "/w/model.py", line 7, in forward\n'
            '  File "/usr/lib/python3/dist-packages/numpy/core.py", line 1, in f\n',
            "model.py:7",
        ),
        (  # torch.compile's generated code (inductor's default cache) is not the user's line
            '  File "/w/train.py", line 41, in step\n'
            '  File "/tmp/torchinductor_ann/k3/ck3xq5.py", line 88, in call\n',
            "train.py:41",
        ),
    ],
)
def test_location(stack: str | None, where: str | None) -> None:
    assert location(stack) == where


@pytest.mark.parametrize(
    ("changes", "expected"),
    [
        ({}, "running"),
        ({"error": BOOM, "exit_time": NOW - 1}, "crashed"),
        ({"exit_time": NOW - 1, "exit_code": 0}, "exited"),
        ({"last_seen": NOW - 3.0}, "silent"),
        (waiting_in("all_reduce", 4, 0.01), "waiting"),
        ({"last_progress": NOW - 11}, "stalled"),
        ({"last_progress": NOW - 600, "phase": "compiling"}, "busy"),  # a cold compile works
        ({"last_progress": NOW - 11, "step": None}, "running"),
        ({"last_progress": NOW - 9}, "running"),
        ({"last_seen": NOW - 3.0, **waiting_in("all_reduce", 4, 9.0)}, "silent"),
    ],
)
def test_rank_state(changes: dict[str, Any], expected: str) -> None:
    assert rank_state(rank(0, **changes), NOW, TH, 10.0) == expected


def test_effective_stall_after_grows_with_slow_steps() -> None:
    assert effective_stall_after(job(), TH) == 10.0
    assert effective_stall_after(job(avg_step_time_s=4.0), TH) == 20.0
    assert effective_stall_after(state_of(), TH) == 10.0


def test_rules_are_listed_and_kinds_are_known() -> None:
    assert len(RULES) == len(set(RULES)) >= 16
    assert {kind for rule in RULES for kind in rule.kinds} <= set(KINDS)
    scenarios = [job(), job(world=2, last_seen=NOW - 30), state_of()]
    for state in scenarios:
        for rule in RULES:
            for alert in rule(state, NOW, TH):
                assert alert.kind in rule.kinds


def test_a_misspelt_kind_fails_when_the_rule_is_declared() -> None:
    with pytest.raises(ValueError, match="stragler"):
        registry.rule("stragler")


# --------------------------------------------------------------------------- healthy jobs


def test_healthy_job_raises_nothing() -> None:
    assert diagnose(job(8), NOW, TH) == []


def test_healthy_job_sampled_mid_all_reduce_raises_nothing() -> None:
    state = job(4)
    for r in (0, 1):
        state.ranks[r] = rank(r, **waiting_in("all_reduce", 42, 0.004))
    state.ranks[2].step = 501  # heartbeats sample steps at different moments
    assert diagnose(state, NOW, TH) == []


def test_finished_job_raises_nothing() -> None:
    assert diagnose(job(4, exit_time=NOW - 30, exit_code=0, last_seen=NOW - 30), NOW, TH) == []


def test_healthy_job_through_apply_raises_nothing() -> None:
    state = ServerState(started=0.0)
    t = 100.0
    for r in range(4):
        state.apply(Hello(v=1, rank=r, t=t, world_size=4, local_rank=r, host="n", pid=10 + r), t)
    for step in range(1, 40):
        t += 0.1
        for r in range(4):
            collective = Collective(op="all_reduce", seq=step, since_s=0.002) if r == 3 else None
            sample = Sample(
                v=1,
                rank=r,
                t=t,
                step=step,
                loss=1.0,
                avg_step_time_s=0.1,
                collective_time_s=0.01,
                phase="forward",
                collective=collective,
            )
            state.apply(sample, t)
    assert diagnose(state, t + 0.2, TH) == []


# --------------------------------------------------------------------------- diagnose


def test_diagnose_sorts_by_severity_then_kind_then_ranks() -> None:
    state = job(6)
    state.ranks[5] = rank(5, 6, loss=math.nan, nan_step=3)
    state.ranks[1].checkpoint_paths = ["same.pt"]
    state.ranks[2].checkpoint_paths = ["same.pt"]
    state.ranks[4] = rank(4, 6, step=400)
    state.ranks[3] = rank(3, 6, last_progress=NOW - 15)
    alerts = diagnose(state, NOW, TH)
    assert [(a.severity, a.kind) for a in alerts] == [
        ("error", "nan_loss"),
        ("error", "stalled"),
        ("warning", "checkpoint_conflict"),
        ("warning", "step_skew"),
    ]
    assert len({a.key for a in alerts}) == len(alerts)


# --------------------------------------------------------------------------- scale


def test_scale_8192_ranks() -> None:
    world = 8192
    state = ServerState(started=0.0)
    for r in range(world):
        state.ranks[r] = rank(
            r,
            world,
            host=f"node{r // 8}",
            local_rank=r % 8,
            local_world_size=8,
            **waiting_in("all_reduce", 42, 12.4),
        )
    everyone = only(diagnose(state, NOW, TH), "stalled")  # the whole world waits: a network stall
    assert len(everyone.ranks) == world
    state.ranks[4097] = rank(4097, world, host="node512", local_rank=1, stack=STACK)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks) for a in alerts] == [("straggler", (4097,))]
    assert len(alerts[0].waiting) == world - 1
    assert "ranks 0-4096, 4098-8191 have waited" in alerts[0].message

    healthy = job(world)
    assert diagnose(healthy, NOW, TH) == []

    killed = job(world, error=PEER, error_time=NOW - 4.0)
    killed.ranks[77] = rank(77, world, last_seen=NOW - 5.0)
    alerts = diagnose(killed, NOW, TH)
    assert [(a.kind, a.ranks) for a in alerts] == [("silent", (77,))]
    assert len(alerts[0].waiting) == world - 1
    assert len(alerts[0].message) < 400


@pytest.mark.parametrize("device", ["cuda:²", "cuda:" + "9" * 5000, "cuda:-1", "cuda:"])
def test_a_malformed_device_from_a_rank_never_breaks_diagnosis(device: str) -> None:
    state = job(3)
    for r in state.ranks.values():
        r.device = device
    import ddpwatch.diagnosis.rules as rules

    before = dict(rules.RULE_FAILURES)
    diagnose(state, NOW, TH)
    assert dict(rules.RULE_FAILURES) == before  # no rule raised: they read what they can


def test_a_rule_that_raises_loses_only_its_own_alerts(monkeypatch: pytest.MonkeyPatch) -> None:
    import ddpwatch.diagnosis.rules as rules

    def broken(*_: Any) -> list[Alert]:
        raise RuntimeError("a bug in one rule")

    state = job(4, beats=beats(step=0.2, waited=0.1))
    state.ranks[3].beats = beats(step=0.2, waited=0.01)
    monkeypatch.setattr(rules, "RULES", (broken, *rules.RULES))
    monkeypatch.setattr(rules, "RULE_FAILURES", type(rules.RULE_FAILURES)())
    assert kinds(rules.diagnose(state, NOW, TH)) == ["slow_rank"]
    assert kinds(rules.diagnose(state, NOW, TH)) == ["slow_rank"]
    assert rules.RULE_FAILURES == {"broken": 2}


def test_an_alert_from_a_sorted_waiting_list_lists_the_same_waiters() -> None:
    """The straggler passes its wait group's own sorted list (131,071 ranks at scale), which
    is not put in a set and sorted again: the same waiters, no culprit among them."""
    rng = random.Random(7)
    for _ in range(200):
        waiting = sorted(rng.sample(range(40), rng.randrange(0, 30)))
        culprits = rng.sample(range(40), rng.randrange(1, 4))
        args = ("straggler", "error", culprits)
        plain = registry.alert(*args, waiting, "m", "h")
        assert registry.alert(*args, waiting, "m", "h", waiting_sorted=True) == plain
