"""The collectives family (``diagnosis/rules/collectives.py``): the straggler the others wait
for in a collective, everyone waiting (a network stall), and ranks in different collectives."""

from __future__ import annotations

import pytest
from lockstep import (
    NOW,
    STACK,
    TH,
    job,
    kinds,
    only,
    rank,
    state_of,
    waiting_in,
)

from ddpwatch.core.protocol import Collective, ErrorInfo
from ddpwatch.diagnosis.rules import (
    diagnose,
    rule_collective_mismatch,
    rule_straggler,
)
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState


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


COMPILE_STACK = STACK.replace(
    "    y = self.net(x)\n",
    "    y = self.net(x)\n"
    '  File "/home/ann/.venv/lib/python3.11/site-packages/torch/_dynamo/convert_frame.py", '
    "line 1681, in compile_inner\n"
    "    result = _compile_inner(code, one_graph, hooks)\n",
)


def test_straggler_compiling_says_so_and_why() -> None:
    """One rank recompiles (its batch has another size) while the others wait in the
    all-reduce: it is the straggler, compiling, for the reason torch gave."""
    state = straggler_job()
    reason = "tensor 'x' size mismatch at index 0. expected 32, actual 31"
    state.ranks[1] = rank(
        1,
        3,
        step=311,
        stack=COMPILE_STACK,
        last_progress=NOW - 12.4,
        phase="compiling",
        compile_reason=reason,
    )
    alerts = diagnose(state, NOW, TH)
    assert [(a.kind, a.severity, a.ranks, a.waiting) for a in alerts] == [
        ("straggler", "error", (1,), (0, 2))
    ]
    assert alerts[0].message == (
        "rank 1 has not entered all_reduce #42 that ranks 0, 2 have waited in for 12.4 s; "
        f"it is compiling (torch.compile recompiles: {reason}) at step 311, train.py:88"
    )
    assert alerts[0].hint.startswith("rank 1 is inside torch.compile while the others wait")
    assert "TORCH_LOGS=recompiles" in alerts[0].hint
    state.ranks[1].compile_reason = None  # a first compile on this rank alone
    assert only(diagnose(state, NOW, TH), "straggler").message.endswith(
        "; it is compiling (torch.compile) at step 311, train.py:88"
    )


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


def gathering(r: int, numel: int, known: bool = True) -> RankRecord:
    """A rank of a 4-rank job in all_gather #30 with ``numel`` elements; not ``known``: gloo
    aborted it from C++ before a heartbeat saw it there (silent, no call reported)."""
    if not known:
        return rank(r, last_seen=NOW - 5.0, last_progress=NOW - 5.0)
    call = Collective(op="gloo:all_gather", seq=30, since_s=2.6, shape=[numel], dtype="float32")
    return rank(r, collective=call, collective_seen=NOW - 0.4)


@pytest.mark.parametrize("known", [(0, 1, 2, 3), (0, 1, 2), (0, 2, 3)])
def test_all_gather_sizes_name_the_odd_rank_against_a_majority(known: tuple[int, ...]) -> None:
    """Lightning #7773 with 4 ranks: rank 2 gathers 5 elements, the others 4."""
    state = state_of(*(gathering(r, 5 if r == 2 else 4, r in known) for r in range(4)))
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert alert.ranks == (2,)
    assert alert.message.startswith("rank 2 called all_gather with 5 elements (float32)")


def test_all_gather_sizes_with_two_calls_unknown_name_no_one() -> None:
    """gloo aborted two ranks before they reported their calls (seen: ranks 1 and 3): one call
    of each size is known, either may be the odd one, so no rank is named (a wrong culprit is
    worse than none) and the alert says whose calls are missing."""
    state = state_of(*(gathering(r, 5 if r == 2 else 4, r in (0, 2)) for r in range(4)))
    alert = only(rule_collective_mismatch(state, NOW, TH), "collective_mismatch")
    assert (alert.ranks, alert.severity) == ((), "error")
    assert alert.message.startswith("the ranks made different calls at collective #30: ")
    assert alert.message.endswith(
        "ranks 1, 3's calls are not known, so which side is odd cannot be told"
    )


def test_a_rank_that_evaluated_through_its_ddp_model_alone_is_named() -> None:
    """The one-rank evaluation through the DDP wrapper of a BatchNorm model: each forward
    broadcasts the buffers from rank 0, a collective the others did not make. gloo lets it
    complete and the job runs on, one collective off: the marks name rank 0."""
    from ddpwatch.diagnosis.rules import rule_evaluation_desync

    state = job(3, evals_marked={16: 0, 24: 0})
    assert rule_evaluation_desync(state, NOW, TH) == []
    state.ranks[0] = rank(0, 3, evals_marked={16: 0, 24: 1})
    found = only(rule_evaluation_desync(state, NOW, TH), "collective_mismatch")
    assert (found.severity, found.ranks, found.waiting) == ("error", (0,), (1, 2))
    assert found.message.startswith(
        "rank 0 had run 1 evaluation forward through its DDP model more than ranks 1, 2 by "
        "step 24 (1 against 0): each broadcasts the model's buffers"
    ), found.message
    assert "model.module" in found.hint
    every = job(3, evals_marked={16: 5, 24: 5})  # every rank validates through the wrapper
    assert rule_evaluation_desync(every, NOW, TH) == []
