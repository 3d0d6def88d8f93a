"""Fixed synthetic status documents for the dashboard's tests, snapshots and benchmark.

Deterministic: no clocks, no randomness. ``document(tick)`` is a 16-rank job on
two hosts with a straggler, a crashed rank with its traceback, a NaN loss, two
ranks on one GPU, a silent rank, a rank that never connected and a simulated
rank (every rank but the last two reports its step split, the straggler's wait short); ``tick`` advances time and steps by half a second per tick. ``big(n)`` is
an ``n``-rank job (8 ranks per host) for the performance tests.
"""

from __future__ import annotations

import copy
from collections.abc import Iterable
from typing import Any

import msgspec

from ddpwatch.status.schema import RankEntry, StatusDocument, SummaryReply

T0 = 1_760_000_000.0
"""The fixed server_time of tick 0."""
STARTED = T0 - 3725.0
"""When the fixed server started: uptime 1h02m05s at tick 0."""
GIB = 1 << 30

RANK_DEFAULTS: dict[str, Any] = {
    f.name: msgspec.to_builtins(f.default)
    for f in msgspec.structs.fields(RankEntry)
    if f.default is not msgspec.NODEFAULT
}
"""Every field of a rank entry with the value the server writes when it knows nothing of it:
derived from ``RankEntry``, so a field added there is in every fixture rank."""

WAITING_STACK = """\
Thread 0x7f3a1c2b5740 (most recent call first):
  File "/opt/torch/distributed/distributed_c10d.py", line 2806 in all_reduce
  File "/opt/torch/nn/parallel/distributed.py", line 1639 in _sync_buffers
  File "/work/train.py", line 88 in train_step
  File "/work/train.py", line 121 in main"""

STRAGGLER_STACK = """\
Thread 0x7f0b2e9d1740 (most recent call first):
  File "/usr/lib/python3.11/socket.py", line 720 in readinto
  File "/work/data/shards.py", line 57 in fetch_shard
  File "/work/data/loader.py", line 133 in __next__
  File "/work/train.py", line 84 in train_step
  File "/work/train.py", line 121 in main"""

CRASH_TRACEBACK = """\
Traceback (most recent call last):
  File "/work/train.py", line 121, in main
    loss = train_step(model, batch)
  File "/work/train.py", line 92, in train_step
    loss.backward()
  File "/opt/torch/_tensor.py", line 626, in backward
    torch.autograd.backward(self, gradient, retain_graph, create_graph, inputs=inputs)
torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 5 has a total \
capacity of 79.10 GiB of which 1.12 GiB is free."""


def typed(document: dict[str, Any]) -> StatusDocument:
    """A fixture document as the dashboard reads it (``status.schema``): a summary reply when
    it has a ``summary``. The fixtures write documents as JSON values, as they go on the wire."""
    kind = SummaryReply if "summary" in document else StatusDocument
    typed_document = msgspec.convert(document, kind)
    if kind is StatusDocument and typed_document.verdict is None:  # the server judges it
        from ddpwatch.diagnosis.verdict import judged

        typed_document.verdict = judged(typed_document)
    return typed_document


def rank_entry(rank: int, world_size: int, **values: Any) -> dict[str, Any]:
    """One rank as the status document shows it: every field present, unknown ones None."""
    entry: dict[str, Any] = dict(RANK_DEFAULTS)
    entry.update(rank=rank, world_size=world_size, state="not_connected")
    entry.update(values)
    return entry


def _healthy(
    rank: int, world: int, per_host: int, tick: int, hosts: list[str], **extra: Any
) -> dict[str, Any]:
    local = rank % per_host
    node = rank // per_host
    step = 130 + tick // 2
    alloc = (11.0 + 0.25 * (rank % 5)) * GIB
    values: dict[str, Any] = {
        "local_rank": local,
        "local_world_size": per_host,
        "node_rank": node,
        "host": hosts[node],
        "pid": 41000 + rank * 7,
        "device": f"cuda:{local}",
        "device_index": local,
        "device_uuid": f"GPU-{node:02x}{local:02x}a1c0-5e7d-4b1e-9c3f-{rank:012x}",
        "device_name": "NVIDIA H100 80GB HBM3",
        "launcher": "torchrun",
        "state": "running",
        "phase": "forward",
        "step": step,
        "loss": round(2.5 - 0.004 * step + 0.01 * (rank % 3), 4),
        "step_time_s": round(0.41 + 0.002 * (rank % 4) + 0.015 * ((step * 7 + rank) % 5), 4),
        "avg_step_time_s": 0.412,
        "data_wait_s": 0.012,
        "collective_time_s": 0.08,
        "mem_allocated_bytes": int(alloc + (step % 4) * 0.2 * GIB),
        "mem_reserved_bytes": int(alloc + 2.5 * GIB),
        "mem_peak_bytes": int(alloc + 3.5 * GIB),
        "gpu_mem_used_bytes": int(alloc + 4 * GIB),
        "gpu_mem_total_bytes": 80 * GIB,
        "gpu_pids": [41000 + rank * 7],
        "last_seen_s": round(0.1 + 0.05 * (rank % 4), 3),
    }
    values.update(extra)
    return rank_entry(rank, world, **values)


def document(tick: int = 0) -> dict[str, Any]:
    """The 16-rank job at ``tick`` (0.5 s apart): worst problems on ranks 5, 11, 14, 15, 3, 6/7."""
    world, per_host = 16, 8
    hosts = ["node-a", "node-b"]
    wait = 12.4 + 0.5 * tick
    seq = 131
    step = 130 + tick // 2
    ranks = []
    for rank in range(world):
        entry = _healthy(rank, world, per_host, tick, hosts)
        # everybody else waits for rank 11 in all_reduce #131
        entry.update(
            state="waiting",
            phase="backward",
            collective={"op": "all_reduce", "seq": seq, "since_s": round(wait, 3)},
            stack=WAITING_STACK,
            step=step,
            # the step split, per step: they wait ~0.2 s for rank 11's input every step
            input_wait_s=0.012,
            compute_s=round(0.2 + 0.004 * (rank % 4), 4),
            grad_wait_s=0.12,
        )
        ranks.append(entry)
    # rank 11: the straggler, still reading its data shard
    ranks[11].update(
        state="running",
        phase="data",
        collective=None,
        step=step - 1,
        step_time_s=round(2.9 + 0.1 * (tick % 3), 3),
        avg_step_time_s=2.75,
        data_wait_s=2.41,
        stack=STRAGGLER_STACK,
        input_wait_s=0.21,
        grad_wait_s=0.002,
        collective_time_s=0.001,
    )
    # rank 5: crashed with an out-of-memory error
    ranks[5].update(
        state="crashed",
        phase="backward",
        step=130,
        step_time_s=0.412,
        loss=1.98,
        collective=None,
        stack=None,
        error={
            "type": "torch.OutOfMemoryError",
            "message": "CUDA out of memory. Tried to allocate 2.00 GiB.",
            "traceback": CRASH_TRACEBACK,
        },
        exit_code=1,
        mem_allocated_bytes=77 * GIB,
        mem_reserved_bytes=78 * GIB,
        mem_peak_bytes=int(78.6 * GIB),
        gpu_mem_used_bytes=int(79.1 * GIB),
        last_seen_s=round(3.2 + 0.5 * tick, 3),
        log_tail=[
            "epoch 0 step 120 loss 2.031",
            "epoch 0 step 130 loss 1.980",
            "[rank5] allocating activation cache for seq_len=8192",
        ],
    )
    # rank 3: loss became NaN (the document shows null; the nan_loss alert names it)
    ranks[3].update(loss=None)
    # ranks 6 and 7 both on the same GPU (LOCAL_RANK mix-up)
    ranks[7].update(
        device="cuda:6",
        device_index=6,
        device_uuid=ranks[6]["device_uuid"],
        gpu_pids=[ranks[6]["pid"], ranks[7]["pid"]],
    )
    # rank 14: silent for 9.5 s
    ranks[14].update(
        state="silent", step=130, collective=None, last_seen_s=round(9.5 + 0.5 * tick, 3)
    )
    # rank 15: never connected
    ranks[15] = rank_entry(15, world)
    # rank 13: a simulated rank (ddpwatch demo) on node-b
    ranks[13].update(
        simulated=True,
        launcher="simulated",
        device_name=None,
        device_uuid=None,
        input_wait_s=None,  # a simulated rank times no step split
        compute_s=None,
        grad_wait_s=None,
    )
    waiting = [r for r in range(world) if ranks[r]["state"] == "waiting"]
    alerts = [
        {
            "kind": "crashed",
            "severity": "error",
            "ranks": [5],
            "waiting": [],
            "message": "rank 5 (node-a) crashed at step 130: torch.OutOfMemoryError: CUDA out of "
            "memory. Tried to allocate 2.00 GiB.",
            "hint": "reduce the batch size or enable activation checkpointing; rank 5 held 77 GiB "
            "while its peers held 11 GiB",
        },
        {
            "kind": "nan_loss",
            "severity": "error",
            "ranks": [3],
            "waiting": [],
            "message": "rank 3 loss is nan since step 127 while ranks 0-2, 4, 6-10, 12-13 are finite",
            "hint": "only some ranks diverge, so their data differs: look for a bad sample in their shard",
        },
        {
            "kind": "duplicate_device",
            "severity": "error",
            "ranks": [7],
            "waiting": [6],
            "message": "rank 6 and rank 7 both on CUDA device cuda:6 of node-a (same UUID)",
            "hint": "set the device from LOCAL_RANK before init_process_group: "
            "torch.cuda.set_device(int(os.environ['LOCAL_RANK']))",
        },
        {
            "kind": "silent",
            "severity": "error",
            "ranks": [14],
            "waiting": [],
            "message": f"rank 14 (node-b) sent nothing for {9.5 + 0.5 * tick:.1f} s",
            "hint": "the process is frozen or gone: check node-b (dmesg for the OOM killer, "
            "py-spy dump --pid 41098)",
        },
        {
            "kind": "straggler",
            "severity": "warning",
            "ranks": [11],
            "waiting": waiting,
            "message": f"rank 11 has not entered all_reduce #131 that ranks {_ranges(waiting)} have "
            f"waited in for {wait:.1f} s; it is in data (fetch_shard, shards.py:57)",
            "hint": "see where rank 11 is: slow data loading or I/O on node-b keeps it from all_reduce #131",
        },
        {
            "kind": "not_connected",
            "severity": "warning",
            "ranks": [15],
            "waiting": [],
            "message": "rank 15 of 16 never connected",
            "hint": "check that rank 15's host can reach the server (DDPWATCH_ADDR) and that it called "
            "ddpwatch.attach()",
        },
        {
            "kind": "uneven_memory",
            "severity": "info",
            "ranks": [5],
            "waiting": [],
            "message": "rank 5 allocated 77.0 GiB, 6.7x the median 11.5 GiB",
            "hint": "one rank holds more: unbalanced batches, or rank-0-only work such as evaluation",
        },
    ]
    return {
        "schema": 1,
        "server_time": T0 + 0.5 * tick,
        "world_size": world,
        "ranks": ranks,
        "alerts": alerts,
        "stats": {"received": 48_213 + 61 * tick, "rejected": 2},
    }


def healthy(n: int = 8, tick: int = 0) -> dict[str, Any]:
    """A job where nothing is wrong."""
    per_host = min(8, n)
    hosts = [f"gpu-{i:03d}" for i in range((n + per_host - 1) // per_host)]
    ranks = [_healthy(r, n, per_host, tick, hosts) for r in range(n)]
    return {
        "schema": 1,
        "server_time": T0 + 0.5 * tick,
        "world_size": n,
        "ranks": ranks,
        "alerts": [],
        "stats": {"received": 1000 + 16 * tick, "rejected": 0},
    }


def big(n: int = 8192, tick: int = 0) -> dict[str, Any]:
    """An ``n``-rank job (8 per host): one crashed rank near the end, one straggler, a few stalled."""
    per_host = 8
    hosts = [f"gpu-node-{i:04d}" for i in range((n + per_host - 1) // per_host)]
    ranks = [_healthy(r, n, per_host, tick, hosts, simulated=True) for r in range(n)]
    straggler, crashed = n // 2 + 3, n - 3
    stalled = [n // 3, n // 3 + 1]
    for r in stalled:
        ranks[r].update(state="stalled", phase="backward", step=ranks[r]["step"] - 2)
    ranks[straggler].update(phase="data", step_time_s=3.1, data_wait_s=2.7)
    ranks[crashed].update(
        state="crashed",
        error={
            "type": "RuntimeError",
            "message": "NCCL error: unhandled system error",
            "traceback": CRASH_TRACEBACK,
        },
        exit_code=1,
    )
    waiting = [r for r in range(0, n, 97) if r not in (straggler, crashed, *stalled)]
    for r in waiting:
        ranks[r].update(
            state="waiting", collective={"op": "all_reduce", "seq": 900 + tick, "since_s": 6.5}
        )
    alerts = [
        {
            "kind": "crashed",
            "severity": "error",
            "ranks": [crashed],
            "waiting": [],
            "message": f"rank {crashed} crashed: RuntimeError: NCCL error: unhandled system error",
            "hint": "look at rank's host for the NCCL error's cause (NCCL_DEBUG=INFO)",
        },
        {
            "kind": "straggler",
            "severity": "warning",
            "ranks": [straggler],
            "waiting": waiting,
            "message": f"rank {straggler} is 7.5x slower than the median step time",
            "hint": "slow data loading on its host",
        },
        {
            "kind": "stalled",
            "severity": "warning",
            "ranks": stalled,
            "waiting": [],
            "message": f"ranks {_ranges(stalled)} made no progress for 12.0 s",
            "hint": "see their stacks",
        },
    ]
    return {
        "schema": 1,
        "server_time": T0 + 0.5 * tick,
        "world_size": n,
        "ranks": ranks,
        "alerts": alerts,
        "stats": {"received": 10_000_000 + 2 * n * tick, "rejected": 0},
    }


def _ranges(ranks: Iterable[int]) -> str:
    ordered = sorted(ranks)
    pieces, start, prev = [], ordered[0], ordered[0]
    for r in [*ordered[1:], None]:
        if r is not None and r == prev + 1:
            prev = r
            continue
        pieces.append(str(start) if start == prev else f"{start}-{prev}")
        if r is not None:
            start = prev = r
    return ", ".join(pieces)


class FixtureSource:
    """A ``StatusSource`` that plays back documents: ``docs[i]`` on the i-th fetch, then the last forever."""

    def __init__(
        self,
        docs: list[dict[str, Any]] | None = None,
        label: str = "fixture :5599",
        copy_docs: bool = True,
    ) -> None:
        self.docs = docs if docs is not None else [document(0), document(1)]
        self.copy_docs = copy_docs
        self.label = label
        self.started: float | None = STARTED
        self.fetches = 0
        self.reachable = True

    def fetch(self) -> StatusDocument | None:
        """The next document, decoded as a source hands it to the dashboard."""
        if not self.reachable:
            return None
        doc = self.docs[min(self.fetches, len(self.docs) - 1)]
        self.fetches += 1
        return typed(copy.deepcopy(doc) if self.copy_docs else doc)

    def push(self, doc: dict[str, Any]) -> None:
        """Make ``doc`` the next (and from then on, the last) document."""
        self.docs = [*self.docs[: self.fetches], doc]


class TickingSource:
    """A live-looking source: ``build(tick)`` with the tick advancing on every fetch."""

    def __init__(self, build: Any, label: str = "synthetic") -> None:
        self.build = build
        self.label = label
        self.started: float | None = STARTED
        self.tick = 0

    def fetch(self) -> dict[str, Any] | None:
        doc = self.build(self.tick)
        self.tick += 1
        return doc


def main(argv: list[str] | None = None) -> int:
    """Try the dashboard by hand: ``python tests/tui_fixtures.py [--ranks N] [--still]``."""
    import argparse

    from ddpwatch.tui.app import DashboardApp

    parser = argparse.ArgumentParser(description=main.__doc__)
    parser.add_argument(
        "--ranks", type=int, default=0, help="use big(N) instead of the 16-rank job"
    )
    parser.add_argument("--still", action="store_true", help="always the same document (tick 0)")
    args = parser.parse_args(argv)
    if args.ranks:
        build = (
            (lambda tick: big(args.ranks, 0))
            if args.still
            else (lambda tick: big(args.ranks, tick))
        )
    else:
        build = (lambda tick: document(0)) if args.still else document
    DashboardApp(TickingSource(build, label="synthetic")).run()
    return 0


if __name__ == "__main__":
    import sys

    sys.exit(main())
