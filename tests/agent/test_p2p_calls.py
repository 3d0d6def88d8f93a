"""Point-to-point calls as the agent records them: a blocking ``send``/``recv`` in flight with
its peer and tag, a ``batch_isend_irecv``'s requests reported once one has stayed pending
while the rank has not moved, and ``isend``/``irecv``'s requests alike, posted one by one (a
wrapper torch takes for its own function: ``P2POp`` checks it). The real calls between ranks
are ``tests/e2e``'s."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
import torch.distributed as dist

from ddpwatch.agent.collectives import CollectiveWrappers
from ddpwatch.agent.progress import P2P_PENDING_S, Progress


class Request:
    """A request as torch returns one: ``is_completed`` is all the publisher asks."""

    def __init__(self) -> None:
        self.done = False
        self.failed = False  # completed with an error (gloo's timeout): is_success() False

    def is_completed(self) -> bool:
        return self.done or self.failed

    def is_success(self) -> bool:  # torch's prints a deprecation warning: never called
        raise AssertionError("Work.is_success called")


class Subgroup:
    """A process group as the wrappers see one: hashable, its ranks in the job."""

    def __init__(self, ranks: list[int]) -> None:
        self.ranks = ranks


def fake_dist(seen: list[Any], progress: Progress) -> SimpleNamespace:
    """``torch.distributed``'s point-to-point surface, each function noting what the
    publisher would see while it runs."""

    def send(tensor: Any, dst: Any = None, group: Any = None, tag: int = 0, group_dst: Any = None):
        seen.append(progress.in_flight())

    def recv(tensor: Any, src: Any = None, group: Any = None, tag: int = 0, group_src: Any = None):
        seen.append(progress.in_flight())
        return src

    def isend(*args: Any, **kwargs: Any) -> Request:
        return Request()

    def irecv(*args: Any, **kwargs: Any) -> Request:
        return Request()

    def batch_isend_irecv(ops: list[Any]) -> list[Request]:
        return [op.op() for op in ops]

    def get_global_rank(group: Any, group_rank: int) -> int:
        return group.ranks[group_rank]

    return SimpleNamespace(
        send=send,
        recv=recv,
        isend=isend,
        irecv=irecv,
        batch_isend_irecv=batch_isend_irecv,
        get_global_rank=get_global_rank,
        group=SimpleNamespace(WORLD=None),
    )


def test_a_blocking_send_or_recv_is_in_flight_with_its_peer_and_tag() -> None:
    progress, seen = Progress(), []
    fake = fake_dist(seen, progress)
    CollectiveWrappers(progress).install(fake)
    fake.recv(torch.zeros(2), 0, tag=5)
    fake.send(torch.zeros(2), dst=2)
    fake.recv(torch.zeros(2), group=SimpleNamespace(ranks=[4, 6]), group_src=1)
    fake.recv(torch.zeros(2))  # from any source
    assert [(c.op, c.peer, c.tag, c.seq, c.source) for c in seen] == [
        ("recv", 0, 5, None, "py"),
        ("send", 2, 0, None, "py"),
        ("recv", 6, 0, None, "py"),
        ("recv", None, 0, None, "py"),
    ]
    assert progress.in_flight() is None and progress.collective_seq == 0  # not counted


def test_a_failed_recv_is_the_collective_the_rank_died_in() -> None:
    progress = Progress()
    fake = fake_dist([], progress)

    def recv(tensor: Any, src: Any = None, **_: Any) -> None:
        raise RuntimeError("Timed out waiting 8000ms for recv operation to complete")

    fake.recv = recv
    CollectiveWrappers(progress).install(fake)
    with pytest.raises(RuntimeError):
        fake.recv(torch.zeros(1), src=1)
    final = progress.failed_collective
    assert final is not None and (final.op, final.peer) == ("recv", 1)


def test_a_batch_request_pending_while_the_rank_waits_is_reported() -> None:
    progress = Progress()
    fake = fake_dist([], progress)
    CollectiveWrappers(progress).install(fake)
    ops = [
        SimpleNamespace(op=fake.isend, peer=2, tag=0),
        SimpleNamespace(op=fake.irecv, peer=0, tag=9),
    ]
    requests = fake.batch_isend_irecv(ops)
    assert progress.in_flight() is None  # just posted
    posted, kept, refs = progress.p2p_batch  # type: ignore[misc]
    progress.p2p_batch = (posted - P2P_PENDING_S - 0.1, kept, refs)  # as if a second ago
    progress.last_progress = progress.phase_changed = posted - 5.0
    requests[0].done = True
    pending = progress.in_flight()
    assert pending is not None and (pending.op, pending.peer, pending.tag) == ("irecv", 0, 9)
    requests[1].failed = True  # its wait timed out: completed, what the rank dies in
    assert progress.in_flight() is None  # live: completed is completed
    failed = progress.in_flight(dying=True)
    assert failed is not None and (failed.op, failed.peer) == ("irecv", 0)
    requests[1].failed, requests[1].done = False, True
    assert progress.in_flight() is None
    requests[1].done = False
    progress.forward_started()  # the rank moved on (a forward): computing, not waiting
    assert progress.in_flight() is None
    del requests
    progress.last_progress = progress.phase_changed = posted - 5.0
    assert progress.in_flight() is None  # requests freed: waited for and dropped


def test_isend_and_irecv_are_recorded_and_torch_still_takes_them_for_its_own() -> None:
    """``P2POp`` accepts only ``op in [isend, irecv]`` and ``batch_isend_irecv`` asks
    ``op.op is isend``; torch's pipelining compares ``{p.op for p in ops} == {dist.isend}``:
    the recorded ``isend`` passes all three, and ``restore`` puts torch's own back."""
    progress = Progress()
    wrappers = CollectiveWrappers(progress)
    before = (dist.isend, dist.irecv, dist.send, dist.batch_isend_irecv)
    wrappers.install(dist)
    try:
        assert dist.isend is not before[0] and dist.irecv is not before[1]
        assert dist.isend == before[0] and dist.irecv == before[1] and dist.isend != before[1]
        assert {dist.isend} == {before[0]} and dist.isend.__name__ == "isend"
        assert dist.send is not before[2] and dist.batch_isend_irecv is not before[3]
        dist.P2POp.__new__(dist.P2POp, dist.isend, torch.zeros(1), 0)  # does not raise
        dist.P2POp.__new__(dist.P2POp, dist.irecv, torch.zeros(1), 0)
    finally:
        wrappers.restore(dist)
    assert (dist.isend, dist.irecv, dist.send, dist.batch_isend_irecv) == before
    assert all(type(f).__name__ == "function" for f in before[:2])


def test_requests_posted_one_by_one_are_reported_like_a_batch() -> None:
    """Megatron's ``_p2p_ops`` (and pytorch/pytorch#109401's loop) post ``isend``/``irecv``
    one by one and then wait for them all: the requests posted since the rank last moved
    are one set, and the first still pending once the rank has waited is what it waits in."""
    progress = Progress()
    fake = fake_dist([], progress)
    CollectiveWrappers(progress).install(fake)
    progress.last_progress = progress.phase_changed = progress.last_progress - 5.0
    sent = fake.isend(torch.zeros(1), 2)
    got = fake.irecv(torch.zeros(1), src=0, tag=3)
    other = fake.irecv(torch.zeros(1), group=Subgroup([4, 6]), group_src=1)
    posted, kept, refs = progress.p2p_batch  # type: ignore[misc]
    assert kept == [("isend", 2, 0), ("irecv", 0, 3), ("irecv", 6, 0)] and len(refs) == 3
    assert progress.in_flight() is None  # just posted
    progress.p2p_batch = (posted - P2P_PENDING_S - 0.1, kept, refs)
    sent.done = True
    pending = progress.in_flight()
    assert pending is not None and (pending.op, pending.peer, pending.tag) == ("irecv", 0, 3)
    got.done = other.done = True
    assert progress.in_flight() is None
    progress.forward_started()  # moved: the next request starts a new set
    fake.isend(torch.zeros(1), 1)
    assert progress.p2p_batch is not None and progress.p2p_batch[1] == [("isend", 1, 0)]
    assert progress.p2p_counts(lambda group: "3") == {"0": 3, "3": 1}


def test_a_batch_built_from_the_recorded_ops_hands_torch_its_own_and_is_counted_once() -> None:
    """Inside ``batch_isend_irecv`` torch calls each ``op.op``: given torch's own function
    (``op.op is isend`` picks the send's keyword), the batch is recorded as one, not its ops
    again; a batch that reaches torch without the wrapper calls the recorded ``isend`` with
    ``group_src``, which reaches torch's as ``group_dst``."""
    progress = Progress()
    fake = fake_dist([], progress)
    called: list[tuple[str, dict[str, Any]]] = []
    fake.isend = lambda *a, **k: called.append(("isend", k)) or Request()
    fake.irecv = lambda *a, **k: called.append(("irecv", k)) or Request()
    torch_isend, torch_irecv = fake.isend, fake.irecv

    def batch_isend_irecv(ops: list[Any]) -> list[Request]:
        return [
            op.op(None, **{"group_dst" if op.op is torch_isend else "group_src": op.peer})
            for op in ops
        ]

    fake.batch_isend_irecv = batch_isend_irecv
    CollectiveWrappers(progress).install(fake)
    ops = [
        SimpleNamespace(op=fake.isend, peer=1, tag=0, group=None),
        SimpleNamespace(op=fake.irecv, peer=2, tag=0, group=None),
    ]
    fake.batch_isend_irecv(ops)
    assert ops[0].op is torch_isend and ops[1].op is torch_irecv
    assert called == [("isend", {"group_dst": 1}), ("irecv", {"group_src": 2})]
    assert progress.p2p_batch is not None
    assert progress.p2p_batch[1] == [("isend", 1, 0), ("irecv", 2, 0)]
    assert progress.p2p_counts(lambda group: None) == {"0": 2}
    called.clear()
    batch_isend_irecv([SimpleNamespace(op=fake.isend, peer=1)])  # torch's, not wrapped
    assert called == [("isend", {"group_dst": 1})]


def test_gloo_numbers_sends_with_the_collectives_and_the_agent_takes_them_off() -> None:
    """gloo's recorder (measured, torch 2.13): after 3 sends and 2 all-reduces the group's
    status reads 5 where its entries number the all-reduces 1 and 2; a rank that sent 19
    times and one that sent none must number the same all-reduce alike."""
    from ddpwatch.agent.collectives import enqueued_counts, first_pending, without_p2p

    sender = {"0": {"last_enqueued_collective": "64", "last_completed_collective": "63"}}
    bystander = {"0": {"last_enqueued_collective": "45", "last_completed_collective": "44"}}
    fixed = without_p2p(sender, {"0": 19})
    assert first_pending(fixed) == first_pending(bystander) == ("0", 45)
    assert enqueued_counts(fixed) == enqueued_counts(bystander) == {"0": 45}
    assert without_p2p(sender, {"1": 3}) == sender  # a group it does not list: as it was

    progress = Progress()
    fake = fake_dist([], progress)
    CollectiveWrappers(progress).install(fake)
    other = object()  # a subgroup, as the recorder's registry names it
    fake.send(torch.zeros(1), 1)
    fake.recv(torch.zeros(1), 1, other)
    fake.batch_isend_irecv([SimpleNamespace(op=fake.isend, peer=1, tag=0, group=None)] * 2)
    names = {other: "3"}
    assert progress.p2p_counts(names.get) == {"0": 3, "3": 1}
