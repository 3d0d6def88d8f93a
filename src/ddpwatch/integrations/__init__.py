"""Framework integrations, imported lazily: ddpwatch never requires Lightning, DeepSpeed or HF."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ddpwatch.agent.watcher import Watcher


def adapt(watcher: Watcher, obj: Any) -> bool:
    """Hook ``obj`` if it is a framework object an integration handles; False for plain modules."""
    return False
