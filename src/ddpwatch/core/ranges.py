"""Rank lists written short: ``[0, 1, 2, 3, 7, 9, 10]`` -> ``"0-3,7,9-10"``, and read back
(``parse_rank_ranges``: ``ddpwatch status --ranks``, the query socket's ``ranks=``;
``rank_spans``: the dashboard's filter box, which never expands a range).

One algorithm for the alert messages (``diagnosis.text.format_ranks``: "ranks 0-5, 9")
and the dashboard ("0-5,9"). A shared module: it imports nothing of
ddpwatch, so the server and the views may both use it.
"""

from __future__ import annotations

import bisect
import re
from collections.abc import Iterable

MAX_PARSED_RANKS = 1 << 20
"""The most ranks a rank list may name: a 4 KiB query cannot make the server build more."""

_PIECE = re.compile(r"([0-9]{1,10})(?: *- *([0-9]{1,10}))?")


def rank_ranges(
    ranks: Iterable[int],
    limit: int = 8,
    *,
    sep: str = ",",
    min_run: int = 2,
    more: str = " +{}",
) -> str:
    """Sorted, unique ``ranks`` with each run of ``min_run`` or more consecutive ranks as
    "a-b" (shorter runs written out), joined by ``sep``; past ``limit`` pieces the rest is
    ``more`` formatted with how many ranks it stands for. No rank: "".

    >>> rank_ranges([0, 1, 2, 3, 7, 9, 10])
    '0-3,7,9-10'
    >>> rank_ranges([0, 1, 2, 7, 9, 10], sep=", ", min_run=3)
    '0-2, 7, 9, 10'
    >>> rank_ranges(range(0, 40, 2), limit=3)
    '0,2,4 +17'
    """
    if min_run < 2:
        raise ValueError(f"min_run must be at least 2, not {min_run}")
    return sorted_ranges(sorted(set(ranks)), limit, sep, min_run, more)


def sorted_ranges(ordered: list[int], limit: int, sep: str, min_run: int, more: str) -> str:
    """``rank_ranges`` of ranks already sorted and unique. It stops at the ``limit``-th
    piece and counts the rest, so 65,536 waiting ranks cost one sort, not a walk."""
    pieces: list[str] = []
    offsets = _Offsets(ordered)
    n, i = len(ordered), 0
    while i < n and len(pieces) < limit:
        end = bisect.bisect_right(offsets, offsets[i], i)  # ordered[i:end] is one run
        if end - i >= min_run:
            pieces.append(f"{ordered[i]}-{ordered[end - 1]}")
            i = end
        else:
            pieces.append(str(ordered[i]))
            i += 1
    text = sep.join(pieces)
    if i < n:
        text += more.format(n - i)
    return text


class _Offsets:
    """``ordered[k] - k`` for sorted unique ranks: it never decreases, and it stays the same
    exactly along a run of consecutive ranks, so a binary search finds where a run ends."""

    def __init__(self, ordered: list[int]) -> None:
        self.ordered = ordered

    def __len__(self) -> int:
        return len(self.ordered)

    def __getitem__(self, k: int) -> int:
        return self.ordered[k] - k


def parse_rank_ranges(text: str, limit: int = MAX_PARSED_RANKS) -> frozenset[int]:
    """The ranks of a list like ``"0-63,70,100-103"`` (spaces around pieces allowed); a
    ``ValueError`` with a one-line reason for anything else (a negative rank, a backwards
    range, more than ``limit`` ranks: each range is sized before it is expanded).

    >>> sorted(parse_rank_ranges("0-2, 7"))
    [0, 1, 2, 7]
    """
    ranks: set[int] = set()
    for first, last in rank_spans(text):
        if last - first + 1 > limit:
            raise ValueError(f"more than {limit} ranks in {_short(text)}")
        ranks.update(range(first, last + 1))
        if len(ranks) > limit:
            raise ValueError(f"more than {limit} ranks in {_short(text)}")
    return frozenset(ranks)


def rank_spans(text: str, *, backwards: bool = False) -> list[tuple[int, int]]:
    """The pieces of a rank list, each as (first, last), in the order written, not expanded;
    a ``ValueError`` with a one-line reason for anything that is not a rank list. With
    ``backwards``, a range written high to low (``7-3``) reads as low to high.

    >>> rank_spans("0-63, 70")
    [(0, 63), (70, 70)]
    """
    if not text.strip():
        raise ValueError("empty rank list")
    return [_rank_piece(piece.strip(), backwards) for piece in text.split(",")]


def _rank_piece(piece: str, backwards: bool) -> tuple[int, int]:
    """``"5"`` -> (5, 5), ``"0-63"`` -> (0, 63)."""
    match = _PIECE.fullmatch(piece)
    if match is None:
        raise ValueError(f"not a rank or a range of ranks (like 0-63): {_short(piece)}")
    first = int(match[1])
    last = first if match[2] is None else int(match[2])
    if last < first:
        if not backwards:
            raise ValueError(f"range {_short(piece)} runs backwards")
        first, last = last, first
    return first, last


def _short(text: str, width: int = 40) -> str:
    """``text`` quoted on one line, cut to about ``width``: it goes into error messages."""
    return repr(text if len(text) <= width else text[:width] + "...")
