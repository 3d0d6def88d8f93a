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
    next_batch = timer.wrap(lambda _iterator: None)
    for _ in range(n):
        next_batch(iterator)


def _at_a_freed_address(timer: InputTimer) -> Iterator | None:
    """A new iterator at the address of one that drew 265 batches and was freed: CPython
    hands a freed address out again soon, unless another thread's allocation took it."""
    first = Iterator()
    address = id(first)
    draw(timer, first, 265)
    del first
    for _ in range(10_000):
        second = Iterator()
        if id(second) == address:
            return second
    return None


def test_an_iterator_at_a_freed_address_counts_from_zero() -> None:
    progress = Progress()
    timer = InputTimer(progress, timing=False)
    for _ in range(20):  # another test's leftover thread may allocate in between: try again
        second = _at_a_freed_address(timer)
        if second is not None:
            break
    assert second is not None, "CPython never reused the freed address"
    draw(timer, second, 8)
    assert progress.drawn[progress.drawn_from] == 8  # not 273


def test_each_iterator_keeps_its_number_and_slotted_ones_fall_back_to_their_address() -> None:
    a, b = Iterator(), Iterator()
    assert iterator_key(a) == iterator_key(a) != iterator_key(b)
    slotted = Slotted()
    assert iterator_key(slotted) == -id(slotted)


def test_the_end_of_an_epoch_counts_no_batch_and_its_wait_still_counts() -> None:
    progress = Progress()
    timer = InputTimer(progress)
    iterator = Iterator()
    draw(timer, iterator, 3)

    def exhausted(_iterator: object) -> None:
        raise StopIteration

    try:
        timer.wrap(exhausted)(iterator)
    except StopIteration:
        pass
    else:
        raise AssertionError("the wrapper swallowed StopIteration")
    assert progress.drawn[progress.drawn_from] == 3  # the StopIteration is no batch
    assert progress.input_seen and timer.faults == 0
