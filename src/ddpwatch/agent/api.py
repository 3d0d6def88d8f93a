"""What integrations may use of a watcher: ``WatcherSurface``, and nothing else.

Integrations (``ddpwatch.integrations``) depend on the agent through this module, the
registry (``ddpwatch.agent.registry``), ``Patches`` and ``after_import``; the agent never
imports an integration. ``Watcher`` implements the surface; a test double may too.

Importing this module imports neither torch nor any framework.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from typing import TYPE_CHECKING, Any, Protocol, runtime_checkable

if TYPE_CHECKING:
    from ddpwatch.agent.patches import Patches


@runtime_checkable
class WatcherSurface(Protocol):
    """The watcher of this process, as an integration sees it.

    Every method returns quickly on the training thread and never raises into it.
    """

    active: bool
    """False once detached: a callback that holds a watcher looks for the current one."""

    patches: Patches
    """Wrappers of framework methods that ``detach`` undoes."""

    @property
    def in_startup(self) -> bool:
        """No step counted yet: startup phases still apply."""
        ...

    def set_phase(self, name: str) -> None:
        """Enter phase ``name`` (a ``ddpwatch.core.vocabulary.Phase``) until the next change."""
        ...

    def phase(self, name: str) -> AbstractContextManager[None]:
        """Hold phase ``name`` for a block; hooks' own phases do not replace it meanwhile."""
        ...

    def step(self, loss: Any = None) -> None:
        """End a step (counting it) with its loss, a tensor read later without a sync."""
        ...

    def submit_loss(self, loss: Any) -> None:
        """Hand over the loss of the step in progress without counting a step."""
        ...

    def note_forward(self) -> None:
        """Count an evaluation batch as progress (no step): the rank is not stalled."""
        ...

    def count_steps_explicitly(self) -> None:
        """From now on steps come from ``step()`` alone: the optimizer and forward hooks
        stop counting (what a first explicit ``ddpwatch.step()`` does, set before it)."""
        ...

    def claim_steps(self, owner: Any) -> bool:
        """Whether ``owner`` counts the steps: the first to ask does, until it is gone or
        calls ``release_steps``; the others only hand over losses."""
        ...

    def release_steps(self, owner: Any) -> None:
        """``owner`` no longer counts the steps (if it did)."""
        ...

    def checkpoint(self, path: str) -> None:
        """Report that this rank writes a checkpoint to ``path``."""
        ...

    def add_model(self, model: Any) -> None:
        """Watch a module, or a framework object an integration knows (see the registry)."""
        ...
