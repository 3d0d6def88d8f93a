"""Ingest: the rank frames of one receive into ``ServerState``, one path for every frame.

The collector (``server/collector.py``) takes frames off its socket and hands each to a
``Receive``. A frame is a rank's message, or a relay's ``Batch`` (``ddpwatch/relay.py``) whose
frames are rank messages, each dated by its arrival at the relay. Either way every rank frame
goes through the same two steps, in the order it came: its head is read as it is taken
(``Receive.add``), and once the receive is in it is shed, or decoded, validated, admitted,
recorded and applied (``Receive._take``), exactly as if it had come alone. A bad frame is
counted in ``state.rejected`` and dropped, never raised; so is a valid one that ``admit``
refuses (the collector's rank cap). Accepted frames go to the optional ``recorder`` with
their receive time. A frame whose handling raises all the same (a bug in ddpwatch) is
isolated as a diagnosis rule that raises is: counted in ``state.failed``, logged once per
rank and kind, and dropped (``frame_failed``); the frames after it are taken in as usual.

A relay's batch that says its frames' ranks and plain heartbeats (``Batch.ranks``,
``Batch.plain``) is put in place with its heads unread until the same relay's next batch in
the receive, or the receive's end: the heartbeats the next one supersedes (``superseded``)
are then counted, unread, as ``shed``; they are those coalescing would count and not apply.
Behind, a receive holds up to four batches of each relay (``collector.BEHIND_BEATS``), so up
to three in four of a backlog cost a batch's decode instead of a decode and a coalescing per
heartbeat. Holding is isolated like a frame: if it raises, the receive goes on with every
frame in place and none read ahead (``_guarded``).
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Container
from typing import TYPE_CHECKING, Any

import msgspec

from ddpwatch.core.protocol import (
    AnyMessage,
    Batch,
    Event,
    ProtocolError,
    Sample,
    decode,
    decode_wire,
    encode,
    keeps_news,
)
from ddpwatch.state.relays import RelayRecord, note_batch
from ddpwatch.state.state import ServerState

if TYPE_CHECKING:
    from ddpwatch.server.recording import Recorder

log = logging.getLogger("ddpwatch.server")

MAX_RELAY_AGE_US = 60_000_000  # a frame a relay held longer is dated a minute back, no more
FAILURES_LOGGED = 256  # (rank, kind) pairs of failed frames logged at most, one line each


class Receive:
    """The rank messages of one receive, direct or in a relay's batch, in the order they came.

    Each rank frame's head (``_Head``: its type and rank) is read as it is taken (``add``), so
    a rank's last heartbeat of the receive is known when it comes (``take_all``) and applied at
    once, while it is fresh in the CPU's cache. Under backlog a known rank's heartbeats are
    coalesced: a heartbeat waits in ``pending`` only when another of the same rank follows it,
    and of those only the ones that ``keeps_news`` are applied (one skipped loses only what the
    newer one overwrites, and a step of the collective-wait average); its events keep their
    order. Held, tens of thousands of decoded heartbeats went cold before the end of the
    receive and cost more than the rest of ingest. Ranks' records do not depend on each other,
    so applying a heartbeat sooner than the end of the receive changes nothing but when.
    """

    def __init__(
        self,
        state: ServerState,
        now: float,
        admit: Callable[[AnyMessage], bool],
        recorder: Recorder | None = None,
        *,
        shedding: bool = False,
    ) -> None:
        self.state = state
        self.now = now
        self.admit = admit
        """False for a valid message the server will not track (``Collector.rank_cap``)."""
        self.recorder = recorder
        self.shed = _Shedding(state.ranks) if shedding else None
        """Which heartbeats are shed (``collector.SHED_AFTER_S``); None when not shedding."""
        self.frames: list[bytes] = []
        """Every rank frame taken, alone or in a batch, in order: its index is its position."""
        self.batches: list[tuple[int, Batch]] = []
        """Each relay's batch taken, with the position of its first frame."""
        self.last: dict[int, int] = {}
        """The position of each rank's last heartbeat, by rank."""
        self.pending: dict[int, tuple[Sample, float]] = {}
        self.skipped: dict[int, set[int]] = {}
        """By the position of a relay's batch: its frames that the relay's next batch in this
        receive supersedes (``superseded``), left out undecoded."""
        self._held: dict[str, tuple[int, Batch]] = {}
        """Each relay's newest batch of the receive so far, by relay, with its first frame's
        position: its frames are in place, their heads not read until the relay's next batch
        says which it supersedes, or the end of the receive."""
        self._held_ranks: dict[int, str] = {}  # the ranks of the held batches, by rank
        self._head_of = _heads.decode if self.shed is None else _shed_heads.decode
        self._read_ahead = True  # every head read: ``last`` and ``shed`` can be trusted

    # ---------------------------------------------------------------- taken off the socket

    def add(self, frame: bytes) -> bool:
        """Take a rank message's frame, alone or out of a batch: read its head, note it in
        ``last`` (a heartbeat) and ``shed`` (when shedding). False, taking nothing, for a frame
        that is no rank message (``add_other``)."""
        try:
            head = self._head_of(frame)
        except _HEAD_ERRORS:
            return False
        frames = self.frames
        position = len(frames)
        kind = head.type
        rank = head.rank
        if kind == "sample":
            if type(rank) is int:
                if self._held_ranks and rank in self._held_ranks:
                    self._guarded(self._release, self._held_ranks[rank])
                self.last[rank] = position
        elif kind not in _RANK_TYPES:
            return False
        elif self._held_ranks and type(rank) is int and rank in self._held_ranks:
            self._guarded(self._release, self._held_ranks[rank])  # its frames first, in order
        if self.shed is not None:
            self.shed.note(head, position)
        frames.append(frame)
        return True

    def add_other(self, frame: bytes) -> int:
        """Take a frame off the socket that ``add`` did not: a relay's batch, each of its
        frames added as if it had come alone, or a frame the decoder refuses, counted. Returns
        the rank messages the batch holds: a receive's limit counts heartbeats, not frames."""
        try:
            message = decode_wire(frame)
        except ProtocolError:
            self.state.rejected += 1
            return 0
        frames = self.frames
        if type(message) is not Batch:  # a rank message whose head could not be read: never
            self._read_ahead = False
            frames.append(frame)
            return 0
        self.batches.append((len(frames), message))
        if _holdable(message):
            self._guarded(self._hold, message)
            return len(message.frames)
        add = self.add
        for relayed in message.frames:
            if not add(relayed):  # refused when taken in, in its place
                frames.append(relayed)
                if _decodes(relayed):  # its head could not be read: never
                    self._read_ahead = False
        return len(message.frames)

    def _hold(self, batch: Batch) -> None:
        """Put a relay's batch in place, its heads unread: the relay's batch before it in
        this receive, if any, is read now, less what this one supersedes; so is a batch of
        another relay that holds one of its ranks (a rank that moved), so that each rank's
        frames are read in order."""
        start = len(self.frames)
        self.frames.extend(batch.frames)
        name = batch.relay
        if name in self._held:
            self._release(name, batch)
        held_ranks = self._held_ranks
        for rank in batch.ranks:
            other = held_ranks.get(rank)
            if other is not None and other != name:
                self._release(other)
            held_ranks[rank] = name
        self._held[name] = (start, batch)

    def _release(self, name: str, newer: Batch | None = None) -> None:
        """Read the heads of relay ``name``'s held batch in its place, but of the frames that
        ``newer`` (the relay's next batch) supersedes: those are counted when taken, unread."""
        start, batch = self._held.pop(name)
        held_ranks = self._held_ranks
        for rank in batch.ranks:
            if held_ranks.get(rank) == name:
                del held_ranks[rank]
        skipped = superseded(batch, newer, self.state.ranks) if newer is not None else None
        if skipped:
            self.skipped[start] = skipped
        place = self._place
        for i, frame in enumerate(batch.frames):
            if skipped is None or i not in skipped:
                place(frame, start + i)

    def _release_all(self) -> None:
        """The end of the receive: the newest batch of each relay is read whole."""
        for name in list(self._held):
            self._release(name)

    def _guarded(self, step: Callable[..., None], *args: Any) -> None:
        """A step of holding batches; one that raises (a bug in ddpwatch) is counted and
        logged once, like a frame that raises, and the receive goes on: every frame stays in
        its place, to be taken, and none is trusted as read ahead (each rank's heartbeats are
        then coalesced as they come)."""
        try:
            step(*args)
        except Exception as exc:
            frame_failed(self.state, None, "batch", exc)
            self._held.clear()
            self._held_ranks.clear()
            self._read_ahead = False

    def _place(self, frame: bytes, position: int) -> None:
        """``add`` for a frame already in place (a held batch's): read its head."""
        try:
            head = self._head_of(frame)
        except _HEAD_ERRORS:
            head = None
        kind = None if head is None else head.type
        if head is None or (kind != "sample" and kind not in _RANK_TYPES):
            if _decodes(frame):  # its head could not be read: never
                self._read_ahead = False
            return
        rank = head.rank
        if kind == "sample" and type(rank) is int and position > self.last.get(rank, -1):
            self.last[rank] = position
        if self.shed is not None:
            self.shed.note(head, position)

    # ---------------------------------------------------------------- into the state

    def take_all(self, answer_waiting: Callable[[], None], every: int) -> None:
        """Take in the frames added, in order (but what ``shed`` says to shed), calling
        ``answer_waiting`` every ``every`` messages; a heartbeat held back for a newer one
        that did not come (refused) is applied at the end."""
        self._guarded(self._release_all)
        if not self._read_ahead:  # no heartbeat is known to be the last of its rank
            self.last, self.shed = {}, None
        frames, take, now = self.frames, self._take, self.now
        answer_at = every
        alone = 0  # the position of the next frame that came alone
        for start, batch in [*self.batches, (len(frames), None)]:
            if alone < start:
                self._route(None)
            for position in range(alone, start):
                if position >= answer_at:
                    answer_at = position + every
                    answer_waiting()
                try:  # next to nothing until it raises (a frame that raises is isolated)
                    take(frames[position], position, now, 0)
                except Exception as exc:  # isolated: counted, logged
                    self._failed(frames[position], exc)
            if batch is not None:
                if start >= answer_at:
                    answer_at = start + every
                    answer_waiting()
                self._route(batch)
                self._open(batch, start)
                alone = start + len(batch.frames)
        self._apply_pending()

    def _apply_pending(self) -> None:
        """The heartbeats held back for a newer one of their rank that did not come."""
        state = self.state
        for sample, at in self.pending.values():
            try:
                state.apply(sample, at)
            except Exception as exc:  # isolated: counted, logged
                frame_failed(state, sample.rank, "sample", exc)

    def _route(self, batch: Batch | None) -> None:
        """Tell the recording how the frames it records next came: in ``batch``, or alone."""
        if self.recorder is not None:
            self.recorder.route(self.now, b"" if batch is None else batch_head(batch))

    def _open(self, batch: Batch, position: int) -> None:
        """Take a relay's frames, each dated by its arrival at the relay; ``position`` is the
        first one's among the rank messages of this receive."""
        state, now = self.state, self.now
        relay = note_relay(state, batch, now)
        carried = None if relay is None else relay.ranks
        frames = batch.frames
        ages = batch.ages_us if len(batch.ages_us) == len(frames) else [0] * len(frames)
        take, most, pace = self._take, MAX_RELAY_AGE_US, batch.every
        skipped = self.skipped.get(position) if self.skipped else None
        indices: range | list[int] = range(len(frames))
        if skipped is not None and self.recorder is None:  # none to record: counted at once
            state.received += len(skipped)
            state.shed += len(skipped)
            indices = [i for i in indices if i not in skipped]
            skipped = None
        for i in indices:
            frame, age = frames[i], ages[i]
            at = now - (age if age < most else most) / 1e6  # not min(): a call a frame
            if skipped is not None and i in skipped:  # superseded: counted, as if shed
                state.received += 1
                state.shed += 1
                if self.recorder is not None:
                    self.recorder.frame(at, frame)
                continue
            try:
                rank = take(frame, position + i, at, pace)
            except Exception as exc:  # isolated: counted, logged
                self._failed(frame, exc)
                continue
            if rank is not None and carried is not None:
                carried.add(rank)

    def _take(  # noqa: C901, PLR0912 -- hot path: every rank message, kept flat
        self, frame: bytes, position: int, at: float, relayed: int
    ) -> int | None:
        """Take in the rank frame at ``position`` that arrived ``at``, through a relay or not:
        shed (counted from its head, recorded like the others, so a recording holds every
        frame), or decoded, admitted, recorded and applied. Returns its rank, None when it
        was shed or refused. A known rank's heartbeat waits in ``pending`` for a newer one
        unless it is the rank's last of this receive."""
        state = self.state
        shed = self.shed
        if shed is not None and position in shed.positions:
            state.received += 1
            state.shed += 1
            if self.recorder is not None:
                self.recorder.frame(at, frame)
            return None
        try:
            message = decode(frame)
        except ProtocolError:
            state.rejected += 1
            return None
        rank = message.rank
        record = state.ranks.get(rank)
        pending = self.pending
        if type(message) is Sample and record is not None:
            # a known rank's heartbeat: admitted, unless it tells a world size (``admit``)
            if message.world_size is not None and not self.admit(message):
                state.rejected += 1
                return None
            if self.recorder is not None:
                self.recorder.frame(at, frame)
            record.relayed = relayed
            superseded = pending.get(rank) if pending else None  # keeping up: none pending
            if superseded is not None:
                if keeps_news(superseded[0], message):
                    state.apply(*superseded)
                else:
                    state.received += 1  # counted, not applied
            if self.last.get(rank) == position:  # nothing newer in this receive: apply it now
                if superseded is not None:
                    del pending[rank]
                state.apply(message, at)
                if message.pid is not None or superseded is not None:
                    mark_relayed(state, rank, relayed)  # a new process: a new record
            else:
                pending[rank] = (message, at)
            return rank
        if not self.admit(message):
            state.rejected += 1
            return None
        if self.recorder is not None:
            self.recorder.frame(at, frame)
        earlier = pending.pop(rank, None)
        if earlier is not None:
            state.apply(*earlier)
        state.apply(message, at)
        mark_relayed(state, rank, relayed)
        return rank

    def _failed(self, frame: bytes, exc: Exception) -> None:
        """The frame's handling raised: counted and logged with its rank and kind, dropped."""
        rank, kind = _rank_and_kind(frame)
        frame_failed(self.state, rank, kind, exc)


def _holdable(batch: Batch) -> bool:
    """Whether a batch says which of its frames a newer one may supersede: each frame's
    rank, and plain heartbeats' positions within it (relays before these fields say none)."""
    count = len(batch.frames)
    plain = batch.plain
    return count > 0 and len(batch.ranks) == count and (not plain or max(plain) < count)


def superseded(batch: Batch, newer: Batch, known: Container[int]) -> set[int]:
    """The positions in ``batch`` of the heartbeats that ``newer``, the same relay's next
    batch, supersedes as coalescing would (``Receive._take``): each a plain heartbeat, its
    rank's last frame in ``batch``, of a rank known before the receive whose first frame in
    ``newer`` is a plain heartbeat. Coalescing would count each of them and apply none, and
    would treat the frames around them the same with or without them (their neighbours are
    compared with a plain heartbeat either way), so the records come out the same."""
    newer_plain = set(newer.plain)
    firsts: set[int] = set()
    covered: set[int] = set()
    for j, rank in enumerate(newer.ranks):
        if rank not in firsts:
            firsts.add(rank)
            if j in newer_plain:
                covered.add(rank)
    seen: set[int] = set()
    found: set[int] = set()
    ranks, plain = batch.ranks, set(batch.plain)
    for i in range(len(ranks) - 1, -1, -1):  # each rank's last frame first
        rank = ranks[i]
        if rank in seen:
            continue
        seen.add(rank)
        if i in plain and rank in covered and rank in known:
            found.add(i)
    return found


def frame_failed(state: ServerState, rank: int | None, kind: str, exc: Exception) -> None:
    """A valid frame whose handling raised (a bug in ddpwatch, not in the frame): count it in
    ``state.failed`` and drop it, logging the first of each (rank, kind) with its traceback,
    so that the collector goes on and the failure is seen, not repeated line after line."""
    state.failed += 1
    logged = state.failures_logged
    key = (rank, kind)
    if key in logged or len(logged) >= FAILURES_LOGGED:
        return
    logged.add(key)
    log.error(
        "a frame of rank %s (%s) could not be taken in, so it was dropped and the collector "
        "goes on (stats.failed counts these; this rank and kind are logged once): %s: %s",
        "?" if rank is None else rank,
        kind,
        type(exc).__name__,
        exc,
        exc_info=exc,
    )


def kind_of(message: AnyMessage) -> str:
    """A message's kind, as a failed frame's log line names it: its type, and an event's
    kind after a colon ("event:exit")."""
    if isinstance(message, Event):
        return f"event:{message.event}"
    return "sample" if isinstance(message, Sample) else "hello"


def _rank_and_kind(frame: bytes) -> tuple[int | None, str]:
    """What a frame that failed was, for its log line: its rank, and its type ("event:exit"
    for an event), as far as its head can be read."""
    try:
        head = _failed_heads.decode(frame)
    except _HEAD_ERRORS:
        return None, "unreadable"
    rank = head.rank if type(head.rank) is int else None
    kind = str(head.type)
    return rank, f"{kind}:{head.event}" if head.event is not None else kind


def batch_head(batch: Batch) -> bytes:
    """A relay's batch as a recording's ``route`` record keeps it: every field, each frame
    emptied (its frames are recorded one by one, as if they had come alone)."""
    return encode(msgspec.structs.replace(batch, frames=[b""] * len(batch.frames), ages_us=[]))


def note_relay(state: ServerState, batch: Batch, now: float) -> RelayRecord | None:
    """A relay's batch arrived ``now``: its relay noted, what it refused and coalesced counted
    as ours would be; None where the relay is not tracked. Live (``Receive._open``) and in a
    replay (``route`` records), the same bookkeeping."""
    state.rejected += batch.rejected  # frames the relay refused count as ours would
    state.received += batch.coalesced  # as our own coalescing counts what it leaves out
    try:
        return note_batch(state.relays, batch, now)
    except Exception as exc:  # its frames are taken in all the same
        frame_failed(state, None, "batch", exc)
        return None


def mark_relayed(state: ServerState, rank: int, relayed: int) -> None:
    """Note the path the rank's last frame took on its record, if it has one now: ``apply``
    may have started a new record (a new process), or taken the frame into the last
    attempt's (an old process's late event, for a rank whose record moved there)."""
    record = state.ranks.get(rank)
    if record is not None:
        record.relayed = relayed


def _decodes(frame: bytes) -> bool:
    """Whether a frame whose head could not be read decodes all the same (never: the head is
    looser than the decoder)."""
    try:
        decode(frame)
    except ProtocolError:
        return False
    return True


class _Head(msgspec.Struct, gc=False):
    """What a frame says it is: its ``type`` and ``rank``, whatever their values, every
    other key skipped. It reads the same keys the protocol's decoder reads, the last of a
    repeated one as it does, and takes any value, so any frame that decodes as a ``Sample``
    of rank r has the head ("sample", r); the converse need not hold (the frame may still
    be refused), which only holds back a heartbeat that could have been applied at once."""

    type: Any = None
    rank: Any = None


class _ShedHead(_Head, gc=False):
    """The head and what tells whether a heartbeat is plain (``collector.SHED_AFTER_S``): its
    loss and the identity fields ``tells_identity`` reads."""

    loss: Any = None
    pid: Any = None
    host: Any = None
    world_size: Any = None
    device: Any = None


class _FailedHead(_Head, gc=False):
    """The head of a frame that failed, with an event's kind, for its log line."""

    event: Any = None


_heads = msgspec.msgpack.Decoder(_Head)
_failed_heads = msgspec.msgpack.Decoder(_FailedHead)
_shed_heads = msgspec.msgpack.Decoder(_ShedHead)
_HEAD_ERRORS = (msgspec.MsgspecError, UnicodeDecodeError, RecursionError)
_RANK_TYPES = ("hello", "sample", "event")


class _Shedding:
    """Which heartbeats of one receive are shed (``collector.SHED_AFTER_S``): a plain one of a
    rank known before the receive whose rank's next message in it is a heartbeat and whose
    rank's previous message in it (if any) is not a heartbeat that is not plain. Coalescing
    applies a superseded heartbeat only when ``keeps_news`` says so (never for a plain one)
    or when an event or hello of its rank comes next; and a plain heartbeat decides whether
    the one before it is applied only when that one is not plain. So the records come out
    the same whether these are decoded or not."""

    def __init__(self, known: dict[int, Any]) -> None:
        self.known = known
        self.positions: set[int] = set()  # the heartbeats to shed
        self._previous: dict[int, tuple[int, int, bool]] = {}  # rank -> position, kind, ok

    def note(self, head: Any, position: int) -> None:
        """``head`` (a ``_ShedHead``: read while shedding) came at ``position``; plain: no
        identity field ``tells_identity`` reads, and a finite float loss or none (an int
        loss, valid but rare, is taken as not plain)."""
        rank = head.rank
        if type(rank) is not int:
            return  # refused when decoded
        kind = _OTHER
        if head.type == "sample":
            kind = _NOT_PLAIN
            loss = head.loss
            if (
                rank in self.known
                and (loss is None or (type(loss) is float and loss - loss == 0.0))  # finite
                and head.pid is None
                and head.host is None
                and head.world_size is None
                and head.device is None
            ):
                kind = _PLAIN
        previous = self._previous.get(rank)
        if previous is not None and kind != _OTHER and previous[1] == _PLAIN and previous[2]:
            self.positions.add(previous[0])  # a heartbeat supersedes it
        ok = previous is None or previous[1] != _NOT_PLAIN
        self._previous[rank] = (position, kind, ok)


_PLAIN, _NOT_PLAIN, _OTHER = 0, 1, 2  # what a rank message is, to ``_Shedding``
