"""Reversible wrappers around library functions and framework methods.

``set_device``, DDP construction, ``torch.save``, ``init_process_group`` (the watcher) and
framework methods (the integrations) all go through one ``Patches``. Each wrapper reports a
phase or an event around the original call; its own faults are swallowed, so the user's
call always behaves as without ddpwatch, and ``restore`` puts every original back.
"""

from __future__ import annotations

import contextlib
import functools
from collections.abc import Callable
from typing import Any


class Patches:
    """Wraps methods of framework objects (instances, classes or modules) and undoes it.

    ``before(*args, **kwargs)`` runs first, ``around(*args, **kwargs)`` returns a context
    manager held for the call (a phase), ``after(result, *args, **kwargs)`` runs on success.
    Faults in these callbacks are swallowed: the wrapped call behaves as without ddpwatch.
    """

    def __init__(self) -> None:
        self._installed: list[tuple[Any, str, Any, bool, Any]] = []

    def wrap(
        self,
        owner: Any,
        name: str,
        before: Callable[..., Any] | None = None,
        after: Callable[..., Any] | None = None,
        around: Callable[..., Any] | None = None,
    ) -> bool:
        original = getattr(owner, name, None)
        if original is None or not callable(original) or getattr(original, "__ddpwatch__", False):
            return False
        own = _own_attribute(owner, name)

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            if before is not None:
                with contextlib.suppress(Exception):
                    before(*args, **kwargs)
            context = None
            if around is not None:
                try:
                    context = around(*args, **kwargs)
                    context.__enter__()
                except Exception:
                    context = None
            try:
                result = original(*args, **kwargs)
            finally:
                if context is not None:
                    with contextlib.suppress(Exception):
                        context.__exit__(None, None, None)
            if after is not None:
                with contextlib.suppress(Exception):
                    after(result, *args, **kwargs)
            return result

        wrapper.__ddpwatch__ = True  # type: ignore[attr-defined]
        try:
            setattr(owner, name, wrapper)
        except (AttributeError, TypeError):
            return False
        self._installed.append((owner, name, own, own is not None, wrapper))
        return True

    def restore(self) -> None:
        for owner, name, own, had_own, wrapper in reversed(self._installed):
            with contextlib.suppress(Exception):
                if getattr(owner, name, None) is not wrapper:
                    continue  # replaced again by someone else: leave theirs
                if had_own:
                    setattr(owner, name, own)
                else:
                    delattr(owner, name)  # the class's method shows through again
        self._installed.clear()


def _own_attribute(owner: Any, name: str) -> Any:
    """``owner``'s own (not inherited) attribute ``name``, or None."""
    try:
        return vars(owner).get(name)
    except TypeError:
        return None
