"""How many ranks hold each value at each marked step, kept as marks arrive: the desync rules
(a rank that entered another number of collectives, drew other batches, ran other backwards
or evaluations, or made other calls by a marked step) read the tally and pass over every rank
only when the live ranks disagree.

Every rank marks every 8th step with a count; in a lockstep job they all agree at the
latest step every live rank has marked. At 131,072 ranks finding that step and tallying it
cost a rule 40-100 ms a run, over every rank; here a new mark costs a few dictionary updates,
and a rule proves agreement from ~32 steps' tallies less the few ranks that are not live.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Sequence
from typing import Literal

from ddpwatch.state.records import RankRecord

MarkKind = Literal["step_marks", "drawn_marks", "backwards_marked", "evals_marked", "call_digests"]
MARK_KINDS: tuple[MarkKind, ...] = (
    "step_marks",
    "drawn_marks",
    "backwards_marked",
    "evals_marked",
    "call_digests",
)
MARKS_KEPT = 32  # the newest marked steps a record keeps of each kind


class MarkIndex:
    """For each kind of mark, each step some rank's record holds -> how many ranks hold each
    value there, over the records ``ServerState.ranks`` holds (``keep`` changes a record's
    marks; ``drop`` takes a record out)."""

    def __init__(self) -> None:
        self._tallies: dict[str, dict[int, Counter[int]]] = {kind: {} for kind in MARK_KINDS}

    @classmethod
    def of(cls, records: Iterable[RankRecord]) -> MarkIndex:
        """The index of records changed by hand (tests, a rule called alone)."""
        index = cls()
        for record in records:
            for kind in MARK_KINDS:
                tally = index._tallies[kind]
                for step, value in getattr(record, kind).items():
                    _count(tally, step, value, 1)
        return index

    def keep(self, record: RankRecord, kind: MarkKind, marks: Sequence[tuple[int, int]]) -> None:
        """Fold a heartbeat's marks (step, value; oldest first) into the record's, the newest
        ``MARKS_KEPT`` steps, as ``dict.update`` would (the last of a step wins). A heartbeat
        repeats the marks its last one folded (a step's count never changes once marked):
        only those after the newest one the record holds as it is are folded."""
        kept: dict[int, int] = getattr(record, kind)
        tally = self._tallies[kind]
        start = len(marks)
        while start and kept.get(marks[start - 1][0]) != marks[start - 1][1]:
            start -= 1
        for step, value in marks[start:]:
            old = kept.get(step)
            if old == value:
                continue
            if old is not None:
                _count(tally, step, old, -1)
            kept[step] = value
            _count(tally, step, value, 1)
        while len(kept) > MARKS_KEPT:
            step = min(kept)
            _count(tally, step, kept.pop(step), -1)

    def drop(self, record: RankRecord) -> None:
        """``record`` leaves the state (a new process of its rank, an attempt that ended)."""
        for kind in MARK_KINDS:
            tally = self._tallies[kind]
            for step, value in getattr(record, kind).items():
                _count(tally, step, value, -1)

    def agreed(self, kind: MarkKind, live: int, others: Sequence[RankRecord]) -> bool:
        """Whether the tally alone proves that no live rank differs at the latest step every
        live rank has marked: fewer than 3 live ranks, no step all ``live`` of them hold, or one
        value at it. ``others``: the records that are not live (finished, silent), taken off
        the tally. False means only "look at every rank"."""
        if live < 3:
            return True
        tally = self._tallies[kind]
        for step in sorted(tally, reverse=True):
            values = tally[step]
            if sum(values.values()) < live:
                continue  # fewer ranks hold it than are live, even before taking others off
            held = values.copy()
            for record in others:
                value = getattr(record, kind).get(step)
                if value is not None:
                    held[value] -= 1
            if sum(held.values()) == live:
                return sum(1 for n in held.values() if n > 0) < 2
        return True


def _count(tally: dict[int, Counter[int]], step: int, value: int, by: int) -> None:
    values = tally.get(step)
    if values is None:
        values = tally[step] = Counter()
    values[value] += by
    if values[value] == 0:
        del values[value]
        if not values:
            del tally[step]
