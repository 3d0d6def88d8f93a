"""Which of the agent's optional parts run in this rank: ``DDPWATCH_PROBES``, read once.

Each part costs the training job a little (``docs/performance.md``, section 1). Switching one
off is how ``benchmarks/agent_overhead.py`` measures what it costs, side by side with the
whole agent, and how a job sheds a part it does not want. The value is a comma-separated
list of part names, each prefixed ``-`` (off) or ``+`` (on, the default):
``DDPWATCH_PROBES=-split,-grads``. An unknown name is logged and ignored: a typo never stops
the agent. The older switches still hold: ``DDPWATCH_STEP_SPLIT=0`` is ``-split`` and
``DDPWATCH_GRAD_CHECK=0`` is ``-grads``.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Mapping
from dataclasses import dataclass

log = logging.getLogger("ddpwatch")

ENV = "DDPWATCH_PROBES"
PARTS: dict[str, str] = {
    "split": "where each step goes: gradient-ready hooks, the end of backward, time in "
    "DataLoader iterators (agent/split.py)",
    "grads": "the check of this rank's own gradients (agent/grads.py)",
    "batches": "batches drawn per DataLoader iterator, and the batch marks (agent/progress.py)",
    "hostmem": "host memory from /proc and the memory cgroup, every heartbeat (agent/hostmem.py)",
    "collectives": "the wrappers of torch.distributed's Python-level collectives "
    "(agent/collectives.py)",
    "box": "the black box: the last collective entered, and a fatal signal's stacks, kept in "
    "a file that outlives the rank (agent/blackbox.py)",
    "publisher": "the publisher thread (agent/publisher.py): off, the rank reports nothing; "
    "for measuring the others' cost",
}
"""Every part that can be switched off, and what it is."""
LEGACY = {"DDPWATCH_STEP_SPLIT": "split", "DDPWATCH_GRAD_CHECK": "grads"}
"""Older one-part switches: ``0`` turns their part off."""


@dataclass(frozen=True)
class Probes:
    """The parts switched off; every other part runs."""

    off: frozenset[str] = frozenset()

    def on(self, part: str) -> bool:
        """Whether ``part`` (a key of ``PARTS``) runs."""
        return part not in self.off


def parse(value: str) -> tuple[frozenset[str], list[str]]:
    """The parts a ``DDPWATCH_PROBES`` value switches off, and the names it does not know."""
    off: set[str] = set()
    unknown: list[str] = []
    for item in value.split(","):
        item = item.strip()
        if not item:
            continue
        name = item.lstrip("+-").strip().lower()
        if name not in PARTS:
            unknown.append(item)
        elif item.startswith("-"):
            off.add(name)
        else:
            off.discard(name)
    return frozenset(off), unknown


def from_env(environ: Mapping[str, str] | None = None) -> Probes:
    """The switches of this process's environment (read once per attach, never per step)."""
    env = os.environ if environ is None else environ
    off, unknown = parse(env.get(ENV, ""))
    if unknown:
        log.warning(
            "ddpwatch: %s: unknown part(s) %s ignored; the parts are %s",
            ENV,
            ", ".join(unknown),
            ", ".join(PARTS),
        )
    legacy = {part for name, part in LEGACY.items() if env.get(name, "1").strip() == "0"}
    return Probes(off | legacy)
