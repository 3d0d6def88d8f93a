"""How a rule is declared: the kinds it may raise (checked against the contract at import)
and the one way alerts are built."""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterable
from typing import Protocol

from ddpwatch.server.alerts import KINDS, Alert, Thresholds
from ddpwatch.server.rules.facts import Facts
from ddpwatch.server.state import ServerState
from ddpwatch.vocabulary import SeverityName


class Rule(Protocol):
    """A diagnosis rule: pure, over the state at ``now``; ``facts`` only saves work."""

    kinds: tuple[str, ...]

    def __call__(
        self, state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
    ) -> list[Alert]: ...


def rule(*kinds: str) -> Callable[[Callable[[Facts], list[Alert]]], Rule]:
    """Declare a rule over ``Facts`` raising only ``kinds``; a kind not in the contract's
    list fails here, when the module is imported, not when the rule first fires."""
    unknown = [kind for kind in kinds if kind not in KINDS]
    if unknown or not kinds:
        raise ValueError(f"rule declares unknown alert kinds {unknown}; known: {KINDS}")

    def declare(body: Callable[[Facts], list[Alert]]) -> Rule:
        @functools.wraps(body)
        def run(
            state: ServerState, now: float, th: Thresholds, facts: Facts | None = None
        ) -> list[Alert]:
            return body(facts or Facts(state, now, th))

        run.kinds = kinds  # type: ignore[attr-defined]
        return run  # type: ignore[return-value]

    return declare


def alert(
    kind: str,
    severity: SeverityName,
    ranks: Iterable[int],
    waiting: Iterable[int],
    message: str,
    hint: str,
) -> Alert:
    """An alert with sorted culprits, and no culprit listed as waiting on itself."""
    culprits = tuple(sorted(set(ranks)))
    return Alert(
        kind=kind,
        severity=severity,
        ranks=culprits,
        waiting=tuple(sorted(set(waiting) - set(culprits))),
        message=message,
        hint=hint,
    )
