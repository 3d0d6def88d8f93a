"""Rank lists written short: ``[0, 1, 2, 3, 7, 9, 10]`` -> ``"0-3,7,9-10"``, and read back
(``parse_rank_ranges``: ``ddpwatch status --ranks``, the query socket's ``ranks=``).

One algorithm for the alert messages (``server.rules.text.format_ranks``: "ranks 0-5, 9")
and the dashboard (``tui.fmt.rank_ranges``: "0-5,9"). A shared module: it imports nothing of
ddpwatch, so the server and the views may both use it.
"""

from __future__ import annotations

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
    ordered = sorted(set(ranks))
    if not ordered:
        return ""
    pieces: list[tuple[str, int]] = []  # (text, how many ranks it stands for)
    start = prev = ordered[0]
    for rank in [*ordered[1:], None]:
        if rank is not None and rank == prev + 1:
            prev = rank
            continue
        if prev - start + 1 >= min_run:
            pieces.append((f"{start}-{prev}", prev - start + 1))
        else:
            pieces.extend((str(r), 1) for r in range(start, prev + 1))
        if rank is not None:
            start = prev = rank
    text = sep.join(piece for piece, _ in pieces[:limit])
    if len(pieces) > limit:
        text += more.format(sum(n for _, n in pieces[limit:]))
    return text


def parse_rank_ranges(text: str, limit: int = MAX_PARSED_RANKS) -> frozenset[int]:
    """The ranks of a list like ``"0-63,70,100-103"`` (spaces around pieces allowed); a
    ``ValueError`` with a one-line reason for anything else (a negative rank, a backwards
    range, more than ``limit`` ranks: each range is sized before it is expanded).

    >>> sorted(parse_rank_ranges("0-2, 7"))
    [0, 1, 2, 7]
    """
    if not text.strip():
        raise ValueError("empty rank list")
    ranks: set[int] = set()
    for piece in text.split(","):
        first, last = _rank_piece(piece.strip())
        if last - first + 1 > limit:
            raise ValueError(f"more than {limit} ranks in {_short(text)}")
        ranks.update(range(first, last + 1))
        if len(ranks) > limit:
            raise ValueError(f"more than {limit} ranks in {_short(text)}")
    return frozenset(ranks)


def _rank_piece(piece: str) -> tuple[int, int]:
    """``"5"`` -> (5, 5), ``"0-63"`` -> (0, 63)."""
    match = _PIECE.fullmatch(piece)
    if match is None:
        raise ValueError(f"not a rank or a range of ranks (like 0-63): {_short(piece)}")
    first = int(match[1])
    last = first if match[2] is None else int(match[2])
    if last < first:
        raise ValueError(f"range {_short(piece)} runs backwards")
    return first, last


def _short(text: str, width: int = 40) -> str:
    """``text`` quoted on one line, cut to about ``width``: it goes into error messages."""
    return repr(text if len(text) <= width else text[:width] + "...")
