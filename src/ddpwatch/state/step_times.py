"""A rank's median step over its whole run, one step one vote.

A heartbeat (2 Hz) ends any number of steps: 62 fast steps of 8 ms, or one slow step of
0.4 s. A median over heartbeats (or over the last step each one reports) counts the slow
step 62 times too often: a run whose 3,180 steps of 3,440 took 8 ms read "median step
0.205 s" (#33). Here every heartbeat that moved the step adds its steps, each at the
heartbeat's seconds per step (the sender's clock between two such heartbeats; the last
step's own time where it ended one step), to a histogram of 1 % buckets, and a pointer walks
to the median as they come: O(1) a heartbeat, nothing to sort when a document is built.
"""

from __future__ import annotations

import math
from bisect import bisect_left

RESOLUTION = 1.01
"""Neighbouring buckets differ by 1 %: the median is known to ±1 % (the mean of the steps in
its bucket: exact where the steps took one time)."""
_PER_LOG = 1.0 / math.log(RESOLUTION)
_log = math.log
SHORTEST_S = 1e-6  # a step "shorter" than this is timer noise, not a step


class StepTimes:
    """Steps per bucket of step time, with the median bucket kept as they come."""

    __slots__ = ("_at", "_below", "_counts", "_keys", "_sums", "steps")

    def __init__(self) -> None:
        self._counts: dict[int, int] = {}
        self._sums: dict[int, float] = {}  # seconds per bucket: its steps' own mean
        self._keys: list[int] = []  # the buckets that hold steps, ascending
        self._at = 0  # the index in ``_keys`` of the median bucket
        self._below = 0  # steps in buckets below it
        self.steps = 0

    def add(self, per_step_s: float, steps: int) -> None:
        """``steps`` steps that took ``per_step_s`` each. Every heartbeat of every rank:
        the common case (the median's own bucket again) touches two dicts and returns."""
        if steps <= 0 or not SHORTEST_S <= per_step_s < math.inf:
            return  # NaN fails the comparison too
        key = round(_log(per_step_s) * _PER_LOG)
        counts = self._counts
        if key in counts:
            counts[key] += steps
            self._sums[key] += per_step_s * steps
        else:
            self._insert(key, per_step_s, steps)
        self.steps += steps
        median = self._keys[self._at]
        if key == median:
            return  # more in the median's bucket: it stays the median
        if key < median:
            self._below += steps
        self._walk()

    def _insert(self, key: int, per_step_s: float, steps: int) -> None:
        """A bucket's first steps, at its place among the others."""
        keys = self._keys
        i = bisect_left(keys, key)
        keys.insert(i, key)
        self._counts[key] = steps
        self._sums[key] = per_step_s * steps
        if i <= self._at and len(keys) > 1:
            self._at += 1  # the median bucket moved one place right in the list

    def _walk(self) -> None:
        """Move the pointer until its bucket holds the middle step: fewer than half below
        it, at least half up to and through it (the lower median)."""
        keys, counts, half = self._keys, self._counts, self.steps / 2
        while self._below >= half and self._at > 0:
            self._at -= 1
            self._below -= counts[keys[self._at]]
        while self._below + counts[keys[self._at]] < half:
            self._below += counts[keys[self._at]]
            self._at += 1

    def __eq__(self, other: object) -> bool:
        """The same steps in the same buckets (a relayed and a direct rank's compare)."""
        if not isinstance(other, StepTimes):
            return NotImplemented
        return self._counts == other._counts

    __hash__ = None  # type: ignore[assignment]

    def __repr__(self) -> str:
        return f"StepTimes(steps={self.steps}, median_s={self.median_s})"

    @property
    def median_s(self) -> float | None:
        """The median step in seconds; None before any step was timed."""
        if not self.steps:
            return None
        key = self._keys[self._at]
        return self._sums[key] / self._counts[key]
