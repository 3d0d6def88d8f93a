"""Start-up configuration compared across ranks: the values each rank's rendezvous and build
depend on (``protocol.Identity``), and the ranks outside a strict majority on each.

Rendezvous values are compared only among ranks that called ``init_process_group`` (their
``init_method`` is known); ``MASTER_ADDR`` and ``MASTER_PORT`` only among ranks that read them
(``env://``). Worked out again only when an identity changed (the state's generation).
"""

from __future__ import annotations

import weakref
from collections import Counter
from collections.abc import Sequence
from dataclasses import dataclass

from ddpwatch.core.vocabulary import Phase
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState

RENDEZVOUS_HOLD_S = 2.0
"""How long a rank waits in the rendezvous before differing values are named: in a healthy
job the last rank's arrival ends it within milliseconds."""

RENDEZVOUS_KEYS: tuple[tuple[str, str], ...] = (
    ("master_port", "MASTER_PORT"),
    ("master_addr", "MASTER_ADDR"),
    ("world_size", "WORLD_SIZE"),
    ("init_method", "init_method"),
    ("run_id", "TORCHELASTIC_RUN_ID"),
    ("backend", "backend"),
)
"""(record field, the name a user knows it by): values every rank's rendezvous must share."""
_ENV_ONLY = frozenset({"master_port", "master_addr"})  # read by env:// only

BUILD_KEYS: tuple[tuple[str, str], ...] = (
    ("torch_version", "torch"),
    ("cuda_version", "CUDA"),
    ("nccl_version", "NCCL"),
    ("script_hash", "script"),
)
"""(record field, name): what every rank should run the same of."""


@dataclass(frozen=True)
class Difference:
    """One value the ranks disagree on."""

    field: str
    name: str
    values: dict[str, tuple[int, ...]]  # value -> the ranks with it, most ranks first
    odd: tuple[int, ...]  # the ranks outside a strict majority; () where there is none


def differences(records: Sequence[RankRecord], keys: Sequence[tuple[str, str]]) -> list[Difference]:
    """The ``keys`` on which ``records`` (those that know the value) disagree."""
    found = []
    for field, name in keys:
        env_only = field in _ENV_ONLY
        by_value: dict[str, list[int]] = {}
        for record in records:
            value = getattr(record, field)
            if value is None or (env_only and record.init_method != "env://"):
                continue
            by_value.setdefault(str(value), []).append(record.rank)
        if len(by_value) < 2:
            continue
        counts = Counter({value: len(ranks) for value, ranks in by_value.items()})
        ordered = {value: tuple(sorted(by_value[value])) for value, _ in counts.most_common()}
        (top, top_count), *_ = counts.most_common(1)
        total = sum(counts.values())
        odd: tuple[int, ...] = ()
        if 2 * top_count > total:
            odd = tuple(sorted(r for v, ranks in ordered.items() if v != top for r in ranks))
        found.append(Difference(field, name, ordered, odd))
    return found


def held_in_rendezvous(records: Sequence[RankRecord], now: float) -> float | None:
    """The longest a rank that called init_process_group has been in the rendezvous (a rank
    that ended there counts as held for good); None when none is there."""
    longest: float | None = None
    for record in records:
        if record.init_method is None or record.phase != Phase.RENDEZVOUS:
            continue
        held = float("inf") if record.finished else now - (record.phase_since or now)
        longest = held if longest is None else max(longest, held)
    return longest


def launch_differences(state: ServerState) -> tuple[list[Difference], list[Difference]]:
    """(rendezvous differences among the ranks that called init_process_group, build
    differences among every rank), worked out again only when an identity changed (the
    state's generation): at 65,536 ranks a scan a second would be wasted once they run."""
    key = (state.generation, len(state.ranks))
    cached = _cache[0]
    if cached is not None and cached[0]() is state and cached[1] == key:
        return cached[2], cached[3]
    records = list(state.ranks.values())
    called = [r for r in records if r.init_method is not None]
    rendezvous, build = differences(called, RENDEZVOUS_KEYS), differences(records, BUILD_KEYS)
    _cache[0] = (weakref.ref(state), key, rendezvous, build)
    return rendezvous, build


_cache: list[
    tuple[weakref.ref[ServerState], tuple[int, int], list[Difference], list[Difference]] | None
] = [None]
"""The last state's differences: one server's state at a time."""


def rendezvous_split(state: ServerState, now: float, hold_s: float) -> list[Difference]:
    """The rendezvous values the ranks that called ``init_process_group`` disagree on, once one
    of them has been held there ``hold_s`` (or ended there); [] otherwise."""
    rendezvous, _ = launch_differences(state)
    if not rendezvous:
        return []
    held = held_in_rendezvous(list(state.ranks.values()), now)
    return rendezvous if held is not None and held >= hold_s else []
