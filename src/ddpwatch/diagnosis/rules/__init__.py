"""Diagnosis: pure rules over ``ServerState`` that name the rank behind a problem, its cause
and the fix.

``diagnosis.facts`` holds the attribution model every family shares (who failed first, who
has entered which collective, on what evidence); ``diagnosis.text`` the words. Each family
module (cascade, collectives, progress, startup, launch_config, devices, memory, relays,
listening) imports
those two and the registry, never another family. A rule is a function of ``Facts`` declared
with ``@rule(kinds...)``: the kinds it may raise are checked against the contract when the
module is imported.

The server ticks four times a second with up to 65,536 ranks (``Diagnosis``), so a rule is at
most one or two linear passes plus a sort, and ``Facts`` does shared work once per tick: the
census of live, quiet and finished ranks, and the groups of ranks by the collective they are
in, which ``ServerState`` keeps as heartbeats arrive (``state/waits.py``).
"""

from __future__ import annotations

import logging
import math
from collections import Counter

from ddpwatch.diagnosis.alerts import Alert, Thresholds
from ddpwatch.diagnosis.facts import Facts
from ddpwatch.diagnosis.facts.census import Pace
from ddpwatch.diagnosis.rules.cascade import rule_cascade, rule_clean_exit
from ddpwatch.diagnosis.rules.collectives import (
    rule_collective_arguments,
    rule_collective_desync,
    rule_collective_mismatch,
    rule_evaluation_desync,
    rule_straggler,
)
from ddpwatch.diagnosis.rules.devices import (
    rule_device_ordinal,
    rule_duplicate_device,
    rule_foreign_memory,
    rule_local_rank_mismatch,
    rule_uneven_memory,
)
from ddpwatch.diagnosis.rules.launch_config import rule_config_mismatch, rule_duplicate_rank
from ddpwatch.diagnosis.rules.listening import rule_server_behind
from ddpwatch.diagnosis.rules.memory import rule_host_memory
from ddpwatch.diagnosis.rules.p2p import rule_p2p
from ddpwatch.diagnosis.rules.progress import (
    rule_backward_desync,
    rule_batch_desync,
    rule_checkpoint_conflict,
    rule_nan_loss,
    rule_slow_rank,
    rule_stalled,
    rule_step_skew,
)
from ddpwatch.diagnosis.rules.registry import Rule
from ddpwatch.diagnosis.rules.relays import rule_relay_lost
from ddpwatch.diagnosis.rules.startup import rule_not_connected, rule_startup_hang
from ddpwatch.state.state import ServerState
from ddpwatch.status.order import severity_level

__all__ = [
    "RANK_SCANS_PER_S",
    "RULES",
    "SLOW_S",
    "Diagnosis",
    "Rule",
    "diagnose",
    "rule_backward_desync",
    "rule_batch_desync",
    "rule_cascade",
    "rule_checkpoint_conflict",
    "rule_clean_exit",
    "rule_collective_arguments",
    "rule_collective_desync",
    "rule_collective_mismatch",
    "rule_config_mismatch",
    "rule_device_ordinal",
    "rule_duplicate_device",
    "rule_duplicate_rank",
    "rule_evaluation_desync",
    "rule_foreign_memory",
    "rule_host_memory",
    "rule_local_rank_mismatch",
    "rule_nan_loss",
    "rule_not_connected",
    "rule_p2p",
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
    rule_p2p,
    rule_collective_mismatch,
    rule_collective_desync,
    rule_collective_arguments,
    rule_evaluation_desync,
    rule_stalled,
    rule_startup_hang,
    rule_not_connected,
    rule_config_mismatch,
    rule_duplicate_rank,
    rule_duplicate_device,
    rule_device_ordinal,
    rule_local_rank_mismatch,
    rule_uneven_memory,
    rule_foreign_memory,
    rule_host_memory,
    rule_step_skew,
    rule_batch_desync,
    rule_backward_desync,
    rule_nan_loss,
    rule_checkpoint_conflict,
    rule_slow_rank,
)


RULE_FAILURES: Counter[str] = Counter()
"""Ticks each rule raised on, by rule name, since the server started."""
log = logging.getLogger("ddpwatch")


def _sort_key(alert: Alert) -> tuple[int, str, tuple[int, ...]]:
    return (-severity_level(alert.severity), alert.kind, alert.ranks)  # most severe first


def diagnose(state: ServerState, now: float, th: Thresholds) -> list[Alert]:
    """Every rule's alerts, one per (kind, culprits), most severe first, as of what the
    server has read (``state.as_of(now)``): a server behind its queue judges the ranks as
    they were when it last caught up, never by the messages it has not read yet.

    A rule that raises (a bug, or data no test foresaw) loses its alerts for this tick, is
    logged once and counted in ``RULE_FAILURES``; the other rules and the server go on.
    """
    return _unique(_run(RULES, Facts(state, now, th)))


SLOW_S = 1.0
"""How often a ``slow`` rule runs, at least (and the job's step-time thresholds are redone)."""
RANK_SCANS_PER_S = 131_072
"""How many ranks the ``change`` and ``slow`` rules may scan a second, each scanning every rank
once: every rule that is due at a few thousand ranks, two a second at 65,536, so that they
take a small, bounded part of a core at any size (``docs/performance.md``). It counts ranks,
not CPU, so that a replay paces them exactly as the live server did."""


class Diagnosis:
    """``diagnose`` for a server that ticks four times a second: ``tick`` rules every call;
    a ``change`` rule when ``state.generation`` or the set of silent ranks moved since it
    last ran; a ``slow`` rule every ``SLOW_S`` (see ``registry.Cadence``); of those due, the
    longest waiting first, as many as the ``RANK_SCANS_PER_S`` budget allows, the job's
    step-time thresholds (``Pace``, redone every ``SLOW_S``) among them. In between, a
    rule's last alerts stand. So the alerts are those ``diagnose`` gives, the paced ones a
    little late, and no tick at 65,536 ranks rescans every rank for devices and memory."""

    def __init__(self) -> None:
        self._kept: dict[str, list[Alert]] = {}  # each paced rule's last alerts
        self._ran: dict[str, float] = {}
        self._read: dict[str, tuple[int, frozenset[int]]] = {}  # what a change rule last read
        self._pace: Pace | None = None  # the job's step-time thresholds
        self._paced_at = -math.inf
        self._scans = math.inf  # rank scans the paced rules may still spend (a budget)
        self._scans_at = -math.inf

    def __call__(self, state: ServerState, now: float, th: Thresholds) -> list[Alert]:
        kept = (state.waits, state.devices, state.marks, state.flags)
        facts = Facts(state, now, th, self._pace, *kept)
        read = (state.generation, facts.quiet)
        scan = max(1, len(state.ranks))
        self._earn(now, scan)
        runs: list[Rule] = []
        repace = self._pace is None
        for job in self._due(now, read):
            if self._scans < scan:
                break
            self._scans -= scan
            if isinstance(job, _Pace):
                repace = True
            else:
                runs.append(job)
        if repace:
            facts.renew_pace()
        found = _run(TICK_RULES, facts)
        if repace:
            self._pace, self._paced_at = facts.pace, now
        for rule in runs:
            name = rule.__name__
            self._kept[name] = _run((rule,), facts)
            self._ran[name] = now
            if rule.every == "change":
                self._read[name] = read
        return _unique(found + [a for alerts in self._kept.values() for a in alerts])

    def _earn(self, now: float, scan: int) -> None:
        """Add the scans earned since the last call; at most a second's worth (or one
        scan) is banked, so a quiet spell does not pay for a burst."""
        elapsed = max(0.0, now - self._scans_at) if self._scans_at > -math.inf else math.inf
        cap = max(RANK_SCANS_PER_S, scan)
        self._scans = min(cap, self._scans + elapsed * RANK_SCANS_PER_S)
        self._scans_at = now

    def _due(self, now: float, read: tuple[int, frozenset[int]]) -> list[Rule | _Pace]:
        """The paced rules due now, and the job's step-time thresholds (``_PACE``, a pass
        over every rank too) when ``SLOW_S`` old, the longest waiting first: at 131,072
        ranks the thresholds took one tick a second with a paced rule on it, 270 ms."""
        due: list[tuple[float, Rule | _Pace]] = []
        if _stale(now, self._paced_at):
            due.append((self._paced_at, _PACE))
        for rule in PACED_RULES:
            name = rule.__name__
            last = self._ran.get(name, -math.inf)
            if self._read.get(name) != read if rule.every == "change" else _stale(now, last):
                due.append((last, rule))
        return [job for _, job in sorted(due, key=lambda item: item[0])]


class _Pace:
    """The job's step-time thresholds, among the paced rules' runs (``Diagnosis._due``)."""


_PACE = _Pace()


def _stale(now: float, last: float) -> bool:
    """``SLOW_S`` or more since ``last``, or a clock set back before it."""
    return not 0.0 <= now - last < SLOW_S


TICK_RULES = tuple(r for r in RULES if r.every == "tick")
PACED_RULES = tuple(r for r in RULES if r.every == "change") + tuple(
    r for r in RULES if r.every == "slow"
)


def _run(rules: tuple[Rule, ...], facts: Facts) -> list[Alert]:
    """The alerts of ``rules``, sharing ``facts``; a rule that raises loses its own."""
    found: list[Alert] = []
    state, now, th = facts.state, facts.clock, facts.th
    for rule in rules:
        try:
            found.extend(rule(state, now, th, facts))
        except Exception:
            name = getattr(rule, "__name__", repr(rule))
            if not RULE_FAILURES[name]:
                log.exception("diagnosis rule %s failed; its alerts are skipped", name)
            RULE_FAILURES[name] += 1
    return found


def _unique(found: list[Alert]) -> list[Alert]:
    """One alert per (kind, culprits), most severe first."""
    seen: set[tuple[str, tuple[int, ...]]] = set()
    unique = []
    for alert in sorted(found, key=_sort_key):
        if alert.key not in seen:
            seen.add(alert.key)
            unique.append(alert)
    return unique
