"""Ingest's one path (``server/ingest.py``): a rank frame that came alone and the same frame in
a relay's batch are read, shed, coalesced and applied alike, without a socket."""

from __future__ import annotations

import math
from dataclasses import fields
from typing import Any

import pytest

from ddpwatch.core.protocol import AnyMessage, Batch, Event, Hello, Sample, encode
from ddpwatch.server.ingest import Receive
from ddpwatch.server.records import RankRecord
from ddpwatch.server.state import ServerState

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


def record_fields(record: RankRecord) -> dict[str, Any]:
    """Every field but ``relayed`` (which path the last frame took), NaN as a string."""
    values = {f.name: getattr(record, f.name) for f in fields(RankRecord) if f.name != "relayed"}
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
