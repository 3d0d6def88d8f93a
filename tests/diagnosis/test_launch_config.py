"""Start-up configuration that differs between ranks (``diagnosis/rules/launch_config.py``)."""

from __future__ import annotations

from typing import Any

import pytest
from lockstep import NOW, TH, only, rank, state_of

from ddpwatch.core.protocol import ErrorInfo
from ddpwatch.diagnosis.rules import diagnose, rule_config_mismatch
from ddpwatch.state.records import RankRecord

ENV = {"master_addr": "node-a", "master_port": "29500", "init_method": "env://"}


def waiting(r: int, since: float = 5.0, world: int = 3, **changes: Any) -> RankRecord:
    """A rank that called init_process_group and waits in it."""
    fields = {**ENV, "phase": "rendezvous", "phase_since": NOW - since, **changes}
    return rank(r, world, step=None, **fields)


def config_alerts(*records: RankRecord) -> list[Any]:
    return [a for a in diagnose(state_of(*records), NOW, TH) if a.kind == "config_mismatch"]


def test_the_rank_with_another_master_port_is_named_with_both_values() -> None:
    """A hand launch (an srun line per rank, seed 004's reports) with one MASTER_PORT typo."""
    state = state_of(waiting(0), waiting(1), waiting(2, master_port="41233"))
    alert = only(rule_config_mismatch(state, NOW, TH), "config_mismatch")
    assert (alert.severity, alert.ranks, alert.waiting) == ("error", (2,), (0, 1))
    assert alert.message == (
        "rank 2 uses MASTER_PORT 41233; ranks 0, 1 use 29500: the ranks cannot meet in the "
        "rendezvous (5.0 s so far)"
    )
    assert "MASTER_ADDR:MASTER_PORT" in alert.hint


@pytest.mark.parametrize(
    ("odd", "field", "value", "words"),
    [
        (0, "master_port", "29501", "rank 0 uses MASTER_PORT 29501"),  # rank 0 hosts the store
        (1, "world_size", 4, "rank 1 uses WORLD_SIZE 4; ranks 0, 2 use 3"),
        (2, "run_id", "job-b", "rank 2 uses TORCHELASTIC_RUN_ID job-b"),
        (1, "master_addr", "node-b", "rank 1 uses MASTER_ADDR node-b"),
        (2, "backend", "nccl", "rank 2 uses backend nccl; ranks 0, 1 use gloo"),
    ],
)
def test_each_rendezvous_value_names_the_odd_rank(
    odd: int, field: str, value: Any, words: str
) -> None:
    same = {"backend": "gloo", "run_id": "job-a"}
    records = [waiting(r, **same) for r in range(3)]
    records[odd] = waiting(odd, **{**same, field: value})
    (alert,) = config_alerts(*records)
    assert (alert.ranks, alert.severity) == ((odd,), "error")
    assert alert.message.startswith(words), alert.message


def test_a_world_size_that_disagrees_names_no_missing_rank() -> None:
    """The world size most ranks report is the job's: rank 3, which only rank 1's WORLD_SIZE
    counts, is no rank that never connected."""
    records = [waiting(r, since=70.0) for r in range(3)]
    records[1] = waiting(1, since=70.0, world=4)
    alerts = diagnose(state_of(*records), NOW, TH)
    assert {a.kind for a in alerts if 3 in a.ranks} == set()
    assert only(alerts, "config_mismatch").ranks == (1,)


def test_two_ranks_one_value_each_names_no_rank() -> None:
    (alert,) = config_alerts(waiting(0, world=2), waiting(1, world=2, master_port="41233"))
    assert (alert.ranks, alert.severity) == ((), "error")
    assert alert.message.startswith(
        "the ranks disagree on MASTER_PORT: rank 0 29500, rank 1 41233"
    ), alert.message
    assert "cannot be told" in alert.hint


@pytest.mark.parametrize(
    "records",
    [
        pytest.param(  # held under 2 s: the rendezvous may still complete
            [waiting(0, 1.0), waiting(1, 1.0), waiting(2, 1.0, master_port="41233")], id="soon"
        ),
        pytest.param(  # the group formed anyway: localhost on one, the host's name on others
            [rank(r, 3, **ENV) for r in (0, 1)]
            + [rank(2, 3, **{**ENV, "master_addr": "localhost"})],
            id="formed",
        ),
        pytest.param(  # tcp:// ignores $MASTER_PORT
            [waiting(r, init_method="tcp://node-a:23456") for r in (0, 1)]
            + [waiting(2, init_method="tcp://node-a:23456", master_port="1")],
            id="tcp-init",
        ),
        pytest.param(  # rank 2 has not called init_process_group yet: its env is not judged
            [waiting(0), waiting(1), rank(2, 3, step=None, phase="started", master_port="1")],
            id="not-called",
        ),
        pytest.param([waiting(r) for r in range(3)], id="same"),
    ],
)
def test_no_alert_where_the_values_did_no_harm(records: list[RankRecord]) -> None:
    assert config_alerts(*records) == []


def test_a_rank_that_died_in_the_rendezvous_keeps_the_alert() -> None:
    """The odd rank's init_process_group timed out (it crashed there): still named."""
    died = ErrorInfo(type="DistStoreError", message="Timed out after 1801 seconds")
    records = [waiting(0), waiting(1), waiting(2, 0.5, master_port="41233", error=died)]
    (alert,) = config_alerts(*records)
    assert alert.ranks == (2,) and alert.message.endswith("cannot meet in the rendezvous")


def test_a_different_torch_or_script_is_a_warning_while_the_job_runs() -> None:
    records = [rank(r, 3, torch_version="2.13.0", script_hash="aa11") for r in range(3)]
    records[1] = rank(1, 3, torch_version="2.12.0", script_hash="aa11")
    records[2] = rank(2, 3, torch_version="2.13.0", script_hash="bb22")
    (alert,) = config_alerts(*records)
    assert (alert.severity, alert.ranks, alert.waiting) == ("warning", (1, 2), ())
    assert alert.message == (
        "rank 1 runs torch 2.12.0; ranks 0, 2 run 2.13.0; rank 2 runs another copy of the "
        "script (SHA-256 bb22…); ranks 0, 1 run aa11…"
    )


def test_the_differences_follow_an_identity_change() -> None:
    """Worked out once per generation: a rank's new identity is seen at once."""
    records = [waiting(r) for r in range(3)]
    state = state_of(*records)
    assert rule_config_mismatch(state, NOW, TH) == []
    state.ranks[2].master_port = "41233"
    state.generation += 1
    assert only(rule_config_mismatch(state, NOW, TH), "config_mismatch").ranks == (2,)


STORE_WAIT = ErrorInfo(
    type="DistStoreError", message="wait timeout after 20000ms, keys: /default_pg/0//cpu//0/0"
)
CLIENTS = ErrorInfo(
    type="DistStoreError",
    message="Timed out after 21 seconds waiting for clients. 2/3 clients joined.",
)
NO_STORE = ErrorInfo(
    type="DistNetworkError",
    message="The client socket has timed out after 20000ms while trying to connect to "
    "(127.0.0.1, 41233).",
)


@pytest.mark.parametrize("odd_died", [False, True], ids=["odd-alive", "odd-died"])
def test_the_ranks_that_timed_out_waiting_for_the_odd_rank_are_not_named(odd_died: bool) -> None:
    """Seen live: ranks 1 and 0 timed out in the rendezvous 10 s before rank 2 (the odd
    port) did; each was named in a crash alert of its own."""
    odd = {"error": NO_STORE, "error_time": NOW - 1} if odd_died else {}
    records = [
        waiting(0, 30.0, error=CLIENTS, error_time=NOW - 8),
        waiting(1, 30.0, error=STORE_WAIT, error_time=NOW - 9),
        waiting(2, 30.0, master_port="41233", **odd),
    ]
    alerts = diagnose(state_of(*records), NOW, TH)
    assert [(a.kind, a.ranks, a.waiting) for a in alerts] == [("config_mismatch", (2,), (0, 1))], (
        alerts
    )


def test_a_rank_still_waiting_after_the_others_gave_up_is_not_the_one_behind() -> None:
    """Seen live: rank 0 (the store's host) took a port of its own; ranks 0 and 2 timed
    out, and rank 1, still retrying its connection 60 s on, was "still in 'rendezvous'"."""
    records = [
        waiting(0, 70.0, master_port="41234", error=CLIENTS, error_time=NOW - 30),
        waiting(1, 70.0),
        waiting(2, 70.0, error=NO_STORE, error_time=NOW - 20),
    ]
    alerts = diagnose(state_of(*records), NOW, TH)
    assert [(a.kind, a.ranks) for a in alerts] == [("config_mismatch", (0,))], alerts
