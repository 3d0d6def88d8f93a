"""Diagnosis: pure rules over ``ServerState`` that name the rank behind a problem, its cause
and the fix.

``facts`` holds the attribution model every family shares (who failed first, who has
entered which collective, on what evidence); ``text`` the words. Each family module
(cascade, collectives, progress, startup, devices) imports those two and never another
family. A rule is a function of ``Facts`` declared with ``@rule(kinds...)``: the kinds it
may raise are checked against the contract when the module is imported.

The server calls ``diagnose`` four times a second with up to thousands of ranks, so each
rule is one or two linear passes plus a sort; ``Facts`` does shared work once per call.
"""

from __future__ import annotations

import logging
from collections import Counter

from ddpwatch.server.alerts import Alert, Thresholds
from ddpwatch.server.rules.cascade import rule_cascade, rule_clean_exit
from ddpwatch.server.rules.collectives import rule_collective_mismatch, rule_straggler
from ddpwatch.server.rules.devices import (
    rule_device_ordinal,
    rule_duplicate_device,
    rule_foreign_memory,
    rule_local_rank_mismatch,
    rule_uneven_memory,
)
from ddpwatch.server.rules.facts import Facts, effective_stall_after, rank_state
from ddpwatch.server.rules.listening import rule_server_behind
from ddpwatch.server.rules.progress import (
    rule_checkpoint_conflict,
    rule_nan_loss,
    rule_slow_rank,
    rule_stalled,
    rule_step_skew,
)
from ddpwatch.server.rules.registry import Rule
from ddpwatch.server.rules.relays import rule_relay_lost
from ddpwatch.server.rules.startup import rule_not_connected, rule_startup_hang
from ddpwatch.server.state import ServerState
from ddpwatch.vocabulary import SEVERITIES, STARTUP_PHASES

__all__ = [
    "RULES",
    "STARTUP_PHASES",
    "Facts",
    "Rule",
    "diagnose",
    "effective_stall_after",
    "rank_state",
    "rule_cascade",
    "rule_checkpoint_conflict",
    "rule_clean_exit",
    "rule_collective_mismatch",
    "rule_device_ordinal",
    "rule_duplicate_device",
    "rule_foreign_memory",
    "rule_local_rank_mismatch",
    "rule_nan_loss",
    "rule_not_connected",
    "rule_relay_lost",
    "rule_server_behind",
    "rule_slow_rank",
    "rule_stalled",
    "rule_startup_hang",
    "rule_step_skew",
    "rule_straggler",
    "rule_uneven_memory",
]

RULES: tuple[Rule, ...] = (
    rule_cascade,
    rule_clean_exit,
    rule_relay_lost,
    rule_server_behind,
    rule_straggler,
    rule_collective_mismatch,
    rule_stalled,
    rule_startup_hang,
    rule_not_connected,
    rule_duplicate_device,
    rule_device_ordinal,
    rule_local_rank_mismatch,
    rule_uneven_memory,
    rule_foreign_memory,
    rule_step_skew,
    rule_nan_loss,
    rule_checkpoint_conflict,
    rule_slow_rank,
)


_SEVERITY_ORDER = {severity: n for n, severity in enumerate(SEVERITIES)}  # error first
RULE_FAILURES: Counter[str] = Counter()
"""Ticks each rule raised on, by rule name, since the server started."""
log = logging.getLogger("ddpwatch")


def _sort_key(alert: Alert) -> tuple[int, str, tuple[int, ...]]:
    return (_SEVERITY_ORDER.get(alert.severity, len(SEVERITIES)), alert.kind, alert.ranks)


def diagnose(state: ServerState, now: float, th: Thresholds) -> list[Alert]:
    """Every rule's alerts, one per (kind, culprits), most severe first, as of what the
    server has read (``state.as_of(now)``): a server behind its queue judges the ranks as
    they were when it last caught up, never by the messages it has not read yet.

    A rule that raises (a bug, or data no test foresaw) loses its alerts for this tick, is
    logged once and counted in ``RULE_FAILURES``; the other rules and the server go on.
    """
    facts = Facts(state, now, th)
    found: list[Alert] = []
    for rule in RULES:
        try:
            found.extend(rule(state, now, th, facts))
        except Exception:
            name = getattr(rule, "__name__", repr(rule))
            if not RULE_FAILURES[name]:
                log.exception("diagnosis rule %s failed; its alerts are skipped", name)
            RULE_FAILURES[name] += 1
    alerts = sorted(found, key=_sort_key)
    seen: set[tuple[str, tuple[int, ...]]] = set()
    unique = []
    for alert in alerts:
        if alert.key not in seen:
            seen.add(alert.key)
            unique.append(alert)
    return unique
