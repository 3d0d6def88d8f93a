"""The import contract: which part of the package may import which (docs/architecture.md).

* Every import between ``ddpwatch`` modules, at the top of a module, inside a function or
  under ``TYPE_CHECKING``, follows ``MAY_IMPORT``; a forbidden arrow fails naming the file,
  the line and the import. Every module belongs to a part, so a new package needs a place.
* Integrations use only the agent's small public surface (``AGENT_SURFACE``).
* Every module of the agent and the integrations imports on its own in a fresh interpreter (no
  import cycle held together by import order), without importing torch or any framework.
* The rank lists the views and the rules print come from one algorithm (``core.ranges``).
"""

from __future__ import annotations

import ast
import itertools
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ROOT, SRC

AGENT = sorted((SRC / "agent").glob("*.py"))
INTEGRATIONS = sorted((SRC / "integrations").glob("*.py"))
FACTS = sorted((SRC / "diagnosis" / "facts").glob("*.py"))
FAMILIES = sorted(
    p for p in (SRC / "diagnosis" / "rules").glob("*.py") if p.stem not in ("__init__", "registry")
)

# ----------------------------------------------------------------------------- the map

ANYTHING = "*"
"""An entry of ``MAY_IMPORT``: any module of the package (less the part's ``NEVER``)."""

PARTS = {
    "ddpwatch": "the package root: ``attach``/``step``/``phase``, the API a rank calls, and "
    "``__version__``",
    "core": "the shared kernel: protocol, vocabulary, devices, ranges, ports, security",
    "agent": "what runs inside every rank",
    "integrations": "Lightning, DeepSpeed, Hugging Face: framework hooks over the agent",
    "boot": "the ``sitecustomize`` through which ``ddpwatch run`` attaches to every rank",
    "relay": "the per-node relay between ranks and the server",
    "relay_pacer": "the relay's side of the server's pace: ask for it, never wait",
    "state": "what the server knows of the job: rank records, the state and its indexes",
    "server": "the collector, ingest, recording, the engine and the status document",
    "diagnosis": "pure rules from the server's state to alerts, their history and verdicts",
    "outputs": "what only reads a status document or a recording: summary, notify, "
    "Prometheus, reports",
    "status": "the status contract and the client that fetches it",
    "tui": "the dashboard",
    "doctor": "``ddpwatch doctor``'s set-up checks",
    "jobs": "running a job under ddpwatch: launch, its output, why it failed, stopping it",
    "demo": "``ddpwatch demo``: a simulated job and its script of faults",
    "commands": "one module per command: where the parts are put together",
    "cli": "the command line's parser and dispatch",
    "__main__": "``python -m ddpwatch``",
}
"""Each part of the package (a top-level module or package, relative to ``ddpwatch``)."""

MAY_IMPORT: dict[str, dict[str, str]] = {
    # A key is a part, or one module of a part for an arrow only that module may have (its
    # part's arrows apply too). A value maps a module or package (relative to ``ddpwatch``; a
    # package covers its modules) to why the arrow is there. A part may import itself.
    "ddpwatch": {
        "agent": "attach() starts the agent's Watcher",
        "integrations": "attach() registers the frameworks' hooks",
    },
    "core": {},  # imports nothing else: every part may import it
    "agent": {
        "core": "the protocol it sends and the vocabulary it names",
        "relay": "find_relay: a rank sends to its node's relay when one listens",
    },
    "integrations": {
        "core": "the vocabulary's phases",
        "ddpwatch": "the public API a rank calls",
        "agent": "only the agent's public surface (AGENT_SURFACE, checked below)",
    },
    "boot": {
        "ddpwatch": "attach()",
        "agent.auto": "the auto-attach a launcher's ranks boot with",
        "integrations": "each framework registers the hooks it boots",
    },
    "relay": {
        "core": "the protocol it batches, the ports and keys it binds",
        "relay_pacer": "the pace it sends its batches at",
    },
    "relay_pacer": {"core": "the pace request and reply, the server's ports and keys"},
    "state": {
        "core": "the protocol's records it keeps",
        "status": "the contract's JobEnd and RelayEntry it holds, sizes in its wording",
    },
    "server": {
        "core": "the protocol it reads and the vocabulary of the document",
        "ddpwatch": "__version__ in the hello reply",
        "state": "the job it takes every frame into",
        "diagnosis": "the server runs the rules on its state every tick",
        "status": "the status contract the document is encoded into",
    },
    "diagnosis": {
        "core": "the vocabulary of alerts and the protocol's records",
        "state": "the job the rules judge: its rank records and indexes",
        "status": "the contract alerts and history entries are written in: schema, order, fmt",
    },
    "outputs": {
        "core": "the vocabulary of states and severities",
        "ddpwatch": "__version__ in a webhook's User-Agent",
        "status": "the status contract: what every output reads",
        "server.recording": "the recording reader, for the report",
    },
    "status": {"core": "the protocol's ports and keys, rank ranges"},
    "tui": {
        "core": "the vocabulary, rank ranges and keys",
        "status": "the status contract and the client that fetches it",
        "outputs.summary": "the verdict a finished job's story tells",
    },
    "doctor": {
        "core": "ports, keys, the protocol, the vocabulary",
        "agent": "what a rank would see: its identity, NVML, the watcher's defaults",
        "status": "the client, to ask a server what it sees",
    },
    "jobs": {ANYTHING: "a job under ddpwatch runs a server, the dashboard, a relay"},
    "demo": {ANYTHING: "the demo runs a whole job: server, dashboard, summary"},
    "commands": {ANYTHING: "a command puts the parts together"},
    "cli": {ANYTHING: "the entry point: parses, then calls a command"},
    "__main__": {"cli": "main()"},
}
"""What each part may import: the map of docs/architecture.md, arrow by arrow."""

NEVER: dict[str, dict[str, str]] = {
    "diagnosis": {"status.client": "diagnosis judges the state it is given; it fetches nothing"},
    "jobs": {"commands": "commands use jobs, never the other way", "cli": "the entry point"},
    "demo": {"commands": "commands use the demo, never the other way", "cli": "the entry point"},
}
"""What a part must not import even where a wider arrow (a package, ``ANYTHING``) allows it."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {_module_name(path): path for path in sorted(SRC.rglob("*.py"))}


def _relative(module: str) -> str:
    """``ddpwatch.state.state`` -> ``state.state``; the root package stays ``ddpwatch``."""
    return module.removeprefix("ddpwatch.") if module != "ddpwatch" else module


def _covers(entry: str, relative: str) -> bool:
    return relative == entry or relative.startswith(entry + ".")


def _part(relative: str) -> str | None:
    return next((part for part in PARTS if _covers(part, relative)), None)


def _arrows(path: Path) -> Iterator[tuple[int, str]]:
    """(line, module) for each ``ddpwatch`` module ``path`` imports, anywhere in it: ``from a
    import b`` names ``a.b`` where that is a module, else ``a``."""
    module = _module_name(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:  # relative: from the module's package, one level up per dot
                anchor = package.split(".")[: len(package.split(".")) - node.level + 1]
                base = ".".join([*anchor, *([base] if base else [])])
            names = [
                f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base
                for alias in node.names
            ]
        else:
            continue
        for name in names:
            if name.split(".")[0] == "ddpwatch":
                yield node.lineno, name


def _rules_for(relative: str) -> tuple[dict[str, str], dict[str, str]]:
    """(may import, never) for a module: its part's entries and its own."""
    allowed: dict[str, str] = {}
    never: dict[str, str] = {}
    for key in MAY_IMPORT:
        if _covers(key, relative):
            allowed.update(MAY_IMPORT[key])
            never.update(NEVER.get(key, {}))
    return allowed, never


def _forbidden(importer: str, imported: str) -> str | None:
    """Why ``importer`` may not import ``imported`` (both relative), or None if it may."""
    part = _part(importer)
    assert part is not None
    if _covers(part, imported):
        return None
    allowed, never = _rules_for(importer)
    for entry, why in never.items():
        if _covers(entry, imported):
            return f"{part}/ must never import {entry} ({why})"
    if ANYTHING in allowed or any(_covers(entry, imported) for entry in allowed):
        return None
    may = ", ".join([part, *sorted(entry for entry in allowed)])
    return f"{part}/ may import only {may}"


def test_every_module_belongs_to_a_part_of_the_map() -> None:
    assert set(MAY_IMPORT) >= set(PARTS)
    for key in MAY_IMPORT:
        assert _part(key) is not None, f"{key}: not in a part of PARTS"
    homeless = [name for name in MODULES if _part(_relative(name)) is None]
    assert homeless == [], "give each new part a line in PARTS and MAY_IMPORT"


def test_every_import_follows_the_map() -> None:
    broken = []
    for name, path in MODULES.items():
        importer = _relative(name)
        for line, target in _arrows(path):
            why = _forbidden(importer, _relative(target))
            if why is not None:
                where = path.relative_to(ROOT)
                broken.append(f"{where}:{line}: {name} imports {target}: {why}")
    assert broken == [], "imports the map forbids (tests/test_architecture.py):\n" + "\n".join(
        broken
    )


def test_every_arrow_named_for_one_module_is_still_there() -> None:
    """An arrow the map allows one module only (an exception to its part) goes from the map
    as soon as the module stops needing it."""
    used = {
        (_relative(name), _relative(target))
        for name, path in MODULES.items()
        for _, target in _arrows(path)
    }
    stale = [
        f"{key} -> {entry}"
        for key, entries in MAY_IMPORT.items()
        if key not in PARTS
        for entry in entries
        if not any(_covers(key, a) and _covers(entry, b) for a, b in used)
    ]
    assert stale == [], "remove these arrows from MAY_IMPORT: nothing uses them"


def _part_arrows() -> dict[str, dict[str, str]]:
    """Part -> each other part it imports -> one import that shows it (file:line: target)."""
    arrows: dict[str, dict[str, str]] = {}
    for name, path in MODULES.items():
        importer = _part(_relative(name))
        assert importer is not None
        for line, target in _arrows(path):
            imported = _part(_relative(target))
            if imported is not None and imported != importer:
                witness = f"{path.relative_to(ROOT)}:{line}: {target}"
                arrows.setdefault(importer, {}).setdefault(imported, witness)
    return arrows


def _cycle(arrows: dict[str, dict[str, str]]) -> list[str] | None:
    """A cycle of parts (its first part repeated at its end), or None: a depth-first search."""
    done: set[str] = set()

    def visit(part: str, path: list[str]) -> list[str] | None:
        if part in path:
            return [*path[path.index(part) :], part]
        if part in done:
            return None
        for imported in sorted(arrows.get(part, {})):
            found = visit(imported, [*path, part])
            if found is not None:
                return found
        done.add(part)
        return None

    for part in sorted(arrows):
        found = visit(part, [])
        if found is not None:
            return found
    return None


def test_no_arrow_between_parts_points_back_up() -> None:
    """The parts form layers: no part reaches itself through others, directly or not (a
    chain of allowed arrows can still climb: the dashboard reaching the server's records
    through the summary, the verdict and the wording would be one)."""
    arrows = _part_arrows()
    cycle = _cycle(arrows)
    if cycle is not None:
        steps = [f"{a} -> {b}: {arrows[a][b]}" for a, b in itertools.pairwise(cycle)]
        raise AssertionError("parts that import each other, round:\n" + "\n".join(steps))


def _reached(start: str) -> set[str]:
    """Every module importing ``start`` runs, directly or not (each package's ``__init__``
    on the way included): ``ddpwatch.x.y`` names."""
    seen: set[str] = set()
    todo = [start]
    while todo:
        name = todo.pop()
        if name in seen or name not in MODULES:
            continue
        seen.add(name)
        for _, target in _arrows(MODULES[name]):
            parts = target.split(".")
            todo += [".".join(parts[:i]) for i in range(1, len(parts) + 1)]
    return seen


def test_no_output_reaches_the_diagnosis_even_indirectly() -> None:
    """Outputs word the verdict the server judged (the document's ``verdict``): none runs a
    line of the diagnosis, through however many imports (#36)."""
    reaching = {
        name: sorted(m for m in _reached(name) if _part(_relative(m)) == "diagnosis")
        for name in MODULES
        if _part(_relative(name)) == "outputs"
    }
    assert {name: found for name, found in reaching.items() if found} == {}


def test_the_cycle_search_finds_an_indirect_climb() -> None:
    arrows = {"tui": {"outputs": "w"}, "outputs": {"diagnosis": "w"}, "diagnosis": {"tui": "w"}}
    assert _cycle(arrows) == ["diagnosis", "tui", "outputs", "diagnosis"]
    assert _cycle({"server": {"diagnosis": "w"}, "diagnosis": {"state": "w"}}) is None


@pytest.mark.parametrize(
    ("importer", "imported", "allowed"),
    [
        ("agent.publisher", "relay", True),
        ("agent.watcher", "integrations.lightning", False),
        ("agent.watcher", "state.state", False),
        ("core.ranges", "diagnosis.text", False),
        ("diagnosis.facts.census", "state.state", True),
        ("diagnosis.facts.census", "server.engine", False),
        ("state.records", "diagnosis.facts", False),
        ("diagnosis.facts.census", "server.collector", False),
        ("diagnosis.rules", "status.order", True),
        ("diagnosis.verdict", "outputs.summary", False),
        ("diagnosis.rules", "status.client", False),
        ("outputs.summary", "diagnosis.verdict", False),
        ("outputs.summary", "diagnosis.rules", False),
        ("outputs.report", "state.state", False),
        ("outputs.notify", "diagnosis.alerts", False),
        ("outputs.postmortem", "server.replay", False),
        ("outputs.postmortem", "server.recording", True),
        ("outputs.report", "diagnosis.history", False),
        ("tui.widgets.alerts_panel", "diagnosis.text", False),
        ("tui.screens.dashboard", "status.fmt", True),
        ("tui.data.story", "outputs.summary", True),
        ("tui.app", "server.service", False),
        ("jobs.launch", "tui.app", True),
        ("jobs.launch", "commands.run", False),
        ("demo.runner", "cli", False),
        ("commands.run", "jobs.launch", True),
    ],
)
def test_the_map_reads_as_docs_architecture_says(
    importer: str, imported: str, allowed: bool
) -> None:
    assert (_forbidden(importer, imported) is None) == allowed


# ----------------------------------------------------------------------------- agent, integrations

AGENT_SURFACE = {
    "ddpwatch.agent.api",  # WatcherSurface
    "ddpwatch.agent.registry",  # register what they detect and how they attach
    "ddpwatch.agent.patches",  # Patches
    "ddpwatch.agent.auto",  # after_import
    "ddpwatch.agent.loss",  # find_loss
    "ddpwatch.agent.session",  # the process's watcher: attach() and current() from a hook
}
"""What integrations may import of the agent."""


def test_integrations_use_only_the_agents_public_surface() -> None:
    for path in INTEGRATIONS:
        agent = {name for _, name in _arrows(path) if _covers("agent", _relative(name))}
        assert agent <= AGENT_SURFACE, (path.name, agent - AGENT_SURFACE)


@pytest.mark.parametrize(
    "module",
    [_module_name(path) for path in AGENT + INTEGRATIONS + FACTS]
    + ["ddpwatch.core.vocabulary", "ddpwatch.core.ranges", "ddpwatch.boot.sitecustomize"],
)
def test_each_module_imports_alone_without_a_framework(module: str) -> None:
    code = (
        "import sys\n"
        f"import {module}\n"
        "heavy = ('torch', 'lightning', 'pytorch_lightning', 'deepspeed', 'transformers',"
        " 'accelerate')\n"
        "loaded = sorted(n for n in sys.modules if n.split('.')[0] in heavy)\n"
        "assert not loaded, loaded\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


def test_the_facts_read_no_rule_and_no_rule_family_reads_another() -> None:
    """Diagnosis in layers: the models (``diagnosis/facts``) know no rule; a rule family reads
    the facts, the words and the registry, never another family."""
    for path in FACTS:
        imported = [name for _, name in _arrows(path)]
        assert not [n for n in imported if n.startswith("ddpwatch.diagnosis.rules")], path
    for path in FAMILIES:
        others = {_module_name(other) for other in FAMILIES if other != path}
        assert not {name for _, name in _arrows(path)} & others, path


def test_the_vocabulary_imports_nothing_of_the_agent() -> None:
    code = (
        "import sys\n"
        "import ddpwatch.core.vocabulary, ddpwatch.diagnosis.rules\n"
        "assert not [n for n in sys.modules if n.startswith('ddpwatch.agent')]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]


# ----------------------------------------------------------------------------- rank lists


def test_rank_lists_are_written_by_one_algorithm() -> None:
    from ddpwatch.core import ranges
    from ddpwatch.diagnosis.text import format_ranks

    # shared: the server and the views use it
    assert list(_arrows(SRC / "core" / "ranges.py")) == []
    assert format_ranks([0, 1, 2, 3, 7, 9, 10]) == "ranks 0-3, 7, 9, 10"
    assert ranges.rank_ranges([0, 1, 2, 3, 7, 9, 10]) == "0-3,7,9-10"  # the dashboard's
    assert format_ranks(range(0, 40, 2), limit=3) == "ranks 0, 2, 4 and 17 more"
    assert ranges.rank_ranges(range(0, 40, 2), limit=3) == "0,2,4 +17"
    with pytest.raises(ValueError):
        ranges.rank_ranges([1], min_run=1)
