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
        return self.replace(owner, name, lambda original: _wrapper(original, before, after, around))

    def replace(
        self, owner: Any, name: str, make: Callable[[Callable[..., Any]], Callable[..., Any]]
    ) -> bool:
        """Replace ``owner.name`` by ``make(original)``, a wrapper written for a hot path
        (it must call the original and swallow its own faults); undone by ``restore``."""
        original = getattr(owner, name, None)
        if original is None or not callable(original) or getattr(original, "__ddpwatch__", False):
            return False
        own = _own_attribute(owner, name)
        wrapper = functools.wraps(original)(make(original))
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


def _wrapper(
    original: Callable[..., Any],
    before: Callable[..., Any] | None,
    after: Callable[..., Any] | None,
    around: Callable[..., Any] | None,
) -> Callable[..., Any]:
    """``original`` with its callbacks, each fault swallowed. A lone ``before`` or ``after``
    gets a wrapper of its own: some run every step, and a ``contextlib.suppress`` costs three
    Python calls."""
    if before is not None and after is None and around is None:
        return _with_before(original, before)
    if after is not None and before is None and around is None:
        return _with_after(original, after)
    return _with_all(original, before, after, around)


def _with_all(
    original: Callable[..., Any],
    before: Callable[..., Any] | None,
    after: Callable[..., Any] | None,
    around: Callable[..., Any] | None,
) -> Callable[..., Any]:
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        if before is not None:
            try:
                before(*args, **kwargs)
            except Exception:
                pass
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
                try:
                    context.__exit__(None, None, None)
                except Exception:
                    pass
        if after is not None:
            try:
                after(result, *args, **kwargs)
            except Exception:
                pass
        return result

    return wrapper


def _with_before(original: Callable[..., Any], before: Callable[..., Any]) -> Callable[..., Any]:
    def call_before(*args: Any, **kwargs: Any) -> Any:
        try:
            before(*args, **kwargs)
        except Exception:
            pass
        return original(*args, **kwargs)

    return call_before


def _with_after(original: Callable[..., Any], after: Callable[..., Any]) -> Callable[..., Any]:
    def call_after(*args: Any, **kwargs: Any) -> Any:
        result = original(*args, **kwargs)
        try:
            after(result, *args, **kwargs)
        except Exception:
            pass
        return result

    return call_after
