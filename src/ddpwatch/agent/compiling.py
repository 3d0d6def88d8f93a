"""Phase ``compiling`` while ``torch.compile`` works on this rank (issue #32).

A cold compile (dynamo, AOT autograd, inductor, a C++ or Triton build) takes seconds to
minutes in which the rank makes no step and enters no collective: without a phase of its
own it looks stalled. torch's own compile callbacks (``torch._dynamo.callback``) run at
the start and the end of every compilation, the deferred backward's included: the phase
follows them, and nothing runs on the training thread between compilations.

torch < 2.4 or a torch whose callbacks moved: ``in_compile_stack`` tells the same from the
main thread's stack, which the publisher thread reads (a frame of dynamo's
``convert_frame.py`` is on it only while a frame is compiled, never while compiled code
runs; checked on torch 2.13 with aot_eager and inductor).
"""

from __future__ import annotations

import contextlib
import logging
import re
import sys
from collections.abc import Callable
from types import FrameType, ModuleType
from typing import Any, Final

from ddpwatch.agent.auto import after_import
from ddpwatch.agent.patches import Patches
from ddpwatch.agent.progress import Progress
from ddpwatch.core.vocabulary import Phase

log = logging.getLogger("ddpwatch")

DYNAMO: Final = "torch._dynamo"  # its callback_handler (torch._dynamo.callback) and reset()
REASON_CHARS: Final = 240  # a guard failure names a tensor and two sizes: short
_COMPILING: Final = Phase.COMPILING
_COMPILE_ID: Final = re.compile(r"^\[?\d+/\d+\]?:\s*")  # "0/0: " before a guard failure
_CONVERT_FRAME: Final = ("torch/_dynamo/convert_frame.py", "torch\\_dynamo\\convert_frame.py")


class CompileWatch:
    """Sets the phase ``compiling`` for the length of each compilation and puts back the
    phase it interrupted; notes torch's reason for a recompilation (a guard that failed).

    ``enter_phase(name)``: the watcher's own phase setter, which also sends the phase event
    at once (a compile is rare; the server should not wait a heartbeat to know)."""

    def __init__(
        self, progress: Progress, enter_phase: Callable[[str], None], patches: Patches
    ) -> None:
        self._progress = progress
        self._enter_phase = enter_phase
        self._patches = patches  # the watcher's: undone when it detaches
        self._handler: Any = None
        self._before: str = Phase.STARTED
        self._active = False  # between our start and end callbacks
        self._removed = False  # detached: a later import of torch._dynamo registers nothing
        self._seen: dict[Any, int] = {}  # guard failures already read, per code object
        self.hooked = False
        """torch's compile callbacks are registered: the stack is not needed to tell."""

    def install(self) -> None:
        """Register once torch._dynamo is imported (``torch.compile`` imports it at its first
        call): a job that never compiles never imports it on our account."""
        after_import(DYNAMO, self._register)

    def remove(self) -> None:
        self._removed = True
        handler, self._handler = self._handler, None
        self.hooked = False
        if handler is None:
            return
        for remove, callback in (
            (handler.remove_start_callback, self._started),
            (handler.remove_end_callback, self._ended),
        ):
            with contextlib.suppress(Exception):  # ValueError: a reset cleared them
                remove(callback)

    def _register(self, dynamo: ModuleType) -> None:
        """Add the callbacks, and again after each ``torch._dynamo.reset()`` (which
        ``torch.compiler.reset()`` calls): it clears every callback."""
        if self._removed:
            return
        handler = getattr(dynamo, "callback_handler", None)
        try:
            self._add_callbacks(handler)
        except Exception as exc:
            log.debug("ddpwatch: no torch.compile callbacks (%r): phase from the stack", exc)
            return
        self._handler = handler
        self.hooked = True
        self._patches.wrap(dynamo, "reset", after=lambda *_: self._add_callbacks(self._handler))

    def _add_callbacks(self, handler: Any) -> None:
        if self._removed or handler is None:
            return
        if self._started not in getattr(handler, "start_callbacks", ()):
            handler.register_start_callback(self._started)
        if self._ended not in getattr(handler, "end_callbacks", ()):
            handler.register_end_callback(self._ended)

    # the compiling thread: torch runs these under its own lock, once per outermost compile
    def _started(self, args: Any = None) -> None:
        """torch < 2.7 calls its callbacks with no argument; later ones with ``CallbackArgs``
        (its ``callback_trigger``: ``DYNAMO`` a frame, ``LAZY_BACKWARD`` the backward)."""
        try:
            progress = self._progress
            if self._active:
                return
            trigger = getattr(getattr(args, "callback_trigger", None), "name", "DYNAMO")
            progress.compile_reason = self._recompile_reason() if trigger == "DYNAMO" else None
            self._before = progress.phase
            self._active = True
            progress.pinned += 1  # hooks run while dynamo traces: they must not move the phase
            self._enter_phase(_COMPILING)
        except Exception as exc:
            log.debug("ddpwatch: compile start: %r", exc)

    def _ended(self, args: Any = None) -> None:
        try:
            if not self._active:
                return
            self._active = False
            progress = self._progress
            progress.pinned = max(0, progress.pinned - 1)
            progress.compile_reason = None
            if progress.phase == _COMPILING:  # else something set a phase since: it stands
                self._enter_phase(self._before)
        except Exception as exc:
            log.debug("ddpwatch: compile end: %r", exc)

    def _recompile_reason(self) -> str | None:
        """Why dynamo compiles this frame again, as torch says: the guard failure it has just
        appended to ``torch._dynamo.utils.guard_failures`` (code object -> reasons) before
        starting the compilation; None on a frame's first compile."""
        utils = sys.modules.get("torch._dynamo.utils")
        failures = getattr(utils, "guard_failures", None)
        if not isinstance(failures, dict):
            return None
        newest = None
        seen = self._seen
        for code, reasons in list(failures.items()):
            count = len(reasons)
            before = seen.get(code, 0)
            if count < before:  # torch._dynamo.reset() emptied it
                before = 0
            if count > before:
                newest = reasons[before]  # the first new one: dynamo's own "reasons[0]"
            seen[code] = count
        return clean_reason(newest) if isinstance(newest, str) else None


def clean_reason(reason: str) -> str | None:
    """The first line of a guard failure, without the compile id torch puts first
    ("0/0: tensor 'x' size mismatch at index 0. expected 4, actual 8")."""
    line = _COMPILE_ID.sub("", reason.strip().split("\n", 1)[0]).strip()
    if not line:
        return None
    return line if len(line) <= REASON_CHARS else line[: REASON_CHARS - 1] + "…"


def in_compile_stack(frame: FrameType | None) -> bool:
    """Whether a thread whose innermost frame is ``frame`` is inside a compilation: a frame
    of dynamo's ``convert_frame.py`` is on the stack (AOT autograd and inductor run inside
    it). The fallback where torch's callbacks are not there. The module's own body is not a
    compilation: importing ``torch._dynamo`` runs it for seconds on a loaded machine (seen
    as 'compiling' flapping with 'model_wrap' 16 times while DDP's constructor imported it)."""
    while frame is not None:
        code = frame.f_code
        if code.co_filename.endswith(_CONVERT_FRAME) and code.co_name != "<module>":
            return True
        frame = frame.f_back
    return False
