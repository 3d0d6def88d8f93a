"""Mismatch: ranks that made different calls at the same collective number (another op, size
or dtype), and ranks whose count at a marked step differs from the majority's (a desync)."""

from __future__ import annotations

import math
from collections import defaultdict
from collections.abc import Callable
from dataclasses import dataclass

from ddpwatch.core.protocol import Collective
from ddpwatch.diagnosis.facts.census import Census
from ddpwatch.diagnosis.facts.ranks import WaitKey, normal_op, wait_key
from ddpwatch.server.records import RankRecord
from ddpwatch.server.waits import WaitGroup, call_of

MISMATCH_SETTLE_S = 1.0  # a live rank's call counts once it has waited in it this long


@dataclass(frozen=True)
class OddMark:
    """Ranks whose count at a marked step differs from a strict majority's (``odd_at_mark``)."""

    step: int
    usual: int  # the majority's count
    majority: list[RankRecord]
    odd: list[RankRecord]  # by rank


def odd_at_mark(
    live: list[RankRecord], marks_of: Callable[[RankRecord], dict[int, int]]
) -> OddMark | None:
    """At the latest step every live rank has marked (each mark: step -> its count then), the
    ranks whose count differs from a strict majority's; None when every live rank has not
    marked, fewer than 3 have, all agree, or no side is a clear majority."""
    marked = [r for r in live if marks_of(r)]
    if len(marked) < 3 or len(marked) < len(live):
        return None
    step = _latest_common_mark([marks_of(r) for r in marked])
    if step is None:
        return None
    by_count: dict[int, list[RankRecord]] = defaultdict(list)
    for r in marked:
        by_count[marks_of(r)[step]].append(r)
    if len(by_count) < 2:
        return None
    ranked = sorted(by_count.items(), key=lambda item: (-len(item[1]), item[0]))
    (usual, majority), (_, second) = ranked[0], ranked[1]
    if len(majority) <= len(second) or len(majority) * 2 <= len(marked):
        return None  # no clear majority: which side is odd cannot be told
    odd = sorted((r for _, group in ranked[1:] for r in group), key=lambda r: r.rank)
    return OddMark(step, usual, majority, odd)


def _latest_common_mark(marks: list[dict[int, int]]) -> int | None:
    """The latest step every rank has marked. Usually the earliest of their latest marks
    (ranks keep the last few); only when some rank lacks it, the full intersection."""
    step = min(max(m) for m in marks)
    if all(step in m for m in marks):
        return step
    common = set.intersection(*(set(m) for m in marks))
    return max(common) if common else None


_SIZE_FREE_OPS = frozenset({"alltoall", "alltoallsingle", "send", "recv"})
"""Ops whose ranks may legitimately pass tensors of different sizes (split sizes)."""


@dataclass
class Mismatch:
    """Ranks that reached the same collective number with different calls."""

    key: WaitKey
    calls: list[tuple[str, list[RankRecord]]]  # (what they called, who), most ranks first
    culprits: list[RankRecord]  # the odd ones out; empty when no majority tells them apart
    others: list[RankRecord]


def call_text(c: Collective) -> str:
    """How a rank called a collective: "all_gather with 5 elements (float32)"."""
    text = c.op.split("[", 1)[0].rsplit(":", 1)[-1]
    if c.shape is not None:
        numel = math.prod(c.shape)
        text += f" with {numel} {'element' if numel == 1 else 'elements'}"
    return text + (f" ({c.dtype})" if c.dtype else "")


def find_mismatch(census: Census, now: float, settle: float) -> Mismatch | None:
    """The first collective number where ranks made different calls: another op, or the
    same op with another size or dtype. Live ranks count once they have been in it for
    ``settle`` seconds; dead ranks with the collective they died in."""
    finals: dict[WaitKey, list[tuple[RankRecord, Collective]]] = defaultdict(list)
    for r in census.finished:
        c = r.final_collective
        if c is not None and c.seq is not None:
            finals[wait_key(c)].append((r, c))
    numbered = [key for key in census.waits if key[0] != "op"]  # comparable across ranks
    for key in sorted({*numbered, *finals}, key=lambda k: (str(k[0]), str(k[1]), k[2])):
        group = census.waits.get(key)
        died = finals.get(key, [])
        if _all_alike(group, died):  # and so are those settled in it: the common case, cheaply
            continue
        waiting = group.records() if group is not None else []
        members = [(r, r.collective) for r in waiting if r.collective is not None]
        settled = [m for m in members if _settled(*m, now, settle)] + died
        found = _mismatch_in(key, sorted(settled, key=lambda m: m[0].rank)) if settled else None
        if found is not None:
            return found
    return None


def _settled(record: RankRecord, c: Collective, now: float, settle: float) -> bool:
    seen = record.collective_seen
    return seen is not None and c.since_s + max(0.0, now - seen) >= settle


def _mismatch_in(key: WaitKey, members: list[tuple[RankRecord, Collective]]) -> Mismatch | None:
    """The calls made at one collective number, when they differ; the odd ones out are the
    culprits (none on a tie)."""
    sized = all(c.shape is not None for _, c in members) and not any(
        normal_op(c.op) in _SIZE_FREE_OPS for _, c in members
    )
    calls: dict[tuple[object, ...], list[RankRecord]] = defaultdict(list)
    texts: dict[tuple[object, ...], str] = {}
    for r, c in members:
        numel = math.prod(c.shape) if sized and c.shape is not None else None
        signature = (normal_op(c.op), numel, c.dtype if sized else None)
        calls[signature].append(r)
        texts.setdefault(signature, call_text(c) if sized else c.op)
    if len(calls) < 2:
        return None
    ranked = sorted(calls.items(), key=lambda item: (-len(item[1]), min(r.rank for r in item[1])))
    majority = ranked[0][1]
    if len(majority) == len(ranked[1][1]):
        culprits: list[RankRecord] = []  # a tie: either side may be the odd one
        others = [r for _, group in ranked for r in group]
    else:
        culprits = [r for _, group in ranked[1:] for r in group]
        others = list(majority)
    described = [(texts[signature], group) for signature, group in ranked]
    return Mismatch(key, described, culprits, others)


def _all_alike(group: WaitGroup | None, died: list[tuple[RankRecord, Collective]]) -> bool:
    """Every call is exactly the same (op, shape, dtype): no mismatch, and no need to work
    out each call's signature (thousands of ranks in one all_reduce). The group counts its
    calls as ranks join it."""
    calls = set(group.calls()) if group is not None else set()
    calls.update(call_of(c) for _, c in died)
    return len(calls) == 1
