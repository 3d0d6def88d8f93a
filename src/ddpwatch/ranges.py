"""Rank lists written short: ``[0, 1, 2, 3, 7, 9, 10]`` -> ``"0-3,7,9-10"``.

One algorithm for the alert messages (``server.rules.text.format_ranks``: "ranks 0-5, 9")
and the dashboard (``tui.fmt.rank_ranges``: "0-5,9"). A shared module: it imports nothing of
ddpwatch, so the server and the views may both use it.
"""

from __future__ import annotations

from collections.abc import Iterable


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
