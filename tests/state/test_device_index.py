"""The device index the server keeps as identities arrive (``state/devices.py``) is exactly the
one built from the records, and the device rules reading it name exactly the ranks they name
from the records.

A rank missed by the index would be a duplicate GPU never told; one left in it after its
process moved, a wrong culprit. The streams below change everything the index follows: hosts,
devices by ordinal, by UUID and through CUDA_VISIBLE_DEVICES, local ranks and GPU counts, the
processes each GPU lists (its own alone, another rank's, another job's); a
restarted worker (a new pid) taking over its rank with another GPU, or none yet; a launcher's
new attempt; crashes and exits; silences.
"""

from __future__ import annotations

import random

import pytest

from ddpwatch.core.protocol import AnyMessage, ErrorInfo, Event, Hello, Sample
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.rules import (
    rule_device_ordinal,
    rule_duplicate_device,
    rule_foreign_memory,
    rule_local_rank_mismatch,
)
from ddpwatch.state.devices import DeviceIndex
from ddpwatch.state.state import ServerState

TH = Thresholds()
T0 = 9000.0
WORLD = 10
DEVICE_RULES = (
    rule_duplicate_device,
    rule_device_ordinal,
    rule_local_rank_mismatch,
    rule_foreign_memory,
)


def _identity(rng: random.Random, rank: int) -> dict[str, object]:
    """A GPU identity drawn from few choices, so that ranks share GPUs now and then."""
    index = rng.choice([0, 1, rank % 4, rank])
    fields: dict[str, object] = {
        "host": rng.choice(["node0", "node1"]),
        "device": rng.choice([f"cuda:{index}", f"cuda:{index}", "cpu"]),
        "device_index": index,
        "local_rank": rng.choice([rank % 4, 0, None]),
        "device_count": rng.choice([1, 4, 8, None]),
        "local_world_size": rng.choice([4, WORLD]),
    }
    if rng.random() < 0.3:
        fields["device_uuid"] = rng.choice(["GPU-a", "GPU-b", f"GPU-{rank}"])
    if rng.random() < 0.3:
        fields["cuda_visible_devices"] = rng.choice(["0", "1", "0,1,2,3", "3,2,1,0"])
    return fields


def _message(
    rng: random.Random, rank: int, pids: dict[int, int], attempt: list[int]
) -> AnyMessage:
    roll = rng.random()
    base = {"v": 1, "rank": rank, "t": 0.0}
    if roll < 0.04:  # the worker restarts: a new process, which has not said its GPU yet
        pids[rank] += 1000
        return Hello(**base, pid=pids[rank], world_size=WORLD)
    if roll < 0.05:  # the launcher starts its next attempt
        attempt[0] += 1
        pids[rank] += 1000
        return Hello(
            **base, pid=pids[rank], world_size=WORLD, restart_count=attempt[0] - 1,
            **_identity(rng, rank),
        )  # fmt: skip
    if roll < 0.07:
        error = ErrorInfo(type="RuntimeError", message="CUDA error: out of memory")
        return Event(**base, event=rng.choice(["crash", "exit"]), error=error)
    if roll < 0.35:  # the rank's identity changes (a set_device, a hello)
        return Sample(**base, pid=pids[rank], world_size=WORLD, step=1, **_identity(rng, rank))
    pid = pids[rank]
    listed = rng.choice([[pid], [pid], [pid, 555], [pid, pids[(rank + 1) % WORLD]], [7], [], None])
    return Sample(**base, pid=pid, step=rng.randrange(100), gpu_pids=listed)  # a plain heartbeat


def _index_view(index: DeviceIndex) -> tuple[object, ...]:
    shared = {key: frozenset(members) for key, members in index.shared.items()}
    return shared, frozenset(index.ordinal), frozenset(index.off_local), frozenset(index.sharing)


@pytest.mark.parametrize("seed", range(12))
def test_the_kept_index_is_the_one_built_from_the_records(seed: int) -> None:
    rng = random.Random(seed)
    state = ServerState(started=T0)
    pids = {r: 100 + r for r in range(WORLD)}
    attempt = [1]
    now = T0
    for step in range(600):
        now += rng.choice([0.001, 0.01, 0.5])
        rank = rng.randrange(WORLD)
        if rng.random() < 0.1 and rank % 3 == 0:
            continue  # some ranks go quiet for a while
        state.apply(_message(rng, rank, pids, attempt), now)
        assert _index_view(state.devices) == _index_view(DeviceIndex.of(state.ranks.values()))
        if step % 20 == 0:
            judged = now + rng.choice([0.0, 3.0, 40.0])  # silences count too
            kept = Facts(state, judged, TH, None, state.waits, state.devices)
            for rule in DEVICE_RULES:
                assert rule(state, judged, TH, kept) == rule(state, judged, TH), rule.__name__


def test_a_restarted_rank_forgets_the_gpu_of_its_last_process() -> None:
    state = ServerState(started=T0)
    for rank in (0, 1):
        state.apply(
            Hello(v=1, rank=rank, t=0.0, pid=10 + rank, host="n", device="cuda:0",
                  device_index=0, local_rank=rank, device_count=2),
            T0,
        )  # fmt: skip
    assert [sorted(m) for m in state.devices.shared.values()] == [[0, 1]]
    assert rule_duplicate_device(state, T0, TH)[0].ranks == (1,)  # cuda:0 with local rank 1
    state.apply(Hello(v=1, rank=1, t=0.0, pid=99), T0 + 1)  # its new process: no GPU yet
    assert state.devices.shared == {}
    assert rule_duplicate_device(state, T0 + 1, TH) == []
    state.apply(
        Sample(v=1, rank=1, t=0.0, pid=99, host="n", device="cuda:1", device_index=1,
               local_rank=1, device_count=2),
        T0 + 2,
    )  # fmt: skip
    assert state.devices.shared == {} and state.devices.off_local == set()
