"""Guards on the shared vocabulary (``core/vocabulary.py``): the names that are a contract.

* Every phase the agent or an integration can set is known to the server (a startup phase
  ``startup_hang`` orders, or a phase past startup), and is named through
  ``ddpwatch.core.vocabulary.Phase``, never as a literal.
* Rank states, severities, event kinds and alert kinds are defined once, in the vocabulary:
  they match the documented contract, the agent and the rules name them through the
  vocabulary, and every table keyed by one of them covers all of them.

Which part may import which is ``tests/test_architecture.py``'s.
"""

from __future__ import annotations

import ast
import json
import re
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import pytest
from conftest import ROOT, SRC

from ddpwatch.core.vocabulary import (
    ALERT_KINDS,
    EVENT_KINDS,
    PHASES,
    RANK_STATES,
    RUN_PHASES,
    SEVERITIES,
    STARTUP_PHASES,
    AlertKind,
    CollectiveSource,
    EventKind,
    HistoryEvent,
    JobStop,
    Phase,
    RankState,
    Severity,
    Word,
)

AGENT = sorted((SRC / "agent").glob("*.py"))
INTEGRATIONS = sorted((SRC / "integrations").glob("*.py"))
FACTS = sorted((SRC / "diagnosis" / "facts").glob("*.py"))
FAMILIES = sorted(
    p for p in (SRC / "diagnosis" / "rules").glob("*.py") if p.stem not in ("__init__", "registry")
)

# calls whose string arguments are phase names
PHASE_SETTERS = {"set_phase", "auto_phase", "_enter_phase", "phase", "startup_phase", "_startup"}
PHASE_STACK = {"push", "pop"}  # PhaseStack (integrations only: lists and deques pop too)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _phases_set(path: Path) -> tuple[set[str], list[str]]:
    """(phases ``path`` names through ``Phase``, string literals given where a phase goes)."""
    names: set[str] = set()
    literals: list[str] = []
    setters = PHASE_SETTERS | (PHASE_STACK if path in INTEGRATIONS else set())
    for node in ast.walk(_tree(path)):
        if (
            isinstance(node, ast.Attribute)
            and isinstance(node.value, ast.Name)
            and node.value.id == "Phase"
        ):
            names.add(getattr(Phase, node.attr))
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called not in setters:
            continue
        for arg in node.args:
            for inner in ast.walk(arg):
                if isinstance(inner, ast.Constant) and isinstance(inner.value, str):
                    literals.append(f"{path.name}:{node.lineno}: {called}({inner.value!r})")
    return names, literals


def test_every_phase_the_agent_or_an_integration_sets_is_known_to_the_server() -> None:
    known = set(STARTUP_PHASES) | set(RUN_PHASES)
    assert set(STARTUP_PHASES).isdisjoint(RUN_PHASES)
    assert known == PHASES
    used: set[str] = set()
    literals: list[str] = []
    for path in AGENT + INTEGRATIONS:
        names, found = _phases_set(path)
        used |= names
        literals += found
    assert literals == [], "name phases with ddpwatch.core.vocabulary.Phase"
    assert used - known == set()
    # the scan sees the agent's and each integration's phases
    assert {Phase.RENDEZVOUS, Phase.DATA, Phase.DEEPSPEED_INIT, Phase.EVALUATION} <= used
    assert {Phase.CONFIGURE_MODEL, Phase.VALIDATION, Phase.CHECKPOINT} <= used


def test_the_server_orders_the_startup_phases_of_the_vocabulary() -> None:
    from ddpwatch.diagnosis.rules import startup

    assert startup.STARTUP_PHASES is STARTUP_PHASES
    assert STARTUP_PHASES[:2] == (Phase.STARTING, Phase.STARTED) and STARTUP_PHASES[-1] == Phase.TRAIN
    assert all(isinstance(name, str) and name == name.lower() for name in PHASES)


# ----------------------------------------------------------------------------- contract names

DOCS = ROOT / "docs"


def _doc_table_keys(path: Path, heading: str) -> list[str]:
    """The first column's backticked names of the table under ``heading`` in ``path``."""
    text = path.read_text()
    section = text[text.index(heading) :]
    section = section[: section.find("\n#", 1) if "\n#" in section[1:] else len(section)]
    return re.findall(r"^\| `([a-z_]+)` \|", section, re.M)


def _doc_field_row(path: Path, field: str) -> list[str]:
    """The backticked names in the row of ``field`` in a table of ``path``."""
    row = next(line for line in path.read_text().splitlines() if line.startswith(f"| `{field}` |"))
    return re.findall(r"`([a-z_]+)`", row)[1:]


@pytest.mark.parametrize(
    "cls",
    [Phase, RankState, Severity, EventKind, AlertKind, HistoryEvent, CollectiveSource, JobStop],
)
def test_each_name_is_its_plain_string(cls: type[Word]) -> None:
    """A member is its string wherever it goes: compared, hashed, printed, formatted, quoted,
    and encoded on the wire (msgpack) and in the status JSON (msgspec, json), byte for byte."""
    for member in cls:
        value = member.value
        assert type(value) is str and re.fullmatch(r"[a-z_]+", value), member
        assert member == value and hash(member) == hash(value) and {value: 1}[member] == 1
        written = [str(member), f"{member}", f"{member:>20}", " ".join([member]), repr(member)]
        assert written == [value, value, f"{value:>20}", value, repr(value)]
        assert json.dumps({member: [member]}) == json.dumps({value: [value]})
        assert msgspec.json.encode({member: [member]}) == msgspec.json.encode({value: [value]})
        assert msgspec.msgpack.encode(member) == msgspec.msgpack.encode(value)


def test_the_vocabulary_matches_the_documented_contract() -> None:
    """The wire and status strings are a contract (docs/status.md, docs/protocol.md): the
    vocabulary spells each exactly as documented, in the documented order."""
    status, protocol = DOCS / "status.md", DOCS / "protocol.md"
    assert _doc_table_keys(status, "## Alert kinds") == list(ALERT_KINDS)
    assert _doc_table_keys(protocol, "## `event`")[1:] == list(EVENT_KINDS)  # after the header
    assert _doc_field_row(status, "severity") == list(SEVERITIES)
    documented = _doc_field_row(status, "state")
    assert set(RANK_STATES) <= set(documented)
    assert set(documented) - set(RANK_STATES) <= {"exit_code"}  # "`exit_code` says how"
    history = [name for name in _doc_field_row(status, "event") if name in set(HistoryEvent)]
    assert history == list(HistoryEvent)
    source = next(line for line in protocol.read_text().splitlines() if "`collective.source`" in line)
    assert re.findall(r"`(fr|py)`", source) == list(CollectiveSource)
    assert _doc_field_row(status, "stopped_by") == list(JobStop)
    # byte-identical on the wire: what older agents send and older servers read
    assert EVENT_KINDS == ("phase", "crash", "exit", "stack", "checkpoint", "log")


def test_the_server_gives_every_rank_state_of_the_vocabulary() -> None:
    from ddpwatch.core.protocol import Collective, ErrorInfo
    from ddpwatch.diagnosis.alerts import Thresholds
    from ddpwatch.diagnosis.facts.ranks import rank_state
    from ddpwatch.server.document import status_document
    from ddpwatch.state.records import RankRecord
    from ddpwatch.state.state import ServerState

    assert RANK_STATES[0] == RankState.CRASHED and RANK_STATES[-1] == RankState.EXITED
    th = Thresholds()
    seen = set()
    for changes in [
        {},
        {"collective": Collective(op="all_reduce")},
        {"step": 1, "last_progress": -100.0},
        {"step": 1, "last_progress": -100.0, "stack_moved_at": 0.5},
        {"last_seen": -100.0},
        {"error": ErrorInfo(type="RuntimeError")},
        {"exit_time": 1.0, "exit_signal": "SIGTERM"},
        {"exit_time": 1.0, "exit_code": 0},
    ]:
        record = RankRecord(**{"rank": 0, "first_seen": 0.0, "last_seen": 0.0, **changes})
        seen.add(rank_state(record, 1.0, th, 10.0))
    state = ServerState(started=0.0)
    state.ranks[0] = RankRecord(rank=0, first_seen=0.0, last_seen=0.0, world_size=2)
    document = status_document(state, [], 1.0, th)
    seen.update(rank.state for rank in document.ranks)
    assert seen == set(RANK_STATES)


def test_every_table_keyed_by_rank_state_covers_every_state() -> None:
    from ddpwatch.outputs import prometheus
    from ddpwatch.status import order
    from ddpwatch.tui.data import model
    from ddpwatch.tui.screens import help
    from ddpwatch.tui.widgets import detail

    tables: dict[str, Any] = {
        "order.STATE_ORDER": order.STATE_ORDER,
        "model.SHORT_STATE": model.SHORT_STATE,
        "model.STATE_WORST": model.STATE_WORST,
        "detail.STATE_STYLE": detail.STATE_STYLE,
        "help.STATES": [state for state, _, _ in help.STATES],
        "prometheus.STATES": prometheus.STATES,
    }
    for name, table in tables.items():
        assert len(table) == len(set(table)), name
        assert set(table) == set(RANK_STATES), name
    assert list(order.STATE_ORDER) == list(RANK_STATES)  # worst first
    worst = [model.STATE_WORST[state] for state in RANK_STATES]
    assert worst == sorted(worst)  # the culprit-and-state scale orders states the same way
    assert set(model.STATE_TEXT) <= set(RANK_STATES)


def test_the_help_names_the_states_worst_first() -> None:
    from ddpwatch.tui.data.model import state_text
    from ddpwatch.tui.screens import help

    words = re.findall(r"[a-z_]+", help.WORST_FIRST)
    named = [w for w in words if w in {state_text(s) for s in RANK_STATES}]
    assert named == [state_text(s) for s in RANK_STATES]


def test_every_table_keyed_by_severity_covers_every_severity() -> None:
    from ddpwatch.outputs import notify
    from ddpwatch.status import order
    from ddpwatch.tui.data import model
    from ddpwatch.tui.widgets import header

    for name, table in {
        "model.CULPRIT_SCORE": model.CULPRIT_SCORE,
        "header.SEVERITY_STYLE": header.SEVERITY_STYLE,
        "header.SEVERITY_GLYPH": header.SEVERITY_GLYPH,
        "order.SEVERITY_LEVEL": order.SEVERITY_LEVEL,
        "notify.LEVELS": notify.LEVELS,
    }.items():
        assert set(table) == set(SEVERITIES), name
    # one order everywhere: most severe first, or least severe first where it counts up
    assert sorted(SEVERITIES, key=model.CULPRIT_SCORE.__getitem__) == list(SEVERITIES)
    assert sorted(SEVERITIES, key=order.SEVERITY_LEVEL.__getitem__) == list(SEVERITIES)[::-1]
    assert list(notify.LEVELS) == list(SEVERITIES)[::-1]


def _literal_args(path: Path, calls: dict[str, int | None]) -> Iterator[str]:
    """``file:line: call(...)`` for each string literal given to one of ``calls`` as one of its
    first N positional arguments (N: ``calls[name]``, None for all) or as ``event=``/``kind=``."""
    for node in ast.walk(_tree(path)):
        if not isinstance(node, ast.Call):
            continue
        func = node.func
        called = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", None)
        if called not in calls:
            continue
        args = node.args[: calls[called]]
        args += [k.value for k in node.keywords if k.arg in ("event", "kind", "severity")]
        for arg in args:
            if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
                yield f"{path.name}:{node.lineno}: {called}({arg.value!r})"


def _vocabulary_names(path: Path, cls: type) -> set[str]:
    """The values ``path`` names as ``cls.NAME``."""
    return {
        getattr(cls, node.attr)
        for node in ast.walk(_tree(path))
        if isinstance(node, ast.Attribute)
        and isinstance(node.value, ast.Name)
        and node.value.id == cls.__name__
    }


def test_rules_name_their_kinds_and_severities_through_the_vocabulary() -> None:
    from ddpwatch.diagnosis.rules import RULES

    rules = sorted((SRC / "diagnosis" / "rules").glob("*.py"))
    literals = [hit for path in rules for hit in _literal_args(path, {"rule": None, "alert": 2})]
    assert literals == [], "name alert kinds and severities with AlertKind and Severity"
    declared = {kind for rule in RULES for kind in rule.kinds}
    assert declared == set(ALERT_KINDS)  # every kind has a rule that may raise it
    raised = set().union(*(_vocabulary_names(path, AlertKind) for path in rules))
    assert raised == set(ALERT_KINDS)


def test_the_agent_sends_only_event_kinds_of_the_vocabulary() -> None:
    senders = [*AGENT, SRC / "demo" / "simulate.py"]
    literals = [hit for path in senders for hit in _literal_args(path, {"_event": 1, "Event": 0})]
    assert literals == [], "name event kinds with ddpwatch.core.vocabulary.EventKind"
    sent = set().union(*(_vocabulary_names(path, EventKind) for path in AGENT))
    assert sent == set(EVENT_KINDS)  # the agent sends every kind the protocol documents
    read = _vocabulary_names(SRC / "state" / "state.py", EventKind)
    assert read and read <= set(EVENT_KINDS)
    # the server compares kinds only with the vocabulary's names
    compared = [
        node.lineno
        for node in ast.walk(_tree(SRC / "state" / "state.py"))
        if isinstance(node, ast.Compare)
        and isinstance(node.left, ast.Name)
        and node.left.id == "kind"
        and any(isinstance(c, ast.Constant) for c in node.comparators)
    ]
    assert compared == []
