"""Diagnosis rules: each one firing and staying quiet, the cascade, messages, and scale.

Records are built directly (``job`` below makes a healthy lockstep job to perturb);
a few scenarios go through ``ServerState.apply`` with real protocol messages.
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any

import pytest

from ddpwatch.core.protocol import Collective, ErrorInfo, Event, Hello, Sample
from ddpwatch.diagnosis.alerts import KINDS, Alert, Thresholds
from ddpwatch.diagnosis.rules import (
    RULES,
    diagnose,
    effective_stall_after,
    rank_state,
    registry,
    rule_batch_desync,
    rule_cascade,
    rule_checkpoint_conflict,
    rule_clean_exit,
    rule_collective_mismatch,
    rule_device_ordinal,
    rule_duplicate_device,
    rule_foreign_memory,
    rule_local_rank_mismatch,
    rule_nan_loss,
    rule_not_connected,
    rule_slow_rank,
    rule_stalled,
    rule_startup_hang,
    rule_step_skew,
    rule_straggler,
    rule_uneven_memory,
)
from ddpwatch.diagnosis.rules.text import format_ranks, location
from ddpwatch.server.records import RankRecord
from ddpwatch.server.state import ServerState

NOW = 10_000.0
TH = Thresholds()  # interval 0.5 s, silent 2.5 s, stall 10 s, startup 60 s, connect 10 s
GIB = 1 << 30

STACK = """\
  File "/usr/lib/python3.11/threading.py", line 1002, in _bootstrap
    self._bootstrap_inner()
  File "/home/ann/project/train.py", line 120, in main
    loss = model(x)
  File "/home/ann/project/train.py", line 88, in forward
    y = self.net(x)
  File "/home/ann/.venv/lib/python3.11/site-packages/torch/nn/modules/module.py", line 1751, in _call_impl
    return forward_call(*args, **kwargs)
  File "/home/ann/src/ddpwatch/agent/hooks.py", line 40, in hook
    frame = sys._getframe()
"""

PEER = ErrorInfo(
    type="RuntimeError",
    message="[/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] Connection closed by "
    "peer [127.0.0.1]:21198. This is typically caused by a remote worker crashing.",
)
BOOM = ErrorInfo(
    type="ValueError",
    message="boom",
    traceback='Traceback (most recent call last):\n  File "/w/train.py", line 77, in step\n'
    '    raise ValueError("boom")\nValueError: boom\n',
)
OOM = ErrorInfo(
    type="torch.OutOfMemoryError", message="CUDA out of memory. Tried to allocate 2 GiB"
)
ORDINAL = ErrorInfo(type="RuntimeError", message="CUDA error: invalid device ordinal")
WATCHDOG = ErrorInfo(
    type="RuntimeError",
    message="[Rank 0] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=5, "
    "OpType=ALLREDUCE, Timeout(ms)=600000) ran for 600013 milliseconds before timing out.",
)


def rank(r: int, world: int = 4, **changes: Any) -> RankRecord:
    """A healthy training rank in a lockstep job of ``world`` ranks on one host."""
    record = RankRecord(
        rank=r,
        first_seen=NOW - 600,
        last_seen=NOW - 0.2,
        local_rank=r,
        world_size=world,
        local_world_size=world,
        node_rank=0,
        host="node0",
        pid=1000 + r,
        device="cpu",
        phase="forward",
        phase_since=NOW - 0.05,
        step=500,
        loss=1.25,
        step_time_s=0.1,
        avg_step_time_s=0.1,
        collective_time_s=0.02,
        last_progress=NOW - 0.05,
    )
    return dataclasses.replace(record, **changes)


def state_of(*records: RankRecord) -> ServerState:
    state = ServerState(started=NOW - 700)
    for record in records:
        state.ranks[record.rank] = record
    return state


def job(world: int = 4, **changes: Any) -> ServerState:
    return state_of(*(rank(r, world, **changes) for r in range(world)))


def waiting_in(op: str, seq: int | None, age: float, **changes: Any) -> dict[str, Any]:
    """Fields of a rank blocked in ``op #seq`` for ``age`` seconds as of NOW."""
    return {
        "collective": Collective(op=op, seq=seq, since_s=age - 0.4),
        "collective_seen": NOW - 0.4,
        **changes,
    }


def kinds(alerts: list[Alert]) -> list[str]:
    return [a.kind for a in alerts]


def only(alerts: list[Alert], kind: str) -> Alert:
    found = [a for a in alerts if a.kind == kind]
    assert len(found) == 1, alerts
    return found[0]


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


# --------------------------------------------------------------------------- cascade


def test_exception_on_one_rank_blames_it_not_its_peers() -> None:
    state = job(3, step=311)
    state.ranks[1] = rank(1, 3, step=311, error=BOOM, error_time=NOW - 2.0, stack=STACK)
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, step=311, error=PEER, error_time=NOW - 1.9)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("crashed", (1,), (0, 2))]
    message = alerts[0].message
    assert message.startswith("rank 1 crashed in 'forward' at step 311, train.py:88")
    assert "ValueError: boom" in message and "ranks 0, 2" in message


def test_exception_cascade_through_apply() -> None:
    state = ServerState(started=0.0)
    for r in range(3):
        state.apply(
            Hello(v=1, rank=r, t=1.0, world_size=3, local_rank=r, host="n", pid=50 + r), 1.0
        )
        state.apply(Sample(v=1, rank=r, t=2.0, step=9, phase="forward", loss=0.5), 2.0)
    state.apply(Event(v=1, rank=1, t=3.0, event="crash", error=OOM), 3.0)
    for r in (0, 2):
        state.apply(Event(v=1, rank=r, t=3.2, event="crash", error=PEER), 3.2)
        state.apply(Event(v=1, rank=r, t=3.3, event="exit", exit_code=1), 3.3)
    alerts = diagnose(state, 4.0, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("crashed", (1,), (0, 2))]
    assert "out of memory" in alerts[0].message
    assert "batch size" in alerts[0].hint


def test_killed_rank_is_the_silent_root() -> None:
    state = job(4, step=311)
    state.ranks[1] = rank(1, step=311, last_seen=NOW - 5.0, pid=4242)
    state.ranks[0] = rank(0, step=311, error=PEER, error_time=NOW - 4.6)
    state.ranks[2] = rank(2, step=311, error=PEER, error_time=NOW - 4.5)
    state.ranks[3] = rank(3, step=311, exit_time=NOW - 4.0, exit_signal="SIGTERM")
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("silent", (1,), (0, 2, 3))]
    assert "5.0 s" in alerts[0].message
    assert "py-spy dump --pid 4242" in alerts[0].hint


def test_silent_rank_makes_its_waiting_peers_victims() -> None:
    state = job(3)
    state.ranks[1] = rank(1, 3, last_seen=NOW - 8.0)  # SIGSTOPped or hung holding the GIL
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, last_progress=NOW - 8, **waiting_in("all_reduce", 9, 8.0))
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("silent", (1,), (0, 2))]


def test_peer_failure_without_root_waits_for_the_culprit() -> None:
    state = job(3)
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, error=PEER, error_time=NOW - 1.0)
    state.ranks[1] = rank(1, 3, last_seen=NOW - 1.2)  # killed, not yet silent
    assert diagnose(state, NOW, TH) == []


def test_peer_failure_without_root_names_no_culprit_after_the_window() -> None:
    """A rank whose own error only says a peer went away is a victim, even the first one:
    the issue's early-exit report had rank 0 blamed for "Connection closed by peer"."""
    state = job(3)
    state.ranks[0] = rank(0, 3, error=PEER, error_time=NOW - 4.8)
    state.ranks[1] = rank(1, 3, error=PEER, error_time=NOW - 5.0)
    state.ranks[2] = rank(2, 3, exit_time=NOW - 4.5, exit_signal="SIGTERM")
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("crashed", (), (0, 1, 2))]
    assert "lost the connection to a peer" in alerts[0].message


@pytest.mark.parametrize(("age", "expected"), [(1.0, []), (4.0, [("exited", (), (0, 1, 2, 3))])])
def test_sigterm_without_root(age: float, expected: list[tuple[str, tuple[int, ...]]]) -> None:
    """Stopped from outside with no failure before: say so, but blame no rank."""
    state = job(4, exit_time=NOW - age, exit_signal="SIGTERM", last_seen=NOW - age)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == expected
    assert all(a.severity == "warning" and "SIGTERM" in a.message for a in alerts)


def test_nonzero_exit_is_a_root() -> None:
    state = job(3)
    state.ranks[2] = rank(2, 3, exit_time=NOW - 3, exit_code=1, last_seen=NOW - 3)
    state.ranks[0] = rank(0, 3, error=PEER, error_time=NOW - 2.9)
    state.ranks[1] = rank(1, 3, exit_time=NOW - 2, exit_signal="SIGTERM")
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.severity, a.ranks, a.waiting) for a in alerts] == [
        ("exited", "error", (2,), (0, 1))
    ]
    assert "exited with code 1" in alerts[0].message
    assert "rank 0 failed because of it" in alerts[0].message
    assert "rank 1 was stopped by the launcher after it" in alerts[0].message


@pytest.mark.parametrize("code", [0, None])
def test_clean_exit_is_the_root_once_the_others_fail(code: int | None) -> None:
    """One rank returns early (code 0) and its peers lose their connection: it broke them."""
    state = job(3)
    state.ranks[1] = rank(1, 3, exit_time=NOW - 3, exit_code=code, last_seen=NOW - 3, step=50)
    state.ranks[0] = rank(0, 3, error=PEER, error_time=NOW - 3.1)
    state.ranks[2] = rank(2, 3, exit_time=NOW - 2, exit_signal="SIGTERM", exit_code=-15)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("exited", (1,), (0, 2))]
    assert "exited normally (code 0)" in alerts[0].message and "step 50" in alerts[0].message


def test_two_roots_each_get_an_alert_and_victims_go_to_the_earliest() -> None:
    state = job(4)
    state.ranks[1] = rank(1, error=BOOM, error_time=NOW - 3.0)
    state.ranks[3] = rank(3, error=OOM, error_time=NOW - 2.0)
    state.ranks[0] = rank(0, error=PEER, error_time=NOW - 2.9)
    state.ranks[2] = rank(2, exit_time=NOW - 2.5, exit_signal="SIGTERM")
    alerts = rule_cascade(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [
        ("crashed", (1,), (0, 2)),
        ("crashed", (3,), ()),
    ]


def test_the_same_error_on_many_ranks_is_one_alert() -> None:
    state = job(8, error=ORDINAL, error_time=NOW - 1.0)
    for r in range(4):
        state.ranks[r] = rank(r, 8)
    alert = only(rule_cascade(state, NOW, TH), "crashed")
    assert alert.ranks == (4, 5, 6, 7)
    assert alert.message.startswith("ranks 4-7 crashed")
    assert "global rank" in alert.message


def test_timeouts_are_victims_of_a_silent_rank() -> None:
    state = job(3)
    state.ranks[1] = rank(1, 3, last_seen=NOW - 600)  # hung holding the GIL
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, error=WATCHDOG, error_time=NOW - 1.0)
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("silent", (1,), (0, 2))]


def test_timeouts_alone_are_one_root() -> None:
    state = job(3)
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, error=WATCHDOG, error_time=NOW - 1.0)
    state.ranks[1] = rank(1, 3, exit_time=NOW - 0.5, exit_signal="SIGTERM")
    alerts = rule_cascade(state, NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("crashed", (0, 2), (1,))]
    assert "did not finish within the process-group timeout" in alerts[0].message


def test_late_silent_rank_is_a_victim_of_an_earlier_crash() -> None:
    state = job(3)
    state.ranks[1] = rank(1, 3, error=BOOM, error_time=NOW - 6.0)
    state.ranks[2] = rank(2, 3, last_seen=NOW - 5.5)  # SIGKILLed by the launcher afterwards
    state.ranks[0] = rank(0, 3, error=PEER, error_time=NOW - 5.9)
    assert [(a.kind, a.ranks, a.waiting) for a in rule_cascade(state, NOW, TH)] == [
        ("crashed", (1,), (0, 2))
    ]


# --------------------------------------------------------------------------- exits


def test_clean_exit_while_others_run_warns() -> None:
    state = job(4)
    state.ranks[3] = rank(3, exit_time=NOW - 15, exit_code=0, last_seen=NOW - 15)
    alert = only(diagnose(state, NOW, TH), "exited")
    assert alert.severity == "warning" and alert.ranks == (3,)
    assert alert.message == (
        "rank 3 exited at step 500 while ranks 0-2 still run; they will hang in their next "
        "collective"
    )


def test_clean_exit_with_others_stuck_in_a_collective_is_an_error() -> None:
    state = job(4, **waiting_in("barrier", 77, 6.0))
    state.ranks[3] = rank(3, exit_time=NOW - 6.5, exit_code=0)
    alert = only(diagnose(state, NOW, TH), "exited")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (3,), (0, 1, 2))
    assert "barrier #77" in alert.message and "6.0 s" in alert.message


@pytest.mark.parametrize(
    "state",
    [
        job(4, exit_time=NOW - 20, exit_code=0, last_seen=NOW - 20),  # all done
        state_of(rank(0, 2, exit_time=NOW - 1, exit_code=0), rank(1, 2)),  # a second apart
    ],
)
def test_clean_exits_that_are_fine(state: ServerState) -> None:
    assert rule_clean_exit(state, NOW, TH) == []
    assert diagnose(state, NOW, TH) == []


# --------------------------------------------------------------------------- collectives


def straggler_job() -> ServerState:
    state = job(3, step=311)
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, step=311, **waiting_in("all_reduce", 42, 12.4))
    state.ranks[1] = rank(1, 3, step=311, stack=STACK, last_progress=NOW - 12.4)
    return state


def test_straggler_exact_message() -> None:
    alerts = diagnose(straggler_job(), NOW, TH)
    assert [(a.kind, a.severity, a.ranks, a.waiting) for a in alerts] == [
        ("straggler", "error", (1,), (0, 2))
    ]
    assert alerts[0].message == (
        "rank 1 has not entered all_reduce #42 that ranks 0, 2 have waited in for 12.4 s; "
        "it is in 'forward' at step 311, train.py:88"
    )
    assert "rank 1" in alerts[0].hint and "all_reduce #42" in alerts[0].hint


@pytest.mark.parametrize(
    ("age", "step_time", "expected"),
    [
        (0.005, 0.1, None),  # a healthy all_reduce
        (1.5, 0.1, None),  # below 2 s never flags
        (3.5, 0.1, "warning"),  # a real hang shows within ~3 s
        (12.0, 0.1, "error"),  # past the stall threshold
        (6.0, 5.0, None),  # slow steps: wait at least min(stall, 3 x step)
        (16.0, 5.0, "warning"),
    ],
)
def test_straggler_threshold(age: float, step_time: float, expected: str | None) -> None:
    state = job(3, avg_step_time_s=step_time)
    for r in (0, 2):
        state.ranks[r] = rank(r, 3, avg_step_time_s=step_time, **waiting_in("all_reduce", 7, age))
    alerts = rule_straggler(state, NOW, TH)
    assert [a.severity for a in alerts] == ([expected] if expected else [])


def test_straggler_in_an_earlier_collective_and_without_seq() -> None:
    state = job(4)
    for r in (0, 1, 2):
        state.ranks[r] = rank(r, **waiting_in("gloo:all_reduce", 42, 5.0))
    state.ranks[3] = rank(3, **waiting_in("gloo:broadcast", 41, 5.0))
    alert = only(rule_straggler(state, NOW, TH), "straggler")
    assert (alert.ranks, alert.waiting) == ((3,), (0, 1, 2))
    assert "inside gloo:broadcast #41" in alert.message
    plain = job(3)
    for r in (0, 1):
        plain.ranks[r] = rank(r, 3, **waiting_in("barrier", None, 4.0))
    alert = only(rule_straggler(plain, NOW, TH), "straggler")
    assert (alert.ranks, alert.waiting) == ((2,), (0, 1))
    assert "not entered barrier that" in alert.message


def test_straggler_defers_to_a_silent_culprit() -> None:
    state = straggler_job()
    state.ranks[1].last_seen = NOW - 4.0
    assert rule_straggler(state, NOW, TH) == []
    assert kinds(diagnose(state, NOW, TH)) == ["silent"]


@pytest.mark.parametrize(("age", "fires"), [(5.0, False), (12.0, True)])
def test_every_rank_waiting_in_one_collective_is_stalled(age: float, fires: bool) -> None:
    state = job(4, **waiting_in("all_reduce", 42, age))
    alerts = diagnose(state, NOW, TH)
    if fires:
        alert = only(alerts, "stalled")
        assert alert.ranks == (0, 1, 2, 3) and alert.severity == "error"
        assert "all 4 ranks have waited in all_reduce #42 for 12.0 s" in alert.message
    else:
        assert alerts == []


def test_all_waiting_counts_from_the_last_rank_to_enter() -> None:
    state = job(3, **waiting_in("all_reduce", 20, 20.0))
    state.ranks[1] = rank(1, 3, **waiting_in("all_reduce", 20, 0.3))  # it just arrived
    assert diagnose(state, NOW, TH) == []


def test_all_waiting_with_a_missing_rank_is_not_a_network_stall() -> None:
    state = job(4, **waiting_in("all_reduce", 42, 12.0))
    del state.ranks[3]
    assert not [a for a in rule_straggler(state, NOW, TH) if a.kind == "stalled"]


def test_collective_mismatch_names_the_minority() -> None:
    state = job(4)
    for r in (0, 1, 2):
        state.ranks[r] = rank(r, **waiting_in("all_reduce", 7, 3.0))
    state.ranks[3] = rank(3, **waiting_in("broadcast", 7, 3.0))
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (3,), (0, 1, 2))
    assert (
        alert.message
        == "rank 3 called broadcast at collective #7 where ranks 0-2 called all_reduce"
    )


@pytest.mark.parametrize(
    ("ops", "age"),
    [
        (("gloo:all_reduce", "allreduce", "ALLREDUCE", "all_reduce"), 3.0),  # same op, 4 spellings
        (("all_reduce", "all_reduce", "all_reduce", "broadcast"), 0.2),  # too fresh to judge
    ],
)
def test_collective_mismatch_quiet(ops: tuple[str, ...], age: float) -> None:
    state = state_of(*(rank(r, **waiting_in(op, 7, age)) for r, op in enumerate(ops)))
    assert rule_collective_mismatch(state, NOW, TH) == []


def test_collective_mismatch_from_a_gloo_abort() -> None:
    error = ErrorInfo(
        type="gloo::EnforceNotMet",
        message="[enforce fail at pair.cc:456] op.preamble.length <= op.nbytes. 12 vs 4. Received "
        "data size doesn't match expected size. Is there a distributed collective mismatch?",
    )
    state = job(2)
    state.ranks[1] = rank(1, 2, error=error, error_time=NOW - 1)
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert alert.ranks == ()  # the rank that detects a size mismatch may be the innocent one
    assert kinds(diagnose(state, NOW, TH)) == ["collective_mismatch"]


# --------------------------------------------------------------------------- progress


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
        for rank in range(3):
            beat(rank, t, relayed=True)
        t += 0.5
    for at in (NOW - 2.6, NOW - 2.1, NOW - 1.6, NOW - 1.1, NOW - 0.6, NOW - 0.1):
        for rank in (1, 2):
            beat(rank, at, relayed=False)
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


def test_step_skew_after_a_pause_uses_the_current_step_rate() -> None:
    # the average still holds a 20 s pause; the job now runs 20 steps/s again
    state = job(3, avg_step_time_s=1.0, step_time_s=0.05)
    state.ranks[1] = rank(1, 3, step=490, avg_step_time_s=1.0, step_time_s=0.05)
    assert rule_step_skew(state, NOW, TH) == []


def test_slow_rank() -> None:
    settled = {"avg_step_time_s": 0.2, "collective_time_samples": 10}
    state = job(4, avg_collective_time_s=0.1, **settled)
    state.ranks[3] = rank(3, avg_collective_time_s=0.01, **settled)
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
    state = state_of(
        *(
            rank(r, avg_step_time_s=0.2, avg_collective_time_s=t, collective_time_samples=10)
            for r, t in enumerate(times)
        )
    )
    assert rule_slow_rank(state, NOW, TH) == []


def test_slow_rank_waits_for_averages_past_warm_up() -> None:
    """An average of 9 heartbeats still holds the first steps (DataLoader workers starting):
    say nothing yet, as seen on a healthy rank 0 just before another rank's real fault."""
    young = {"avg_step_time_s": 0.2, "collective_time_samples": 9}
    state = job(4, avg_collective_time_s=0.1, **young)
    state.ranks[3] = rank(3, avg_collective_time_s=0.01, **young)
    assert rule_slow_rank(state, NOW, TH) == []
    state.ranks[3].collective_time_samples = 10
    assert rule_slow_rank(state, NOW, TH) == []  # the others' averages are young still


def _split(grad: float, compute: float, data: float = 0.001, **more: Any) -> dict[str, Any]:
    """A settled rank's step split: DDP's gradient wait, compute, input wait (averages)."""
    return {
        "avg_step_time_s": 0.24,
        "collective_time_samples": 10,
        "avg_collective_time_s": 0.001,
        "avg_grad_wait_s": grad,
        "grad_wait_s": grad,
        "compute_s": compute,
        "input_wait_s": data,
        **more,
    }


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
        "compute takes 235 ms, theirs 35 ms): the job runs at 4.2 steps/s instead of ~23"
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
    state = job(3, **_split(0.05, 0.03, avg_collective_time_s=0.05))
    state.ranks[0] = rank(0, 3, **_split(0.001, 0.13, avg_collective_time_s=0.001))
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
    state.ranks[3] = rank(3, **{**_split(0.0, 0.035), "avg_grad_wait_s": None})
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


# --------------------------------------------------------------------------- startup


def starting(r: int, phase: str, since: float, world: int = 4, **changes: Any) -> RankRecord:
    return rank(r, world, step=None, phase=phase, phase_since=NOW - since, **changes)


def test_startup_hang_names_the_rank_behind() -> None:
    state = state_of(
        starting(0, "model_wrap", 70),
        starting(1, "model_wrap", 70),
        starting(2, "device", 70, stack=STACK),
        starting(3, "model_wrap", 70),
    )
    alert = only(diagnose(state, NOW, TH), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("warning", (2,), (0, 1, 3))
    assert alert.message == (
        "rank 2 is still in 'device' after 70.0 s (train.py:88) while ranks 0, 1, 3 wait in "
        "'model_wrap'"
    )


def test_startup_hang_unknown_phase_counts_after_train() -> None:
    state = state_of(starting(0, "warmup_data", 130, 2), starting(1, "first_step", 130, 2))
    alert = only(rule_startup_hang(state, NOW, TH), "startup_hang")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (1,), (0,))


@pytest.mark.parametrize(
    "state",
    [
        state_of(starting(0, "rendezvous", 30, 2), starting(1, "started", 30, 2)),  # too soon
        state_of(starting(0, "forward", 100, 2), starting(1, "eval", 100, 2)),  # past startup
        state_of(  # the last rank has just joined the others in rendezvous
            starting(0, "rendezvous", 70, 3),
            starting(1, "rendezvous", 0.3, 3),
            starting(2, "rendezvous", 70, 3),
        ),
    ],
)
def test_startup_hang_quiet(state: ServerState) -> None:
    assert rule_startup_hang(state, NOW, TH) == []


def test_startup_hang_waiting_for_a_rank_that_never_connected() -> None:
    state = state_of(*(starting(r, "rendezvous", 70, first_seen=NOW - 70) for r in range(3)))
    alerts = diagnose(state, NOW, TH)
    hang = only(alerts, "startup_hang")
    assert (hang.ranks, hang.waiting) == ((3,), (0, 1, 2))
    missing = only(alerts, "not_connected")
    assert (missing.severity, missing.ranks) == ("error", (3,))


@pytest.mark.parametrize(("elapsed", "severity"), [(5, None), (12, "warning"), (70, "error")])
def test_not_connected(elapsed: float, severity: str | None) -> None:
    state = state_of(*(rank(r, 8, first_seen=NOW - elapsed) for r in (0, 1, 2, 4, 5, 6)))
    alerts = rule_not_connected(state, NOW, TH)
    if severity is None:
        assert alerts == []
        return
    alert = only(alerts, "not_connected")
    assert (alert.severity, alert.ranks) == (severity, (3, 7))
    assert alert.message.startswith(f"ranks 3, 7 of 8 have not connected {elapsed:.1f} s")


def test_not_connected_ignores_ranks_beyond_the_world() -> None:
    state = state_of(rank(0, 2, first_seen=NOW - 30), rank(1, 2, first_seen=NOW - 30))
    state.ranks[5] = rank(5, 2, first_seen=NOW - 30)
    assert rule_not_connected(state, NOW, TH) == []


# --------------------------------------------------------------------------- devices and memory


def gpu(r: int, index: int, local: int | None = None, **changes: Any) -> RankRecord:
    local = r if local is None else local
    return rank(
        r, device=f"cuda:{index}", device_index=index, local_rank=local, device_count=4, **changes
    )


def test_duplicate_device_names_the_rank_on_the_wrong_gpu() -> None:
    state = state_of(gpu(0, 0), gpu(1, 0), gpu(2, 2), gpu(3, 3))
    alerts = diagnose(state, NOW, TH)
    alert = only(alerts, "duplicate_device")
    assert (alert.severity, alert.ranks) == ("error", (1,))
    assert "ranks 0, 1 share GPU cuda:0 on host node0" in alert.message
    assert "local_rank_mismatch" not in kinds(alerts)


def test_duplicate_device_by_uuid_and_visible_devices() -> None:
    same = state_of(
        rank(0, device="cuda:0", device_index=0, device_uuid="GPU-a"),
        rank(1, device="cuda:0", device_index=0, device_uuid="GPU-a", local_rank=0),
    )
    assert only(rule_duplicate_device(same, NOW, TH), "duplicate_device").ranks == (0, 1)
    split = state_of(  # SLURM style: one visible GPU per rank, each is cuda:0
        rank(0, device="cuda:0", device_index=0, cuda_visible_devices="0", local_rank=0),
        rank(1, device="cuda:0", device_index=0, cuda_visible_devices="1", local_rank=0),
    )
    assert rule_duplicate_device(split, NOW, TH) == []
    hosts = state_of(gpu(0, 0, 0), gpu(1, 0, 0, host="node1"))
    assert rule_duplicate_device(hosts, NOW, TH) == []


def test_duplicate_device_from_an_nccl_crash() -> None:
    error = ErrorInfo(
        type="torch.distributed.DistBackendError",
        message="NCCL error in: ProcessGroupNCCL.cpp:1691, invalid usage, NCCL version 2.19.3\n"
        "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
        "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 2000",
    )
    state = job(2)
    state.ranks[1] = rank(1, 2, error=error, error_time=NOW - 1)
    alert = only(rule_duplicate_device(state, NOW, TH), "duplicate_device")
    assert alert.ranks == (0, 1)
    assert "set_device(local_rank)" in alert.hint and "CUDA_VISIBLE_DEVICES" in alert.hint


def test_device_ordinal_from_a_crash_has_the_real_local_rank() -> None:
    state = state_of(*(rank(r, 8, local_world_size=4, local_rank=r % 4) for r in range(8)))
    state.ranks[4] = rank(4, 8, local_world_size=4, local_rank=0, error=ORDINAL, error_time=NOW)
    alert = only(rule_device_ordinal(state, NOW, TH), "device_ordinal")
    assert (alert.severity, alert.ranks) == ("error", (4,))
    assert alert.hint == (
        "use torch.cuda.set_device(local_rank) — LOCAL_RANK is 0 on this rank — not the global rank"
    )


def test_device_ordinal_from_a_live_rank() -> None:
    multi = dict(world=8, local_world_size=4, device_count=4, host="node1")
    state = state_of(
        rank(4, device="cuda:0", device_index=0, local_rank=0, **multi),
        rank(5, device="cuda:5", device_index=5, local_rank=1, **multi),
    )
    alert = only(diagnose(state, NOW, TH), "device_ordinal")
    assert alert.ranks == (5,)
    assert "LOCAL_RANK is 1 on this rank" in alert.hint
    assert "local_rank_mismatch" not in kinds(diagnose(state, NOW, TH))
    node0 = state_of(rank(1, device="cuda:1", device_index=1, local_rank=1, **multi))
    assert rule_device_ordinal(node0, NOW, TH) == []


ORDINAL_CRASH = {"error": ORDINAL, "error_time": NOW - 1, "exit_time": NOW - 0.5, "exit_code": 1}
NO_GPU_FIX = (
    "the machine or container shows this rank no GPU: check the driver (nvidia-smi), the "
    "container's GPUs (docker --gpus) and CUDA_VISIBLE_DEVICES, or the job's GPU allocation; "
    "or run on CPU: the gloo backend and no cuda device"
)


def ordinal_alerts(state: ServerState) -> tuple[Alert, Alert]:
    """The device_ordinal alert and the crash's own: both give the same fix."""
    alerts = diagnose(state, NOW, TH)
    ordinal, crashed = only(alerts, "device_ordinal"), only(alerts, "crashed")
    assert crashed.hint == ordinal.hint
    return ordinal, crashed


@pytest.mark.parametrize(
    ("seen", "why"),
    [
        ({"device_count": 0}, "it counts 0 CUDA devices"),
        ({"cuda_visible_devices": "-1"}, "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
        ({"cuda_visible_devices": ""}, "CUDA_VISIBLE_DEVICES='' hides every GPU"),
        (
            {"cuda_visible_devices": "NoDevFiles"},
            "CUDA_VISIBLE_DEVICES='NoDevFiles' hides every GPU",
        ),
    ],
)
def test_device_ordinal_on_a_rank_that_sees_no_gpu(seen: dict[str, Any], why: str) -> None:
    """One node, local rank 3 == global rank 3, no GPU visible: set_device(local_rank) would
    crash the same way, so the fix is the GPUs (or CPU), not the index."""
    state = job(4, **seen)
    state.ranks[3] = rank(3, 4, **seen, **ORDINAL_CRASH)
    ordinal, crashed = ordinal_alerts(state)
    assert ordinal.ranks == (3,)
    assert ordinal.message == (
        "rank 3 crashed with RuntimeError: CUDA error: invalid device ordinal — rank 3 sees no "
        f"GPU on host node0 ({why})"
    )
    assert ordinal.hint == NO_GPU_FIX
    assert "set_device" not in ordinal.hint and "global rank" not in crashed.message


def test_device_ordinal_with_more_ranks_per_node_than_gpus() -> None:
    """One GPU, two ranks per node: local rank 1 is global rank 1, and cuda:1 is not there."""
    state = state_of(
        rank(0, 2, device="cuda:0", device_index=0, device_count=1),
        rank(1, 2, device_count=1, **ORDINAL_CRASH),
    )
    ordinal, crashed = ordinal_alerts(state)
    assert ordinal.ranks == (1,)
    assert ordinal.message == (
        "rank 1 crashed with RuntimeError: CUDA error: invalid device ordinal — host node0 runs "
        "2 ranks but rank 1 sees 1 GPU: local rank 1 has no cuda:1"
    )
    assert ordinal.hint == (
        "this node runs more ranks than it has GPUs (--nproc-per-node 2 for 1 GPU): lower "
        "--nproc-per-node to 1, or expose 2 GPUs to each node (the job's GPU allocation, "
        "CUDA_VISIBLE_DEVICES)"
    )
    assert crashed.message.endswith("local rank 1 has no cuda:1")


def test_device_ordinal_from_the_global_rank_on_the_second_node() -> None:
    """Two nodes of four GPUs: rank 5 (local rank 1) asked for cuda:5. Here, and only here,
    set_device(local_rank) is the fix."""
    per_node = {"local_world_size": 4, "device_count": 4}
    state = state_of(
        *(
            rank(r, 8, local_rank=r % 4, node_rank=r // 4, host=f"node{r // 4}",
                 device=f"cuda:{r % 4}", device_index=r % 4, **per_node)
            for r in range(8)
        )
    )  # fmt: skip
    state.ranks[5] = rank(
        5, 8, local_rank=1, node_rank=1, host="node1", **per_node, **ORDINAL_CRASH
    )
    alerts = diagnose(state, NOW, TH)
    ordinal = only(alerts, "device_ordinal")
    assert ordinal.ranks == (5,)
    assert ordinal.message == (
        "rank 5 crashed with RuntimeError: CUDA error: invalid device ordinal — the global rank "
        "was used as the CUDA device index; host node1 has 4 GPUs"
    )
    assert ordinal.hint == (
        "use torch.cuda.set_device(local_rank) — LOCAL_RANK is 1 on this rank — not the global rank"
    )
    assert only(alerts, "crashed").hint.startswith("use torch.cuda.set_device(local_rank)")


def test_device_ordinal_fixes_per_case_when_ranks_differ() -> None:
    """Ranks in different cases get each case's fix with their ranks."""
    per_node = {"local_world_size": 2, "world": 4}
    state = state_of(
        rank(0, local_rank=0, device_count=0, **per_node, **ORDINAL_CRASH),
        rank(3, local_rank=1, node_rank=1, device_count=2, **per_node, **ORDINAL_CRASH),
    )
    hint = only(rule_device_ordinal(state, NOW, TH), "device_ordinal").hint
    assert hint == (
        f"rank 0: {NO_GPU_FIX}; rank 3: use torch.cuda.set_device(local_rank) — LOCAL_RANK is "
        "1 on this rank — not the global rank"
    )


def test_local_rank_mismatch() -> None:
    state = state_of(gpu(0, 0), gpu(1, 2), gpu(2, 1), gpu(3, 3))
    alert = only(diagnose(state, NOW, TH), "local_rank_mismatch")
    assert (alert.severity, alert.ranks) == ("warning", (1, 2))
    single = state_of(rank(1, device="cuda:0", device_index=0, device_count=1))
    assert rule_local_rank_mismatch(single, NOW, TH) == []


@pytest.mark.parametrize(
    ("used", "culprits"),
    [
        ((20, 10, 10, 10), (0,)),
        ((12, 10, 10, 10), ()),  # 1.2x: normal
        ((0.9, 0.3, 0.3, 0.3), ()),  # 3x but only 0.6 GiB apart
        ((20,), ()),  # one rank: nothing to compare
    ],
)
def test_uneven_memory(used: tuple[float, ...], culprits: tuple[int, ...]) -> None:
    state = state_of(*(rank(r, gpu_mem_used_bytes=int(g * GIB)) for r, g in enumerate(used)))
    alerts = rule_uneven_memory(state, NOW, TH)
    assert [a.ranks for a in alerts] == ([culprits] if culprits else [])
    if culprits:
        assert alerts[0].message == ("rank 0 uses 20.0 GiB of GPU memory, 2.0x the median 10.0 GiB")


def test_uneven_memory_falls_back_to_reserved() -> None:
    state = state_of(*(rank(r, mem_reserved_bytes=(30 if r == 2 else 8) * GIB) for r in range(4)))
    assert only(rule_uneven_memory(state, NOW, TH), "uneven_memory").ranks == (2,)


def test_uneven_memory_on_a_shared_gpu_compares_what_each_rank_reserved() -> None:
    """Two ranks on one GPU (gloo over CUDA tensors): NVML's used memory is the whole GPU's,
    the same for both, so rank 1's extra 10 GiB shows only in its allocator's reservation."""
    one_gpu = {"device": "cuda:0", "device_uuid": "GPU-1", "gpu_mem_used_bytes": 14 * GIB}
    state = state_of(
        rank(0, 2, mem_reserved_bytes=2 * GIB, **one_gpu),
        rank(1, 2, mem_reserved_bytes=12 * GIB, **one_gpu),
        rank(2, 2, mem_reserved_bytes=2 * GIB, **{**one_gpu, "device_uuid": "GPU-2"}),
    )
    assert only(rule_uneven_memory(state, NOW, TH), "uneven_memory").ranks == (1,)


def test_foreign_memory() -> None:
    state = state_of(
        gpu(0, 0, gpu_pids=[1000, 555]),
        gpu(1, 1, gpu_pids=[1001]),
        gpu(2, 2, gpu_pids=[1002, 1000]),  # rank 0 touching GPU 2 is not foreign
    )
    alert = only(rule_foreign_memory(state, NOW, TH), "foreign_memory")
    assert (alert.severity, alert.ranks) == ("warning", (0,))
    assert alert.message == (
        "the GPU of rank 0 (cuda:0 on node0) also holds process 555 that is not a rank of this job"
    )


def test_foreign_memory_quiet_when_pids_come_from_another_namespace() -> None:
    state = state_of(gpu(0, 0, gpu_pids=[91000]), gpu(1, 1, gpu_pids=[91001]))
    assert rule_foreign_memory(state, NOW, TH) == []


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


def test_straggler_recovery_does_not_blame_the_ranks_that_went_on_first() -> None:
    """Rank 1 finished the collective and stepped on before rank 0's next heartbeat."""
    state = job(2)
    state.ranks[0] = rank(0, 2, step=500, **waiting_in("all_reduce", 7, 8.0))
    state.ranks[1] = rank(1, 2, step=501, last_step_at=NOW - 0.1)
    assert rule_straggler(state, NOW, TH) == []


def test_straggler_far_ahead_or_busy_without_stepping_is_still_named() -> None:
    # extra batches on rank 1 while rank 0 waits in the final barrier
    ahead = job(2)
    ahead.ranks[0] = rank(0, 2, step=500, **waiting_in("barrier", 9, 8.0))
    ahead.ranks[1] = rank(1, 2, step=540, last_step_at=NOW - 0.1)
    assert only(rule_straggler(ahead, NOW, TH), "straggler").ranks == (1,)
    # rank 1 evaluates alone (forward passes, no steps) while rank 0 waits
    busy = job(2)
    busy.ranks[0] = rank(0, 2, step=500, **waiting_in("barrier", 9, 8.0))
    busy.ranks[1] = rank(1, 2, step=500, last_progress=NOW - 0.05, last_step_at=NOW - 9.0)
    assert only(rule_straggler(busy, NOW, TH), "straggler").ranks == (1,)


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

    state = job(4, avg_collective_time_s=0.1, avg_step_time_s=0.2, collective_time_samples=10)
    state.ranks[3].avg_collective_time_s = 0.01
    monkeypatch.setattr(rules, "RULES", (broken, *rules.RULES))
    monkeypatch.setattr(rules, "RULE_FAILURES", type(rules.RULE_FAILURES)())
    assert kinds(rules.diagnose(state, NOW, TH)) == ["slow_rank"]
    assert kinds(rules.diagnose(state, NOW, TH)) == ["slow_rank"]
    assert rules.RULE_FAILURES == {"broken": 2}


def test_step_skew_after_a_long_barrier_reads_the_fastest_rank() -> None:
    """Benchmark rank0-checkpoint: rank 0 left a 25 s barrier first and ran 5 steps before
    rank 2's next heartbeat; rank 2's last step time is the wait itself. Not a skew."""
    state = job(3, step=21, step_time_s=25.0, avg_step_time_s=1.2)
    state.ranks[0] = rank(0, 3, step=26, step_time_s=0.03, avg_step_time_s=1.2)
    assert rule_step_skew(state, NOW, TH) == []
    state.ranks[2] = rank(2, 3, step=21 - 60, step_time_s=0.03, avg_step_time_s=0.03)
    assert kinds(rule_step_skew(state, NOW, TH)) == ["step_skew"]  # a real gap still shows
