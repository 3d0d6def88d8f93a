"""What the server knows about per-node relays (``ddpwatch/relay.py``): one record each.

A relay's batch is its heartbeat, so a relay not heard from is as visible as a silent rank;
``ranks`` says whose frames it carried, which is what lets diagnosis say "the relay on host X
was lost" instead of naming each of its ranks.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

from ddpwatch.core.protocol import Batch
from ddpwatch.state.records import RankRecord
from ddpwatch.status.schema import RelayEntry

MAX_RELAYS = 65_536  # one per node; more are not tracked (and their batches not noted)
RELAY_QUIET_S = 1.0
"""At least this quiet (two of its 0.5 s beats) for a relay to count as lost."""
HELD_S = 0.75
"""How much later than its ranks' last frames a relay's last batch may come (a beat, and
slack): a relay lost with its ranks is known by the time they count as silent."""
RELAY_HOLD_S = 0.5
"""A relay sends one batch per beat (``ddpwatch.relay.BEAT_S``): a relayed rank's frames may
reach the server this much later than a direct rank's; at a slower pace (``Batch.every``),
that many beats later. The allowances above scale the same way, relay by relay."""
TOGETHER_S = 1.5
"""A rank whose last frame came within this of its relay's last batch went silent with it
(a relay beats every 0.5 s; frames it held go out in its last batch)."""


@dataclass
class RelayRecord:
    """One relay process, by its ``host:pid`` name."""

    name: str
    host: str | None
    first_seen: float
    last_seen: float
    batches: int = 0
    frames: int = 0
    dropped: int = 0  # frames the relay could not forward (it said so)
    coalesced: int = 0  # heartbeats it left out, superseded while the server took no more
    lost_batches: int = 0  # gaps in its batch sequence numbers: batches lost on the way
    next_seq: int = 0
    every: int = 1  # its pace: one batch every this many beats (``Batch.every``), as last said
    ranks: set[int] = field(default_factory=set)


def note_batch(relays: dict[str, RelayRecord], batch: Batch, now: float) -> RelayRecord | None:
    """Record a batch's arrival; None when the table is full and the relay is new."""
    record = relays.get(batch.relay)
    if record is None:
        if len(relays) >= MAX_RELAYS:
            return None
        record = RelayRecord(batch.relay, batch.host, first_seen=now, last_seen=now)
        relays[batch.relay] = record
    record.last_seen = now
    record.every = batch.every
    if batch.seq > record.next_seq and record.batches:
        record.lost_batches += batch.seq - record.next_seq
    record.next_seq = batch.seq + 1
    record.batches += 1
    record.frames += len(batch.frames)
    record.dropped += batch.dropped
    record.coalesced += batch.coalesced
    return record


def relay_entry(record: RelayRecord, now: float) -> RelayEntry:
    """One relay as the status JSON shows it."""
    return RelayEntry(
        relay=record.name,
        host=record.host,
        last_seen_s=round(max(0.0, now - record.last_seen), 3),
        ranks=sorted(record.ranks),
        batches=record.batches,
        frames=record.frames,
        dropped=record.dropped,
        coalesced=record.coalesced,
        lost_batches=record.lost_batches,
        every=record.every,
    )


@dataclass(frozen=True)
class LostRelay:
    """A relay not heard from for the silent threshold, and what became of its ranks."""

    relay: RelayRecord
    silent: tuple[RankRecord, ...]  # went silent with it
    moved: tuple[RankRecord, ...]  # heard from since, directly
    going: tuple[RankRecord, ...] = ()
    """Heard last around the relay's end, neither silent yet nor heard directly since: what
    became of them is not known yet (a rank whose last frame came in the relay's last batch
    goes silent up to a batch later than one whose last frame came in the batch before)."""


def lost_relays(
    relays: Mapping[str, RelayRecord],
    ranks: Mapping[int, RankRecord],
    live: Sequence[RankRecord],
    now: float,
    since: float,
    silent_after: float,
    is_silent: Callable[[RankRecord], bool],
) -> list[LostRelay]:
    """Relays gone quiet while some of their ranks still ran: ranks silent with it
    (``is_silent``), or heard directly since. None when no rank is ``live`` at all: then the
    job, or the server's own network, is gone, which no relay explains. Quiet counts from
    ``since`` at most (``ServerState.listening_since``), like a rank's silence;
    ``silent_after`` is the job's silent threshold (``Thresholds.silent``)."""
    if not relays or not live:
        return []
    lost: list[LostRelay] = []
    for relay in relays.values():
        every = relay.every  # a slower pace: each of its beats' allowances that many times
        slower = RELAY_HOLD_S * (every - 1)  # what its ranks' silence allowance grows by
        quiet_after = max(RELAY_QUIET_S * every, silent_after - HELD_S) + slower
        if now - max(relay.last_seen, since) <= quiet_after:
            continue
        together = TOGETHER_S * every
        carried = [ranks[r] for r in sorted(relay.ranks) if r in ranks]
        unfinished = [r for r in carried if not r.finished]
        silent = tuple(
            r for r in unfinished if is_silent(r) and r.last_seen >= relay.last_seen - together
        )
        moved = tuple(r for r in unfinished if r.last_seen > relay.last_seen + together)
        settled = {r.rank for r in silent} | {r.rank for r in moved}
        going = tuple(
            r
            for r in unfinished
            if r.rank not in settled and r.last_seen >= relay.last_seen - together
        )
        if silent or moved:
            lost.append(LostRelay(relay, silent, moved, going))
    return lost
