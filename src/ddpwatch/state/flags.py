"""Two facts about a rank that few ranks have once a job runs, kept as messages arrive: it has
not reported a step yet, and its loss or its own gradients are not finite. The start-up and
NaN rules ran a pass over every rank every tick to find none (~10 ms each at 131,072 ranks,
where one field of every record costs that however it is read); they now leave at once when
these sets hold no live rank, and pass over the ranks only when one does.
"""

from __future__ import annotations

from collections.abc import Iterable

from ddpwatch.state.records import RankRecord


class RankFlags:
    """The ranks of ``ServerState.ranks`` whose record has no step (``unstepped``) and whose
    loss or gradients went bad (``non_finite``: ``nan_step`` or ``grad_nan_step`` set)."""

    def __init__(self) -> None:
        self.unstepped: set[int] = set()
        self.non_finite: set[int] = set()

    @classmethod
    def of(cls, records: Iterable[RankRecord]) -> RankFlags:
        """The flags of records changed by hand (tests, a rule called alone)."""
        flags = cls()
        for record in records:
            flags.note(record)
        return flags

    def note(self, record: RankRecord) -> None:
        """Where ``record`` stands now: after each message applied to it, and when it is new."""
        rank = record.rank
        if record.step is None:
            self.unstepped.add(rank)
        else:
            self.unstepped.discard(rank)
        if record.nan_step is None and record.grad_nan_step is None:
            self.non_finite.discard(rank)
        else:
            self.non_finite.add(rank)

    def drop(self, rank: int) -> None:
        """The rank is no longer in the job's state (its attempt ended)."""
        self.unstepped.discard(rank)
        self.non_finite.discard(rank)
