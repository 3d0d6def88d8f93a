"""A healthy lockstep job of ``RankRecord``'s, built directly, for the rule tests to perturb:
``job(world)`` is ``world`` ranks at step 500 on one host, ``rank(r, **changes)`` one of them
changed; errors as torch and gloo print them."""

from __future__ import annotations

import dataclasses
import math
from array import array
from typing import Any

from ddpwatch.core.protocol import Collective, ErrorInfo
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.state.records import Beat, RankRecord
from ddpwatch.state.state import ServerState

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


def beats(
    n: int = 10,
    *,
    step: float,
    waited: float,
    gap: float = 0.5,
    stands_for: float = 1.0,
    **parts: float,
) -> array[float]:
    """``RankRecord.beats``: ``n`` like heartbeats ``gap`` apart, each of steps of ``step``
    seconds that waited ``waited`` for the others and standing for ``stands_for`` heartbeats
    (a paced relay's); ``parts`` the other ``Beat`` columns by name (``grad_wait``,
    ``input_wait``, ``compute``, ``data_wait``), NaN (untimed) if left out."""
    one = [math.nan] * len(Beat)
    one[Beat.GAP], one[Beat.STEP], one[Beat.WAITED] = gap, step, waited
    one[Beat.STANDS_FOR] = stands_for
    for name, value in parts.items():
        one[Beat[name.upper()]] = value
    return array("d", one * n)


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
