"""Hooks into the training process: model, optimizer, exceptions, signals, exit.

Every hook that runs on the training thread is a few attribute writes wrapped
so that a fault inside ddpwatch can never reach the user's code. Everything
installed here is undone by ``remove``.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import signal
import sys
import threading
import traceback
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any

from ddpwatch.agent.progress import Progress
from ddpwatch.protocol import ErrorInfo

log = logging.getLogger("ddpwatch")

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGINT)


def find_loss(output: Any) -> Any:
    """The loss in a model's output: a scalar tensor, or a ``loss`` key or attribute."""
    if getattr(output, "ndim", None) == 0:
        return output
    if isinstance(output, dict):
        return output.get("loss")
    return getattr(output, "loss", None)


class ModelHooks:
    """Forward hooks on attached models and a global optimizer step hook."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._handles: list[Any] = []
        self._models: list[int] = []

    def add_model(self, model: Any) -> None:
        if id(model) in self._models or not hasattr(model, "register_forward_hook"):
            return
        self._models.append(id(model))
        self._handles.append(model.register_forward_pre_hook(self._before_forward))
        self._handles.append(model.register_forward_hook(self._after_forward))

    def add_optimizer_hook(self) -> None:
        try:
            from torch.optim.optimizer import (
                register_optimizer_step_post_hook,
                register_optimizer_step_pre_hook,
            )
        except ImportError:
            return
        self._handles.append(register_optimizer_step_pre_hook(self._before_optimizer))
        self._handles.append(register_optimizer_step_post_hook(self._after_optimizer))

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
        self._models.clear()

    def _before_forward(self, module: Any, args: Any) -> None:
        with contextlib.suppress(Exception):  # never let the agent break a forward pass
            self._progress.forward_started()

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        try:
            progress = self._progress
            progress.auto_phase("backward")
            loss = find_loss(output)
            if progress.step_mode in (None, "forward"):
                progress.end_step(loss, mode="forward")
            elif loss is not None:
                progress.loss.submit(loss)
        except Exception:
            pass

    def _before_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        self._progress.auto_phase("optimizer")

    def _after_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            progress = self._progress
            if progress.step_mode == "forward":
                progress.step_mode = None  # optimizer steps are the better count
                progress.step = None if progress.step is None else progress.step - 1
            progress.end_step(mode="optimizer")
            progress.auto_phase("data")
        except Exception:
            pass


def error_info(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> ErrorInfo:
    return ErrorInfo(
        type=exc_type.__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(exc_type, exc, tb)),
    )


class ProcessHooks:
    """Chained excepthooks, terminating-signal handlers and an atexit report.

    ``on_crash(error, thread_name)`` and ``on_exit(signal_name)`` are the
    watcher's callbacks; each must return within about a second.
    """

    def __init__(
        self,
        on_crash: Callable[[ErrorInfo, str | None], None],
        on_exit: Callable[[str | None], None],
    ) -> None:
        self._on_crash = on_crash
        self._on_exit = on_exit
        self._prev_excepthook: Callable[..., Any] | None = None
        self._prev_thread_hook: Callable[..., Any] | None = None
        self._prev_signals: dict[int, Any] = {}
        self._last_signal: str | None = None

    def install(self) -> None:
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._prev_thread_hook = threading.excepthook
        threading.excepthook = self._thread_excepthook
        atexit.register(self._atexit)
        if threading.current_thread() is threading.main_thread():
            for sig in TERMINATING_SIGNALS:
                self._install_signal(sig)

    def remove(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook or sys.__excepthook__
        if threading.excepthook == self._thread_excepthook:
            threading.excepthook = self._prev_thread_hook or threading.__excepthook__
        atexit.unregister(self._atexit)
        if threading.current_thread() is threading.main_thread():
            for sig, previous in self._prev_signals.items():
                if signal.getsignal(sig) == self._signal_handler:
                    signal.signal(sig, previous)
        self._prev_signals.clear()

    def _install_signal(self, sig: int) -> None:
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN or previous is None:
            return  # ignored or installed from C: leave it alone
        self._prev_signals[sig] = previous
        signal.signal(sig, self._signal_handler)

    def _excepthook(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if not issubclass(exc_type, KeyboardInterrupt):
            self._report_crash(error_info(exc_type, exc, tb), None)
        (self._prev_excepthook or sys.__excepthook__)(exc_type, exc, tb)

    def _thread_excepthook(self, args: threading.ExceptHookArgs) -> None:
        if args.exc_value is not None and not issubclass(args.exc_type, SystemExit):
            name = args.thread.name if args.thread is not None else "thread"
            self._report_crash(error_info(args.exc_type, args.exc_value, args.exc_traceback), name)
        (self._prev_thread_hook or threading.__excepthook__)(args)

    def _report_crash(self, error: ErrorInfo, thread_name: str | None) -> None:
        try:
            self._on_crash(error, thread_name)
        except Exception as exc:
            log.debug("ddpwatch: could not report crash: %s", exc)

    def _signal_handler(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        self._last_signal = name
        previous = self._prev_signals.get(signum, signal.SIG_DFL)
        if callable(previous):
            previous(signum, frame)  # the program may survive this: report at exit, if ever
            return
        try:
            self._on_exit(name)
        except Exception as exc:
            log.debug("ddpwatch: could not report signal: %s", exc)
        signal.signal(signum, signal.SIG_DFL)  # die exactly as without ddpwatch
        signal.raise_signal(signum)

    def _atexit(self) -> None:
        try:
            self._on_exit(self._last_signal)
        except Exception as exc:
            log.debug("ddpwatch: could not report exit: %s", exc)
