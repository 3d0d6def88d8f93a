"""Guards on the shared vocabulary and on the agent / integrations layering.

* Every phase the agent or an integration can set is known to the server (a startup phase
  ``startup_hang`` orders, or a phase past startup), and is named through
  ``ddpwatch.vocabulary.Phase``, never as a literal.
* Integrations depend on the agent one way: the agent imports no integration, and
  integrations use only the agent's small public surface.
* Every module of both packages imports on its own in a fresh interpreter (no import cycle
  held together by import order), without importing torch or any framework.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import ROOT

from ddpwatch.server.rules import STARTUP_PHASES
from ddpwatch.vocabulary import PHASES, RUN_PHASES, Phase

SRC = ROOT / "src" / "ddpwatch"
AGENT = sorted((SRC / "agent").glob("*.py"))
INTEGRATIONS = sorted((SRC / "integrations").glob("*.py"))

# calls whose string arguments are phase names
PHASE_SETTERS = {"set_phase", "auto_phase", "_enter_phase", "phase", "startup_phase", "_startup"}
PHASE_STACK = {"push", "pop"}  # PhaseStack (integrations only: lists and deques pop too)

# what integrations may import of the agent
AGENT_SURFACE = {
    "ddpwatch.agent.api",  # WatcherSurface
    "ddpwatch.agent.registry",  # register what they detect and how they attach
    "ddpwatch.agent.patches",  # Patches
    "ddpwatch.agent.auto",  # after_import
    "ddpwatch.agent.loss",  # find_loss
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(SRC.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _tree(path: Path) -> ast.Module:
    return ast.parse(path.read_text(), filename=str(path))


def _imports(path: Path) -> set[str]:
    """Every ``ddpwatch`` module ``path`` imports, at the top or inside a function."""
    found: set[str] = set()
    for node in ast.walk(_tree(path)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.add(node.module)
            found.update(f"{node.module}.{alias.name}" for alias in node.names)
    return {name for name in found if name.split(".")[0] == "ddpwatch"}


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
    assert literals == [], "name phases with ddpwatch.vocabulary.Phase"
    assert used - known == set()
    # the scan sees the agent's and each integration's phases
    assert {Phase.RENDEZVOUS, Phase.DATA, Phase.DEEPSPEED_INIT, Phase.EVALUATION} <= used
    assert {Phase.CONFIGURE_MODEL, Phase.VALIDATION, Phase.CHECKPOINT} <= used


def test_the_server_orders_the_startup_phases_of_the_vocabulary() -> None:
    from ddpwatch.server.rules import startup

    assert startup.STARTUP_PHASES is STARTUP_PHASES
    assert STARTUP_PHASES[0] == Phase.STARTED and STARTUP_PHASES[-1] == Phase.TRAIN
    assert all(isinstance(name, str) and name == name.lower() for name in PHASES)


def test_the_agent_imports_no_integration() -> None:
    for path in AGENT:
        imported = _imports(path)
        assert not any(name.startswith("ddpwatch.integrations") for name in imported), path


def test_integrations_use_only_the_agents_public_surface() -> None:
    for path in INTEGRATIONS:
        agent = {n for n in _imports(path) if n.startswith("ddpwatch.agent.") and n.count(".") == 2}
        assert agent <= AGENT_SURFACE, (path.name, agent - AGENT_SURFACE)


@pytest.mark.parametrize(
    "module",
    [_module_name(path) for path in AGENT + INTEGRATIONS]
    + ["ddpwatch.vocabulary", "ddpwatch.boot.sitecustomize"],
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


def test_the_vocabulary_imports_nothing_of_the_agent() -> None:
    code = (
        "import sys\n"
        "import ddpwatch.vocabulary, ddpwatch.server.rules\n"
        "assert not [n for n in sys.modules if n.startswith('ddpwatch.agent')]\n"
    )
    proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert proc.returncode == 0, proc.stderr[-2000:]
