"""How a rule is declared: the kinds it may raise (checked against the contract at import)
and the one way alerts are built."""

from __future__ import annotations

import functools
from bisect import bisect_left
from collections.abc import Callable, Iterable
from typing import Literal, Protocol

from ddpwatch.core.vocabulary import ALERT_KINDS, Severity
from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.mismatch import OddMark
from ddpwatch.state.state import ServerState

Cadence = Literal["tick", "change", "slow"]
"""How often a rule must run: ``tick``, every diagnosis tick; ``change``, when what it reads
changed (``ServerState.generation``: a rank joined, changed identity, crashed, exited or
wrote a checkpoint; or the set of silent ranks), because it reads nothing else; ``slow``,
every second or so, for measurements that drift (memory, step rates) and never need a
sub-second answer."""


class Rule(Protocol):
    """A diagnosis rule: pure, over the state at ``now``; ``facts`` only saves work."""

    __name__: str
    kinds: tuple[str, ...]
    every: Cadence
    """How often a ticking server (``Diagnosis``) must run it; ``diagnose`` runs every rule."""

    def __call__(
        self, state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
    ) -> list[Alert]: ...


def rule(*kinds: str, every: Cadence = "tick") -> Callable[[Callable[[Facts], list[Alert]]], Rule]:
    """Declare a rule over ``Facts`` raising only ``kinds``; a kind not in the contract's
    list fails here, when the module is imported, not when the rule first fires. ``every``:
    its ``Cadence``."""
    unknown = [kind for kind in kinds if kind not in ALERT_KINDS]
    if unknown or not kinds:
        raise ValueError(f"rule declares unknown alert kinds {unknown}; known: {ALERT_KINDS}")

    def declare(body: Callable[[Facts], list[Alert]]) -> Rule:
        @functools.wraps(body)
        def run(
            state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
        ) -> list[Alert]:
            return body(facts or Facts(state, now, th))

        run.kinds = kinds  # type: ignore[attr-defined]
        run.every = every  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return declare


def alert(
    kind: str,
    severity: Severity,
    ranks: Iterable[int],
    waiting: Iterable[int],
    message: str,
    hint: str,
    *,
    waited_s: float | None = None,
    phase: str | None = None,
    lost_share: float | None = None,
    waiting_sorted: bool = False,
) -> Alert:
    """An alert with sorted culprits, and no culprit listed as waiting on itself.
    ``waiting_sorted``: ``waiting`` is a sorted list of unique ranks already (a wait group's
    own), which is then not put in a set and sorted again: 131,071 waiters cost 10 ms so."""
    culprits = tuple(sorted(set(ranks)))
    if waiting_sorted and isinstance(waiting, list):
        others = _without(waiting, culprits)
    else:
        unique = set(waiting)  # 65,535 of them in a hang at scale: one set, changed in place
        unique.difference_update(culprits)
        others = tuple(sorted(unique))
    return Alert(
        kind=kind,
        severity=severity,
        ranks=culprits,
        waiting=others,
        message=message,
        hint=hint,
        waited_s=waited_s,
        phase=phase,
        lost_share=lost_share,
    )


def _without(ordered: list[int], culprits: tuple[int, ...]) -> tuple[int, ...]:
    """``ordered`` (sorted, unique) less ``culprits``, found by bisection."""
    kept = tuple(ordered)
    for rank in culprits:
        at = bisect_left(kept, rank)
        if at < len(kept) and kept[at] == rank:
            kept = kept[:at] + kept[at + 1 :]
    return kept


def odd_alert(kind: str, found: OddMark, message: str, hint: str) -> Alert:
    """The error for ranks whose count at a marked step differs from a strict majority's
    (``odd_at_mark``): they are the culprits, the majority the ranks they put out of step."""
    culprits = [r.rank for r in found.odd]
    return alert(kind, Severity.ERROR, culprits, [r.rank for r in found.majority], message, hint)

