"""Ingest's one path (``server/ingest.py``): a rank frame that came alone and the same frame in
a relay's batch are read, shed, coalesced and applied alike, without a socket."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import pytest

from ddpwatch.core.protocol import AnyMessage, Batch, ErrorInfo, Event, Hello, Sample, encode
from ddpwatch.server.ingest import Receive
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState

NOW = 1000.0


def backlog() -> list[AnyMessage]:
    """Heartbeats of three ranks, several each (coalesced), with an event and a NaN between."""
    messages: list[AnyMessage] = []
    for step in range(1, 6):
        for rank in range(3):
            loss = float("nan") if (rank, step) == (1, 2) else 1.0 / step
            messages.append(Sample(v=1, rank=rank, t=0.0, step=step, loss=loss))
        if step == 3:
            messages.append(Event(v=1, rank=2, t=0.0, event="stack", stack="line 1"))
    return messages


def receive(state: ServerState, frames: list[bytes], shedding: bool = False) -> Receive:
    """One receive of ``frames`` as the collector takes them off its socket."""
    taking = Receive(state, NOW, lambda message: True, shedding=shedding)
    for frame in frames:
        if not taking.add(frame):
            taking.add_other(frame)
    taking.take_all(lambda: None, 1 << 30)
    return taking


def known_ranks() -> ServerState:
    state = ServerState(started=0.0)
    frames = [encode(Hello(v=1, rank=r, t=0.0, host="a", pid=100 + r)) for r in range(3)]
    receive(state, frames)
    return state


COALESCED = {"relayed", "first_step"}
"""Fields a receive may legitimately differ in from messages applied one by one: which path the
last frame took, and the first step seen (a heartbeat coalesced under backlog is not seen)."""


def record_fields(record: RankRecord) -> dict[str, Any]:
    """Every field but ``COALESCED``, NaN as a string."""
    values = {f.name: getattr(record, f.name) for f in fields(RankRecord) if f.name not in COALESCED}
    return {k: "nan" if isinstance(v, float) and math.isnan(v) else v for k, v in values.items()}


@pytest.mark.parametrize("shedding", [False, True])
def test_a_batch_frame_is_taken_as_the_same_frame_alone(shedding: bool) -> None:
    frames = [encode(m) for m in backlog()]
    alone, relayed = known_ranks(), known_ranks()
    receive(alone, frames, shedding)
    batch = Batch(v=1, relay="node:1", t=0.0, seq=0, frames=frames, ages_us=[0] * len(frames))
    receive(relayed, [encode(batch)], shedding)
    for state in (alone, relayed):
        assert (state.received, state.rejected) == (3 + len(frames), 0)
    assert relayed.shed == alone.shed and (alone.shed > 0) == shedding
    for rank in range(3):
        assert record_fields(relayed.ranks[rank]) == record_fields(alone.ranks[rank])
        assert (alone.ranks[rank].relayed, relayed.ranks[rank].relayed) == (False, True)
    assert relayed.relays["node:1"].ranks == {0, 1, 2}


def test_a_bad_frame_is_refused_in_its_place_alone_or_in_a_batch() -> None:
    good = encode(Sample(v=1, rank=0, t=0.0, step=1))
    for frames in (
        [b"junk", good],
        [encode(Batch(v=1, relay="n:1", t=0.0, frames=[b"junk", good]))],
    ):
        state = ServerState(started=0.0)
        taking = receive(state, frames)
        assert (state.received, state.rejected) == (1, 1)
        assert len(taking.frames) == (1 if len(frames) == 2 else 2)  # a batch keeps its places


def restart_messages() -> list[AnyMessage]:
    """torchrun --max-restarts 1, as the server may read it: rank 1 raises at step 30, torchrun
    stops rank 0 (SIGTERM) and starts both again (TORCHELASTIC_RESTART_COUNT=1). Rank 0's new
    process reports first, so attempt 2 begins while rank 1's old process still has its last
    words on the way (its log, its exit): they arrive for a rank whose record has moved to the
    past attempt. Then rank 1 reappears with another pid, and attempt 2 ends with exit 1."""
    crash = ErrorInfo(type="RuntimeError", message="boom")
    return [
        *(Hello(v=1, rank=r, t=0.0, host="a", pid=10 + r, restart_count=0) for r in range(2)),
        *(Sample(v=1, rank=r, t=0.0, step=s, loss=1.0) for s in (29, 30) for r in range(2)),
        Event(v=1, rank=1, t=0.0, event="crash", error=crash, step=30),
        Event(v=1, rank=0, t=0.0, event="exit", signal="SIGTERM"),
        Hello(v=1, rank=0, t=0.0, host="a", pid=20, restart_count=1),  # attempt 2 begins
        Event(v=1, rank=1, t=0.0, event="log", text="Traceback ..."),  # late: rank 1's old one
        Event(v=1, rank=1, t=0.0, event="exit", exit_code=1),  # late, old
        Sample(v=1, rank=0, t=0.0, step=1, loss=2.0),
        Sample(v=1, rank=1, t=0.0, pid=21, host="a", restart_count=1, step=1, loss=2.0),
        Sample(v=1, rank=1, t=0.0, step=2, loss=2.0),
        Sample(v=1, rank=0, t=0.0, step=2, loss=2.0),
        *(Event(v=1, rank=r, t=0.0, event="exit", exit_code=1, step=2) for r in range(2)),
    ]


def split(frames: list[bytes], how: str) -> list[list[bytes]]:
    """The frames as one receive, one receive each, or cut where attempt 2 begins."""
    if how == "one":
        return [frames]
    if how == "each":
        return [[frame] for frame in frames]
    return [frames[:9], frames[9:]]


@pytest.mark.parametrize("how", ["one", "each", "cut"])
@pytest.mark.parametrize("relayed", [False, True])
@pytest.mark.parametrize("shedding", [False, True])
def test_a_restart_goes_through_ingest_as_through_apply(
    how: str, relayed: bool, shedding: bool
) -> None:
    """Every frame of a restart is taken in, in every split and path, as ``apply`` takes the
    messages one by one; a late event of a rank whose record moved to the past attempt once
    raised KeyError in ingest and killed the collector's thread."""
    messages = restart_messages()
    expected = ServerState(started=0.0)
    for message in messages:
        expected.apply(message, NOW)
    state = ServerState(started=0.0)
    for frames in split([encode(m) for m in messages], how):
        if relayed:
            frames = [encode(Batch(v=1, relay="n:1", t=0.0, frames=frames))]
        receive(state, frames, shedding)
    assert (state.received, state.rejected) == (expected.received, 0)
    assert (state.attempt, sorted(state.ranks)) == (2, [0, 1])
    for rank in range(2):
        assert record_fields(state.ranks[rank]) == record_fields(expected.ranks[rank])
        assert state.ranks[rank].relayed == relayed
        assert state.ranks[rank].pid == 20 + rank and state.ranks[rank].exit_code == 1
    (past,) = state.past_attempts
    assert {r: record_fields(rec) for r, rec in past.records.items()} == {
        r: record_fields(rec) for r, rec in expected.past_attempts[0].records.items()
    }
    assert past.records[1].exit_code == 1 and past.records[1].log_tail[-1] == "Traceback ..."


@pytest.mark.parametrize("relayed", [False, True])
def test_a_frame_whose_handling_raises_is_counted_logged_once_and_dropped(
    relayed: bool, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    """As a rule that raises is skipped for its tick: rank 1's frames fail in ``apply`` (a bug
    injected), each is counted in ``state.failed`` and dropped, one line per (rank, kind)
    names it, and every other frame, before and after, is taken in; the next receive too."""
    real_apply = ServerState.apply

    def apply(self: ServerState, message: AnyMessage, now: float) -> None:
        if message.rank == 1:
            raise RuntimeError("injected")
        real_apply(self, message, now)

    monkeypatch.setattr(ServerState, "apply", apply)
    state = ServerState(started=0.0)
    messages: list[AnyMessage] = [
        *(Hello(v=1, rank=r, t=0.0, pid=10 + r) for r in range(3)),
        *(Sample(v=1, rank=r, t=0.0, step=s) for s in (1, 2) for r in range(3)),
        Event(v=1, rank=1, t=0.0, event="exit", exit_code=1),
    ]
    frames = [encode(m) for m in messages]
    if relayed:
        frames = [encode(Batch(v=1, relay="n:1", t=0.0, frames=frames))]
    for _ in range(2):
        receive(state, frames)
    assert sorted(state.ranks) == [0, 2] and state.ranks[2].step == 2
    assert (state.failed, state.rejected) == (2 * 4, 0)
    lines = [r.getMessage() for r in caplog.records if "could not be taken in" in r.getMessage()]
    assert len(lines) == 3  # hello, sample, event:exit: once each, over both receives
    assert all("of rank 1 (" in line and "RuntimeError: injected" in line for line in lines)
    assert {line.split("(")[1].split(")")[0] for line in lines} == {
        "hello",
        "sample",
        "event:exit",
    }
