"""A collective's arguments as the agent records them: the reduce op and root (src/dst) of the
call in flight, and each window's calls between two marks, as a digest that compares across
ranks and the distinct calls that say how (``agent/calls.py``). Public reports: an
all_reduce whose reduce op differs on one rank completes under gloo (measured), a reduce whose
``dst`` differs completes under NCCL and later work hangs (pytorch/pytorch#39706), an
all_reduce whose dtype differs on one rank gives wrong values under NCCL
(pytorch/pytorch#150248)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
import torch
import torch.distributed as dist
from conftest import free_port_pair

from ddpwatch.agent.calls import CallDigests
from ddpwatch.agent.collectives import CollectiveWrappers
from ddpwatch.agent.progress import MARK_EVERY, WINDOW_CALLS, Progress, reduce_op_name
from ddpwatch.core.protocol import CallSeen


@pytest.fixture
def group() -> Iterator[None]:
    """A one-rank gloo group."""
    port = free_port_pair()
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
    try:
        yield
    finally:
        dist.destroy_process_group()


@pytest.fixture
def wrapped(group: None) -> Iterator[Progress]:
    """A one-rank gloo group with ddpwatch's wrappers on ``torch.distributed``."""
    progress = Progress()
    wrappers = CollectiveWrappers(progress)
    wrappers.install(dist)
    try:
        yield progress
    finally:
        wrappers.restore(dist)


def in_flight_of(progress: Progress, call: Any) -> Any:
    """The collective ``in_flight`` reports while ``call`` runs (seen from inside torch's own
    function, as the publisher sees a rank blocked in it)."""
    seen: list[Any] = []
    original = progress.exit_collective

    def exit_collective(failed: bool = False) -> None:
        seen.append(progress.in_flight())
        original(failed)

    progress.exit_collective = exit_collective  # type: ignore[method-assign]
    try:
        call()
    finally:
        del progress.exit_collective
    return seen[0]


def test_the_reduce_op_and_root_of_the_call_in_flight(wrapped: Progress) -> None:
    progress = wrapped
    t = torch.ones(3)
    cases = [
        (lambda: dist.all_reduce(t), "all_reduce", "sum", None),  # torch's default: SUM
        (lambda: dist.all_reduce(t, dist.ReduceOp.MAX), "all_reduce", "max", None),
        (lambda: dist.all_reduce(t, op=dist.ReduceOp.MIN), "all_reduce", "min", None),
        (lambda: dist.broadcast(t, 0), "broadcast", None, 0),
        (lambda: dist.broadcast(t, src=0), "broadcast", None, 0),
        (lambda: dist.broadcast(t, group_src=0), "broadcast", None, 0),
        (lambda: dist.reduce(t, 0, dist.ReduceOp.PRODUCT), "reduce", "product", 0),
        (lambda: dist.reduce(t, dst=0), "reduce", "sum", 0),
        (lambda: dist.gather(t, [torch.zeros(3)], 0), "gather", None, 0),
        (lambda: dist.scatter(t, [torch.zeros(3)], src=0), "scatter", None, 0),
        (lambda: dist.broadcast_object_list([1], src=0), "broadcast_object_list", None, 0),
        (lambda: dist.barrier(), "barrier", None, None),
    ]
    for call, op, reduce_op, root in cases:
        seen = in_flight_of(progress, call)
        assert (seen.op, seen.reduce_op, seen.root) == (op, reduce_op, root), op
    assert progress.collective_reduce_op is None and progress.collective_root is None


def test_reduce_op_names() -> None:
    assert reduce_op_name("all_reduce", None) == "sum"
    assert reduce_op_name("broadcast", None) is None
    assert reduce_op_name("all_reduce", dist.ReduceOp.AVG) == "avg"
    assert reduce_op_name("all_reduce", dist.ReduceOp.SUM) == "sum"
    premul = dist._make_nccl_premul_sum(2.0)  # a ReduceOp made for one call
    assert reduce_op_name("all_reduce", premul) == "premul_sum"


def steps(progress: Progress, count: int, body: Any) -> None:
    for _ in range(count):
        body()
        progress.end_step()


def test_each_window_keeps_its_calls_and_the_digest_compares_them(wrapped: Progress) -> None:
    progress = wrapped
    reader = CallDigests(progress)
    assert reader.read() == (None, None, None)  # no collective yet: nothing sent

    def step() -> None:
        dist.all_reduce(torch.ones(4))
        dist.broadcast(torch.ones(2, 3), src=0)

    steps(progress, 2 * MARK_EVERY, step)
    assert [(s, start, len(calls)) for s, start, calls in progress.windows] == [
        (8, 0, 16),
        (16, 16, 16),
    ]
    assert progress.calls == [] and progress.window_start == 32
    digests, window, earlier = reader.read()
    assert digests is not None and [s for s, _ in digests] == [8, 16]
    assert digests[0][1] != digests[1][1]  # each window starts at another count
    assert window is not None and window.step == 16
    assert window.calls == [
        CallSeen(seq=17, op="all_reduce", dtype="float32", numel=4, reduce_op="sum"),
        CallSeen(seq=18, op="broadcast", dtype="float32", numel=6, root=0),
    ]
    # two marks since the last read: the one before the latest is described too
    assert earlier is not None and [w.step for w in earlier] == [8]
    assert earlier[0].calls[0] == CallSeen(
        seq=1, op="all_reduce", dtype="float32", numel=4, reduce_op="sum"
    )
    # worked out once, read again; the earlier windows only once
    assert reader.read() == (digests, window, None)
    steps(progress, 3 * MARK_EVERY, step)
    _, window, earlier = reader.read()
    assert window is not None and window.step == 40
    assert earlier is not None and [w.step for w in earlier] == [24, 32]


def window_digest(body: Any) -> int:
    """The digest of one window of ``MARK_EVERY`` steps, each running ``body``, after one
    window of the same calls (another start)."""
    progress = Progress()
    wrappers = CollectiveWrappers(progress)
    wrappers.install(dist)
    try:
        steps(progress, 2 * MARK_EVERY, body)
    finally:
        wrappers.restore(dist)
    digests, _, _ = CallDigests(progress).read()
    assert digests is not None
    return digests[-1][1]


def test_the_digest_tells_root_dtype_size_and_reduce_op_apart(group: None) -> None:
    t = torch.ones(4)
    same = window_digest(lambda: dist.broadcast(t, src=0))
    assert window_digest(lambda: dist.broadcast(torch.zeros(4), 0)) == same
    assert window_digest(lambda: dist.broadcast(t, group_src=0)) == same
    assert window_digest(lambda: dist.broadcast(t.double(), src=0)) != same
    assert window_digest(lambda: dist.broadcast(torch.ones(5), src=0)) != same
    reduced = window_digest(lambda: dist.all_reduce(t))
    assert window_digest(lambda: dist.all_reduce(t, dist.ReduceOp.SUM)) == reduced
    assert window_digest(lambda: dist.all_reduce(t, dist.ReduceOp.MAX)) != reduced
    # all_gather may take uneven sizes: its size does not count
    gathered = window_digest(lambda: dist.all_gather([torch.zeros(4)], t))
    assert window_digest(lambda: dist.all_gather([torch.zeros(3)], torch.ones(3))) == gathered


def test_the_digest_is_the_same_in_another_process() -> None:
    """Python's ``hash`` of a str or a dtype differs from process to process: the digest must
    not, or healthy ranks would differ."""
    script = textwrap.dedent(
        """
        import sys, torch
        from ddpwatch.agent.calls import CallDigests
        from ddpwatch.agent.progress import Progress
        progress = Progress()
        for _ in range(8):
            progress.enter_collective("broadcast", torch.ones(3), True, None, 1)
            progress.exit_collective()
            progress.enter_collective("all_reduce", torch.ones(1, dtype=torch.float16))
            progress.exit_collective()
            progress.end_step()
        print(CallDigests(progress).read()[0])
        """
    )
    outputs = {
        subprocess.run(
            [sys.executable, "-c", script],
            capture_output=True,
            text=True,
            check=True,
            env={**__import__("os").environ, "PYTHONHASHSEED": seed},
        ).stdout
        for seed in ("1", "2")
    }
    assert len(outputs) == 1 and "[(8, " in outputs.pop()


def test_a_window_keeps_its_first_calls_only() -> None:
    progress = Progress()
    for _ in range(WINDOW_CALLS + 10):
        progress.enter_collective("barrier")
        progress.exit_collective()
    assert len(progress.calls) == WINDOW_CALLS and progress.collective_seq == WINDOW_CALLS + 10
    for _ in range(MARK_EVERY):
        progress.end_step()
    progress.enter_collective("barrier")
    progress.exit_collective()
    assert len(progress.calls) == 1  # the next window keeps its own


def test_each_call_is_read_back_by_its_number_across_a_mark(wrapped: Progress) -> None:
    """``CallDigests.call``: the call a rank made at a number, what ``Collective.before``
    carries (a rank past a collective the others hang in says how it called it)."""
    progress = wrapped
    reader = CallDigests(progress)
    assert reader.call(1) is None  # nothing called yet

    def step() -> None:
        dist.all_reduce(torch.ones(4), op=dist.ReduceOp.MAX)
        dist.broadcast(torch.ones(2, 3), src=0)

    steps(progress, MARK_EVERY, step)  # one window closed: calls 1-16; none in the new one
    assert reader.call(16) == CallSeen(seq=16, op="broadcast", dtype="float32", numel=6, root=0)
    step()  # calls 17, 18 in the open window
    assert reader.call(17) == CallSeen(
        seq=17, op="all_reduce", dtype="float32", numel=4, reduce_op="max"
    )
    assert reader.call(15) is not None and reader.call(15).op == "all_reduce"  # type: ignore[union-attr]
    assert reader.call(19) is None and reader.call(0) is None  # not made; no such number


def test_the_collective_in_flight_with_its_arguments_and_the_call_before() -> None:
    """The watcher's collective in flight: the flight recorder's (gloo and NCCL record every
    collective) with the Python-level call's root, reduce op, shape and dtype where the rank
    is inside one of the same op, and ``before``: the call numbered one less; the last call
    made when only the recorder sees one (DDP's all-reduce)."""
    from ddpwatch.agent.watcher import Watcher
    from ddpwatch.core.protocol import Collective

    watcher = Watcher(addr=f"127.0.0.1:{free_port_pair()}")  # not started: no heartbeats
    progress = watcher.progress
    for n in range(3):
        progress.enter_collective("broadcast", torch.ones(2), root=n)
        progress.exit_collective()
    third = CallSeen(seq=3, op="broadcast", dtype="float32", numel=2, root=2)
    ddp = watcher._in_flight(Collective(op="allreduce", seq=40, source="fr", group="0"))
    assert ddp is not None and ddp.before == third and ddp.root is None  # the last one made
    assert watcher._in_flight(None) is None
    progress.enter_collective("broadcast", torch.ones(5), root=1)
    python = watcher._in_flight(None)
    assert python is not None and (python.seq, python.root, python.before) == (4, 1, third)
    recorded = watcher._in_flight(Collective(op="broadcast", seq=41, source="fr", group="0"))
    assert recorded is not None and (recorded.source, recorded.seq, recorded.py_seq) == (
        "fr",
        41,
        4,
    )
    assert (recorded.root, recorded.shape, recorded.dtype) == (1, [5], "float32")
    assert recorded.before == third
    other = watcher._in_flight(Collective(op="allreduce", seq=41, source="fr", group="0"))
    assert other is not None and other.root is None and other.before is None  # unsure: which?
    progress.exit_collective()
