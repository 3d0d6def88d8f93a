"""The pace the server asks of its relays: one batch every ``every`` beats while it is behind.

A server that falls behind its queue does not catch up by reading faster: reading a backlog
costs about what applying the heartbeats it keeps costs (``docs/design/digests.md``), and the
backlog lives in its own queue, which is what its memory grows by. So it asks to be sent
less: relays poll ``pace`` on the query port (``collector.Collector``) and, at a pace of 2,
send one batch every second beat (at 4, every fourth), each rank's newest heartbeat in it
and every event at once (``ddpwatch/relay.py``). Diagnosis allows a relayed rank and its
relay the beats they skip (``Batch.every``, ``RankRecord.relayed``), and counts a paced
beat as the heartbeats it stands for (``records.Beat.STANDS_FOR``).

The pace moves with hysteresis: up after ``UP_AFTER_S`` behind by more than ``UP_LAG_S``,
down only after ``DOWN_AFTER_S`` behind by less than ``DOWN_LAG_S``. A pace that flipped every
few seconds would make the relays' batches uneven, and a server that kept up only because
it was sent less would fall behind again at once.
"""

from __future__ import annotations

import msgspec

from ddpwatch.core.protocol import PaceReply

MOST = 4
"""The slowest pace asked: one batch every fourth beat, 2 s after pace 2 (the wire's
``protocol.MAX_PACE``). A relayed rank's silence allowance grows by ``RELAY_HOLD_S`` a beat
skipped (2.5 s becomes 4.5 s at pace 4), and slow_rank's window counts the heartbeats each
beat stands for (``records.Beat.STANDS_FOR``)."""
UP_LAG_S = 1.0
UP_AFTER_S = 2.0
DOWN_LAG_S = 0.25
DOWN_AFTER_S = 20.0


class Pace:
    """The pace, moved by the server's lag (``update``, after every poll)."""

    def __init__(self) -> None:
        self.every = 1
        self.lag_s = 0.0
        self._held = False  # ``hold``: the pace no longer moves
        self._high_since: float | None = None  # behind by more than UP_LAG_S since then
        self._low_since: float | None = None  # behind by less than DOWN_LAG_S since then
        self._reply = b""
        self._replied = (0, -1.0)  # the (every, lag) the reply says

    def hold(self, every: int) -> None:
        """Ask ``every`` whatever the lag from now on (``benchmarks/diagnosis.py --pace``: what
        relays at that pace do to every failure mode's diagnosis)."""
        self.every, self._held = every, True

    def update(self, lag_s: float, now: float) -> bool:
        """Take the lag measured at ``now``; True when the pace changed."""
        self.lag_s = lag_s
        if self._held:
            return False
        if lag_s > UP_LAG_S:
            self._low_since = None
            if self._high_since is None:
                self._high_since = now
            elif now - self._high_since >= UP_AFTER_S and self.every < MOST:
                self.every *= 2
                self._high_since = now  # the next step needs as long again
                return True
        elif lag_s < DOWN_LAG_S:
            self._high_since = None
            if self._low_since is None:
                self._low_since = now
            elif now - self._low_since >= DOWN_AFTER_S and self.every > 1:
                self.every //= 2
                self._low_since = now
                return True
        else:
            self._high_since = self._low_since = None
        return False

    def reply(self) -> bytes:
        """The JSON that answers ``pace``, encoded again only when a figure moved by 0.1 s."""
        said = (self.every, round(self.lag_s, 1))
        if said != self._replied:
            self._reply = msgspec.json.encode(PaceReply(*said))
            self._replied = said
        return self._reply
