"""Reversible wrappers around library functions (set_device, DDP construction, torch.save, ...).

Each wrapper reports a phase or an event and then calls the original; its own
faults are swallowed so the user's call always behaves as without ddpwatch.
"""

from __future__ import annotations

import contextlib
import functools
import logging
from collections.abc import Callable
from typing import Any

log = logging.getLogger("ddpwatch")

Before = Callable[..., None]
After = Callable[..., None]


class Patches:
    """Installs ``owner.name = wrapper(original)`` and puts every original back on ``restore``."""

    def __init__(self) -> None:
        self._installed: list[tuple[Any, str, Any, Any]] = []

    def wrap(
        self, owner: Any, name: str, before: Before | None = None, after: After | None = None
    ) -> None:
        """Run ``before(*args, **kwargs)`` and ``after(result, *args, **kwargs)`` around it."""
        original = getattr(owner, name, None)
        if original is None or getattr(original, "__ddpwatch__", False):
            return

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                with contextlib.suppress(Exception):
                    before(*args, **kwargs)
            result = original(*args, **kwargs)
            if after is not None:
                with contextlib.suppress(Exception):
                    after(result, *args, **kwargs)
            return result

        wrapper.__ddpwatch__ = True  # type: ignore[attr-defined]
        setattr(owner, name, wrapper)
        self._installed.append((owner, name, original, wrapper))

    def restore(self) -> None:
        for owner, name, original, wrapper in reversed(self._installed):
            if getattr(owner, name, None) is wrapper:
                setattr(owner, name, original)
        self._installed.clear()
