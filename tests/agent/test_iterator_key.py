"""Batches are counted per DataLoader iterator by a number of its own, never by ``id()``: a
new epoch's iterator that takes the last one's freed address starts from 0 like on every
other rank (found by benchmarks/false_alarms.py: a false step_skew at the first epoch's end)."""

from __future__ import annotations

from ddpwatch.agent.progress import Progress
from ddpwatch.agent.split import InputTimer, iterator_key


class Iterator:
    """Stands for a ``_BaseDataLoaderIter``: a plain object that takes attributes."""


class Slotted:
    __slots__ = ()


def draw(timer: InputTimer, iterator: object, n: int) -> None:
    for _ in range(n):
        with timer(iterator):
            pass


def test_an_iterator_at_a_freed_address_counts_from_zero() -> None:
    progress = Progress()
    timer = InputTimer(progress, timing=False)
    first = Iterator()
    address = id(first)
    draw(timer, first, 265)
    del first
    for _ in range(10_000):  # CPython hands the freed address out again, soon
        second = Iterator()
        if id(second) == address:
            break
    assert id(second) == address
    draw(timer, second, 8)
    assert progress.drawn[progress.drawn_from] == 8  # not 273


def test_each_iterator_keeps_its_number_and_slotted_ones_fall_back_to_their_address() -> None:
    a, b = Iterator(), Iterator()
    assert iterator_key(a) == iterator_key(a) != iterator_key(b)
    slotted = Slotted()
    assert iterator_key(slotted) == -id(slotted)
