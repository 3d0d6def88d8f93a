"""Ranks started by hand with a start-up configuration of their own, under ``ddpwatch run``.

From PyTorch #76069 and #53395: every process picked its own ``MASTER_PORT`` (a free port
found locally, a per-node ``srun`` line) and ``init_process_group`` hung on every rank until
its timeout. Real processes, real gloo rendezvous (``tests/scripts/hand_launch.py``), the
zero-code agent: the odd rank is named with both values while the others wait, and no rank
that waited is ever named; the same launch with one configuration stays silent.
"""

from __future__ import annotations

import sys

import pytest
from conftest import SCRIPTS, LiveServer, ddpwatch_run, free_port_pair

pytestmark = [pytest.mark.e2e, pytest.mark.timeout(240)]

INIT_TIMEOUT_S = 20  # long enough for every rank to reach the rendezvous on a loaded machine


def hand_launch(server: LiveServer, *options: str) -> int:
    result = ddpwatch_run(
        server, sys.executable, str(SCRIPTS / "hand_launch.py"), "--world", "3",
        "--port", str(free_port_pair()), "--init-timeout", str(INIT_TIMEOUT_S), *options,
        timeout=180,
    )  # fmt: skip
    return result.returncode


@pytest.mark.parametrize(
    ("option", "odd"),
    [
        pytest.param("--odd=2:MASTER_PORT=41233", 2, id="srun-line-of-its-own"),
        # #53395: the script finds a free port itself just before init_process_group; on
        # rank 0 that is where it hosts the store, so the others find nobody at theirs
        pytest.param("--in-code=0:MASTER_PORT=41234", 0, id="port-picked-in-code-on-rank-0"),
    ],
)
def test_the_rank_with_a_port_of_its_own_is_named_while_the_others_wait(
    live_server: LiveServer, option: str, odd: int
) -> None:
    assert hand_launch(live_server, option) != 0  # the rendezvous timed out, as without us
    raised = [c for c in live_server.changes if c.event != "cleared"]
    config = [c for c in raised if c.alert.kind == "config_mismatch"]
    # before every rank reported, two ranks that disagree are a tie: which is odd cannot be
    # told, and the alert names nobody (correctly); the first that names a rank is the verdict
    named = [c for c in config if c.alert.ranks]
    assert named, [c.alert.to_dict() for c in raised]
    first = named[0].alert
    assert (first.severity, first.ranks) == ("error", (odd,)), first.to_dict()
    others = tuple(r for r in range(3) if r != odd)
    assert first.waiting == others and "MASTER_PORT 4123" in first.message, first.to_dict()
    before = raised[: raised.index(named[0])]
    assert not [c.alert.to_dict() for c in before if c.alert.kind == "crashed"]  # named first
    blamed = {r for c in raised for r in c.alert.ranks}
    assert blamed == {odd}, [c.alert.to_dict() for c in raised]  # never a rank that waited


def test_a_hand_launch_with_one_configuration_says_nothing(live_server: LiveServer) -> None:
    assert hand_launch(live_server, "--steps", "30") == 0
    assert [c.alert.to_dict() for c in live_server.changes] == []
