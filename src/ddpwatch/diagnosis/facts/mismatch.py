"""Mismatch: ranks that made different calls at the same collective number (another op, size,
dtype, reduce op or root), and ranks whose count at a marked step differs from the majority's
(a desync)."""

from __future__ import annotations

import math
from collections import Counter, defaultdict
from dataclasses import dataclass
from itertools import repeat
from operator import attrgetter, contains, itemgetter

from ddpwatch.core.protocol import CallSeen, Collective
from ddpwatch.core.vocabulary import CollectiveSource
from ddpwatch.diagnosis.facts.census import Census
from ddpwatch.diagnosis.facts.ranks import WaitKey, normal_op, wait_key
from ddpwatch.state.records import RankRecord
from ddpwatch.state.waits import WaitGroup, call_of

MISMATCH_SETTLE_S = 1.0  # a live rank's call counts once it has waited in it this long


@dataclass(frozen=True)
class OddMark:
    """Ranks whose count at a marked step differs from a strict majority's (``odd_at_mark``)."""

    step: int
    usual: int  # the majority's count
    majority: list[RankRecord]
    odd: list[RankRecord]  # by rank
    own: int  # the first odd rank's count

    @property
    def diff(self) -> int:
        """How far the first odd rank's count is from the majority's (negative: behind)."""
        return self.own - self.usual


def odd_at_mark(live: list[RankRecord], marks: str) -> OddMark | None:
    """At the latest step every live rank has marked (``marks`` names the record's marks:
    step -> its count then), the ranks whose count differs from a strict majority's; None
    when every live rank has not marked, fewer than 3 have, all agree, or no side is a clear
    majority. A lockstep job, where all agree, costs a list of counts and their tally."""
    marked = list(map(attrgetter(marks), live))
    if len(marked) < 3 or not all(marked):
        return None
    step = _latest_common_mark(marked)
    if step is None:
        return None
    counts = list(map(itemgetter(step), marked))
    tally = Counter(counts)
    if len(tally) < 2:
        return None
    (usual, most), (_, second) = sorted(tally.items(), key=lambda item: (-item[1], item[0]))[:2]
    if most <= second or most * 2 <= len(marked):
        return None  # no clear majority: which side is odd cannot be told
    majority = [r for r, count in zip(live, counts, strict=True) if count == usual]
    odd = sorted(
        (r for r, count in zip(live, counts, strict=True) if count != usual), key=lambda r: r.rank
    )
    return OddMark(step, usual, majority, odd, getattr(odd[0], marks)[step])


def _latest_common_mark(marks: list[dict[int, int]]) -> int | None:
    """The latest step every rank has marked. Usually the earliest of their latest marks
    (ranks keep the last few); only when some rank lacks it, the full intersection."""
    step = min(map(max, marks))  # map, not a generator: a C loop over 131,072 ranks
    if all(map(contains, marks, repeat(step))):
        return step
    common = set.intersection(*(set(m) for m in marks))
    return max(common) if common else None


@dataclass(frozen=True)
class OddCalls:
    """Ranks whose calls between two marks differ from a strict majority's, with as many
    calls (``odd_calls``): another root, reduce op, dtype or size, where the backend ran on."""

    step: int  # the mark that ends the window
    since: int | None  # the mark before it, where the first odd rank marked one
    majority: list[RankRecord]
    odd: list[RankRecord]  # by rank
    theirs: CallSeen | None  # the first odd rank's first call the majority did not make
    usual: CallSeen | None  # the majority's call at that number (else one of that op)


def odd_calls(live: list[RankRecord]) -> OddCalls | None:
    """At the latest step every live rank has a call digest for, the ranks whose digest
    differs from a strict majority's; None unless 3 or more live ranks all have one, their
    counts at that step agree (a count that differs is ``odd_at_mark``'s: a collective one
    rank calls and the others do not), and one side is a clear majority."""
    marked = [r for r in live if r.call_digests]
    if len(marked) < 3 or len(marked) < len(live):
        return None
    step = _latest_common_mark([r.call_digests for r in marked])
    if step is None:
        return None
    counts = {r.step_marks.get(step) for r in marked}
    if len(counts) != 1 or None in counts:
        return None
    by_digest: dict[int, list[RankRecord]] = defaultdict(list)
    for r in marked:
        by_digest[r.call_digests[step]].append(r)
    if len(by_digest) < 2:
        return None
    ranked = sorted(by_digest.values(), key=lambda group: (-len(group), min(r.rank for r in group)))
    majority, second = ranked[0], ranked[1]
    if len(majority) <= len(second) or len(majority) * 2 <= len(marked):
        return None  # no clear majority: which side is odd cannot be told
    odd = sorted((r for group in ranked[1:] for r in group), key=lambda r: r.rank)
    first = odd[0]
    before = [s for s in first.step_marks if s < step]
    theirs, usual = _first_difference(first, majority, step)
    return OddCalls(step, max(before) if before else None, majority, odd, theirs, usual)


def _first_difference(
    odd: RankRecord, majority: list[RankRecord], step: int
) -> tuple[CallSeen | None, CallSeen | None]:
    """The odd rank's first call (by number) that a majority rank did not make in a window
    both described and whose digests differ (``step``'s first, else the latest such), and the
    majority's call at that number, else one of the same op; (None, None) when no window
    tells (the same calls in another order, or described in no common window)."""
    windows = odd.call_windows
    for when in sorted(windows, key=lambda s: (s != step, -s)):
        digest = odd.call_digests.get(when)
        for other in majority:
            usual_calls = other.call_windows.get(when)
            if usual_calls is None or other.call_digests.get(when) == digest:
                continue
            known = {_call_key(c) for c in usual_calls}
            for call in sorted(windows[when], key=lambda c: c.seq):
                if _call_key(call) not in known:
                    same_seq = [c for c in usual_calls if c.seq == call.seq]
                    same_op = [c for c in usual_calls if c.op == call.op]
                    usual = same_seq or same_op
                    return call, usual[0] if usual else None
            break  # the same calls in another order: another window may tell
    return None, None


def _call_key(c: CallSeen) -> tuple[object, ...]:
    return (c.op, c.dtype, c.numel, c.reduce_op, c.root)


_SIZE_FREE_OPS = frozenset({"alltoall", "alltoallsingle", "send", "recv"})
"""Ops whose ranks may legitimately pass tensors of different sizes (split sizes)."""


@dataclass
class Mismatch:
    """Ranks that reached the same collective number with different calls."""

    key: WaitKey
    calls: list[tuple[str, list[RankRecord]]]  # (what they called, who), most ranks first
    culprits: list[RankRecord]  # the odd ones out; empty when no majority tells them apart
    others: list[RankRecord]


def call_text(c: Collective, reduce_op: bool = True, root: bool = True) -> str:
    """How a rank called a collective: "all_gather with 5 elements (float32)", "broadcast
    src=1 with 4 elements (float32)", "all_reduce op=max with 1 element (float32)"; its reduce
    op and root only where asked (where they differ between ranks)."""
    numel = math.prod(c.shape) if c.shape is not None else None
    return call_words(
        c.op, numel, c.dtype, c.reduce_op if reduce_op else None, c.root if root else None
    )


_FROM_DST = frozenset({"reduce", "gather", "gatherobject"})
"""Ops whose root is the rank they reduce or gather to (``dst``); the others' is ``src``."""


def call_words(
    op: str,
    numel: int | None = None,
    dtype: str | None = None,
    reduce_op: str | None = None,
    root: int | None = None,
) -> str:
    """A call in words, from its parts (``call_text``; a window's ``CallSeen``)."""
    text = op.split("[", 1)[0].rsplit(":", 1)[-1]
    if reduce_op is not None:
        text += f" op={reduce_op}"
    if root is not None:
        text += f" {'dst' if normal_op(op) in _FROM_DST else 'src'}={root}"
    if numel is not None:
        text += f" with {numel} {'element' if numel == 1 else 'elements'}"
    return text + (f" ({dtype})" if dtype else "")


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
            counted = {r.rank for r, _ in settled} | {r.rank for r in waiting}
            passed = _passed(census, key, counted, died)
            if passed:  # the ranks already past it say how they called it: more votes
                every = sorted(settled + passed, key=lambda m: m[0].rank)
                found = _mismatch_in(key, every) or found
            return found
    return None


def _passed(
    census: Census, key: WaitKey, counted: set[int], died: list[tuple[RankRecord, Collective]]
) -> list[tuple[RankRecord, Collective]]:
    """The ranks not ``counted`` in ``key`` whose last Python-level call before the collective
    they are in (or died in) was ``key`` (their ``before``), as if they were in it: a gloo
    broadcast whose ``src`` differs on one rank holds that rank and the root, while the ranks
    the root reached go on to the next call (DDP's all-reduce, the next broadcast), so the two
    that hang are a tie these votes break. Asked only where the calls in it already differ:
    ranks pass from one collective to the next all the time."""
    seq = _python_number(key, census.waits.get(key), died)
    if seq is None:
        return []
    elsewhere = [(r, r.collective) for group in census.waits.values() for r in group.records()]
    elsewhere += [(r, r.final_collective) for r in census.finished]
    passed = []
    for r, c in elsewhere:
        before = c.before if c is not None else None
        if before is None or before.seq != seq or r.rank in counted:
            continue
        numel = before.numel
        passed.append((r, Collective(
            op=before.op, seq=seq, source=CollectiveSource.PY, dtype=before.dtype,
            shape=None if numel is None else [numel], reduce_op=before.reduce_op,
            root=before.root,
        )))  # fmt: skip
    return passed


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
    ops = _differ([c.reduce_op for _, c in members])  # compared and quoted only then
    roots = _differ([c.root for _, c in members])
    for r, c in members:
        numel = math.prod(c.shape) if sized and c.shape is not None else None
        signature = (
            normal_op(c.op),
            numel,
            c.dtype if sized else None,
            c.reduce_op if ops else None,
            c.root if roots else None,
        )
        calls[signature].append(r)
        if sized:
            text = call_text(c, ops, roots)
        elif ops or roots:  # no sizes to quote, but a reduce op or root that differs
            text = call_words(
                c.op, reduce_op=c.reduce_op if ops else None, root=c.root if roots else None
            )
        else:
            text = c.op
        texts.setdefault(signature, text)
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


def _python_number(
    key: WaitKey, group: WaitGroup | None, died: list[tuple[RankRecord, Collective]]
) -> int | None:
    """The agent's own number of collective ``key``: its seq for a Python-level one; for the
    flight recorder's, the number its members give (``py_seq``), those still in it and those
    that died in it (a timeout: every rank may be dead by then), when they all give one."""
    source, _, seq = key if len(key) == 3 else (None, None, None)
    if source == CollectiveSource.PY:
        return seq if isinstance(seq, int) else None
    members = [r.collective for r in group.records()] if group is not None else []
    numbers = {c.py_seq if c else None for c in members + [c for _, c in died]}
    return numbers.pop() if len(numbers) == 1 else None


def _differ(values: list[object]) -> bool:
    """Every member said (a rank in an unwrapped call, seen only by the flight recorder, says
    nothing: unknown is not another value), and not all alike."""
    return None not in values and len(set(values)) > 1


def _all_alike(group: WaitGroup | None, died: list[tuple[RankRecord, Collective]]) -> bool:
    """Every call is exactly the same (op, shape, dtype): no mismatch, and no need to work
    out each call's signature (thousands of ranks in one all_reduce). The group counts its
    calls as ranks join it."""
    calls = set(group.calls()) if group is not None else set()
    calls.update(call_of(c) for _, c in died)
    return len(calls) == 1
