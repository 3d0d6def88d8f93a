"""Hooks into the training process: model, optimizer, backward, exceptions, signals, exit.

Every hook that runs on the training thread is a few attribute writes wrapped
so that a fault inside ddpwatch can never reach the user's code. Everything
installed here is undone by ``remove`` (and the watcher's ``Patches.restore``).
"""

from __future__ import annotations

import atexit
import builtins
import dis
import functools
import logging
import os
import signal
import sys
import threading
import traceback
import weakref
from collections.abc import Callable
from types import FrameType, TracebackType
from typing import Any, Final

from ddpwatch.agent.loss import find_loss
from ddpwatch.agent.patches import Patches
from ddpwatch.agent.progress import Progress
from ddpwatch.agent.signal_watch import SignalWatch
from ddpwatch.agent.split import ddp_class, is_ddp
from ddpwatch.core.protocol import ErrorInfo
from ddpwatch.core.vocabulary import Phase

log = logging.getLogger("ddpwatch")

TERMINATING_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# the phases the step hooks set, as module globals: on Python 3.10 and 3.11, reading an Enum
# member off its class goes through ``EnumType.__getattr__``, 0.1 µs a hook
_BACKWARD: Final = Phase.BACKWARD
_OPTIMIZER: Final = Phase.OPTIMIZER
_DATA: Final = Phase.DATA


def _grad_always_on() -> bool:
    return True


def _not_compiling() -> bool:
    return False


def compiling_check() -> Callable[[], bool]:
    """``torch.compiler.is_compiling``: True while dynamo traces the calling code.

    A model attached and then compiled (``torch.compile(model)`` after ``attach(model)``) has
    its forward hooks traced into the graph; their ``perf_counter`` and ``suppress`` would
    each break it (a warning per graph and a slower model). Dynamo folds this check to True,
    so a hook that returns on it traces to nothing: a compiled forward marks no phase, and
    the optimizer hooks and ``backward`` still end the step.
    """
    try:
        from torch.compiler import is_compiling
    except ImportError:  # torch < 2.3
        return _not_compiling
    return is_compiling


def grad_check() -> Callable[[], bool]:
    """``torch.is_grad_enabled``, read at each forward: a forward without gradients (under
    ``no_grad`` or ``inference_mode``) is an evaluation, never followed by a backward."""
    torch = sys.modules.get("torch")
    check = getattr(torch, "is_grad_enabled", None)
    return check if callable(check) else _grad_always_on


def broadcasts_buffers(model: Any) -> bool:
    """A ``DistributedDataParallel`` model whose every forward broadcasts its buffers from
    rank 0 (``broadcast_buffers=True``, the default, and buffers to broadcast: BatchNorm's
    running statistics; DDP's ``_pre_forward`` syncs them before each forward, also under
    ``no_grad``, pytorch/pytorch#175024)."""
    try:
        sync = getattr(model, "will_sync_module_buffers", None)
        return bool(is_ddp(model) and sync is not None and sync())
    except Exception:
        return False


class ModelHooks:
    """Forward hooks on attached models, gradient checks on their parameters (and those of
    every DDP model built, ``watch_gradients``) and a global optimizer step hook.

    A forward without gradients, or of a model in ``eval()`` mode, is an evaluation (a
    validation loop, often on one rank while the others wait): phase ``evaluation``, progress
    but no step, and no training loss. Steps are counted from such forwards only in a job
    that never ran a training forward (inference)."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._handles: list[Any] = []
        self._models: list[int] = []
        self._compiling: Callable[[], bool] = _not_compiling
        self._grad_enabled: Callable[[], bool] = _grad_always_on
        self._trained = False  # a training forward was seen: evaluations count no step
        self._broadcasting: set[int] = set()  # attached DDP models that broadcast buffers
        self._forwarded: set[int] = set()  # attached DDP models watched by ``DDPForward``
        self._ddp_forward: DDPForward | None = None
        self.on_optimizer: Callable[[], object] | None = None

    def add_model(self, model: Any) -> None:
        if id(model) in self._models or not hasattr(model, "register_forward_hook"):
            return
        self._models.append(id(model))
        self._compiling = compiling_check()
        self._grad_enabled = grad_check()
        if not self._wrap_ddp_forward(model):
            self._handles.append(model.register_forward_pre_hook(self._before_forward))
            self._handles.append(model.register_forward_hook(self._after_forward))
        self.watch_gradients(model)
        if broadcasts_buffers(model):
            self._broadcasting.add(id(model))
            if self._progress.eval_syncs is None:
                self._progress.eval_syncs = 0

    def watch_gradients(self, model: Any) -> None:
        """Check this rank's own gradients of ``model`` every step (``agent/grads.py``)."""
        try:
            self._handles.extend(self._progress.grads.watch(model))
        except Exception as exc:
            log.debug("ddpwatch: no gradient check: %r", exc)

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
        self._forwarded.clear()
        self._ddp_forward = None
        self._progress.grads.forget()

    def _wrap_ddp_forward(self, model: Any) -> bool:
        """Watch a DDP model's forward passes through ``DistributedDataParallel.forward``,
        wrapped once for every attached DDP model (``DDPForward``), rather than through
        forward hooks; False where that cannot be done (then hooks it is)."""
        cls = ddp_class(model)
        if cls is None or "forward" in vars(model) or type(model).forward is not cls.forward:
            return False  # its own forward (an instance's, or a subclass's): hooks see it all
        if self._ddp_forward is None:
            try:
                self._ddp_forward = DDPForward(cls, self)
            except Exception as exc:
                log.debug("ddpwatch: DDP's forward not wrapped: %r", exc)
                return False
            self._handles.append(self._ddp_forward)
        self._forwarded.add(id(model))
        return True

    # the hooks run every step: few Python calls, no context managers (``contextlib.suppress``
    # is three), the phase set inline rather than through ``Progress.auto_phase``
    def _before_forward(self, module: Any, args: Any) -> None:
        if not self._compiling():
            self.forward_began(module)

    def _after_forward(self, module: Any, args: Any, output: Any) -> None:
        if not self._compiling():
            self.forward_ended(module, output)

    def forward_began(self, module: Any) -> None:
        """A forward of an attached model begins (not while dynamo traces it)."""
        try:
            if not self._grad_enabled() or not getattr(module, "training", True):
                progress = self._progress
                progress.evaluation_forward()
                if id(module) in self._broadcasting and module.require_forward_param_sync:
                    progress.eval_syncs = (progress.eval_syncs or 0) + 1  # a broadcast
            else:
                self._trained = True
                self._progress.forward_started()
        except Exception:  # never let the agent break a forward pass
            pass

    def forward_ended(self, module: Any, output: Any) -> None:
        """A forward of an attached model returned ``output``."""
        try:
            progress = self._progress
            mode = progress.step_mode
            if not self._grad_enabled() or not getattr(module, "training", True):
                if self._trained or mode not in (None, "forward"):
                    return  # its output is no training loss, and it ends no step
                loss = None  # inference: each forward is a step, with no loss
            else:
                loss = find_loss(output)  # its backward (``BackwardLoss``) sets the phase
            if mode is None or mode == "forward":
                progress.end_step(loss, mode="forward")
            elif loss is not None:
                progress.loss.submit(loss)
        except Exception:
            pass

    def _before_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            if self.on_optimizer is not None:
                self.on_optimizer()  # the end of a gradient wait no backward's end took
            progress = self._progress
            if not progress.pinned and progress.phase != _OPTIMIZER:
                progress.set_phase(_OPTIMIZER)
        except Exception:
            pass

    def _after_optimizer(self, optimizer: Any, args: Any, kwargs: Any) -> None:
        try:
            progress = self._progress
            mode = progress.step_mode
            if mode != "explicit":  # else ``ddpwatch.step()`` ends the steps: nothing to count
                if mode == "forward":
                    progress.prefer_optimizer_steps()
                progress.end_step(mode="optimizer")
            if not progress.pinned and progress.phase != _DATA:
                progress.set_phase(_DATA)
        except Exception:
            pass


class DDPForward:
    """``DistributedDataParallel.forward``, wrapped for the attached DDP models.

    Forward hooks on a module send every call of it through ``torch.nn.Module``'s slow call
    path (a closure, four hook dictionaries walked, a compile check) before our two hooks
    run: 38k instructions a step on a 2 ms step's 1.7 M, the agent's dearest part
    (callgrind, ``docs/performance.md`` section 1). A DDP model has no hooks of its own, so
    wrapping its class's ``forward`` keeps the fast path and costs one Python call: the
    same two moments, before DDP's own forward (its buffer broadcast, its bucket set-up) and
    after it, as the hooks saw them. Another DDP model passes through untouched. Only DDP,
    whose forward is torch's: a user's module may be scripted (TorchScript compiles the
    class's ``forward`` from its source) or copied with its class, so it keeps hooks.
    ``remove()`` (a handle, like the hooks') puts torch's forward back."""

    def __init__(self, cls: Any, hooks: ModelHooks) -> None:
        original = cls.forward
        models = hooks._forwarded
        compiling = hooks._compiling
        began, ended = hooks.forward_began, hooks.forward_ended

        @functools.wraps(original)
        def forward(module: Any, *args: Any, **kwargs: Any) -> Any:
            if id(module) not in models or compiling():
                return original(module, *args, **kwargs)
            began(module)
            output = original(module, *args, **kwargs)
            ended(module, output)
            return output

        self._cls, self._original, self.wrapper = cls, original, forward
        cls.forward = forward

    def remove(self) -> None:
        if self._cls.__dict__.get("forward") is self.wrapper:  # else someone wrapped it after us
            self._cls.forward = self._original


class BackwardLoss:
    """Zero-code loss: the scalar a rank calls ``backward()`` on is its step's loss.

    Only while the user does not hand losses over with ``ddpwatch.step(loss)``, and only for
    a step no model output or integration gave a loss for (it may be divided for gradient
    accumulation, or have extra terms). Under a ``GradScaler`` the tensor backward sees is
    the scaled loss; the wrapper of ``GradScaler.scale`` remembers the unscaled one.
    """

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._scaled: tuple[Any, Any] | None = None  # (weakref to scaled, unscaled detached)

    def install(
        self, patches: Patches, torch: Any, ended: Callable[[], object] | None = None
    ) -> None:
        """Wrap ``torch.autograd.backward`` (``Tensor.backward`` calls it): the phase and the
        loss before it, ``ended()`` after it (``GradReady.backward_ended``: the step split).
        One wrapper for both, written out: it runs every step."""
        patches.replace(torch.autograd, "backward", lambda original: self._wrap(original, ended))
        scaler = getattr(getattr(torch, "amp", None), "GradScaler", None)
        if scaler is not None:
            patches.wrap(scaler, "scale", after=self._after_scale)

    def _wrap(
        self, original: Callable[..., Any], ended: Callable[[], object] | None
    ) -> Callable[..., Any]:
        before = self._before_backward
        if ended is None:

            def backward(tensors: Any, *args: Any, **kwargs: Any) -> Any:
                try:
                    before(tensors)
                except Exception:
                    pass
                return original(tensors, *args, **kwargs)

            return backward

        def backward_timed(tensors: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                before(tensors)
            except Exception:
                pass
            result = original(tensors, *args, **kwargs)
            ended()  # swallows its own faults
            return result

        return backward_timed

    def _before_backward(self, tensors: Any) -> None:
        """Backward starts: phase ``backward``, and a scalar it runs on is the loss (a sequence
        of tensors is none: a reentrant checkpoint's backward, several heads at once)."""
        progress = self._progress
        progress.backwards += 1
        if not progress.pinned and progress.phase != _BACKWARD:
            progress.set_phase(_BACKWARD)  # where backward starts, not where a forward ended
        if (
            progress.step_mode == "explicit"
            or getattr(tensors, "ndim", None) != 0
            or not tensors.is_floating_point()
        ):
            return
        scaled = self._scaled
        if scaled is not None and scaled[0]() is tensors:
            tensors = scaled[1]
            self._scaled = None
        progress.loss.submit(tensors, fallback=True)

    def _after_scale(self, result: Any, scaler: Any, outputs: Any, *args: Any) -> None:
        if result is not outputs and getattr(outputs, "ndim", None) == 0:
            # no graph kept: the unscaled loss is often a temporary, gone by backward()
            self._scaled = (weakref.ref(result), outputs.detach())


def error_info(
    exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
) -> ErrorInfo:
    return ErrorInfo(
        type=exc_type.__name__,
        message=str(exc),
        traceback="".join(traceback.format_exception(exc_type, exc, tb)),
    )


def exit_status(code: object) -> int:
    """The status ``sys.exit(code)`` ends the process with, as ``subprocess`` reports it:
    None is 0, an int is itself (modulo 256 on POSIX), anything else (a message) is 1."""
    if code is None:
        return 0
    if isinstance(code, int):
        return code & 0xFF if os.name == "posix" else int(code)
    return 1


def main_module_frame(frame: FrameType | None) -> FrameType | None:
    """The outermost frame running the ``__main__`` module's own code, below ``frame``."""
    found = None
    while frame is not None:
        if frame.f_code.co_name == "<module>" and frame.f_globals.get("__name__") == "__main__":
            found = frame
        frame = frame.f_back
    return found


def finished_by_return(frame: FrameType) -> bool:
    """Whether a finished frame ended at a return, not by an exception going through it."""
    return dis.opname[frame.f_code.co_code[frame.f_lasti]].startswith("RETURN")


class ProcessHooks:
    """Chained excepthooks, terminating-signal handlers, exit wrappers and an atexit report.

    ``on_crash(error, thread_name)`` and ``on_exit(signal_name, exit_code)`` are the
    watcher's callbacks; each must return within about a second. An atexit handler cannot
    see the exit code, so the ways out that can be seen (``sys.exit``, ``exit()``, an
    uncaught exception, a signal) note it first; ``mark()`` (the step count) tells a noted
    exit the program caught and carried on from, which is then forgotten.
    """

    def __init__(
        self,
        on_crash: Callable[[ErrorInfo, str | None], None],
        on_exit: Callable[[str | None, int | None], None],
        mark: Callable[[], object] | None = None,
    ) -> None:
        self._on_crash = on_crash
        self._on_exit = on_exit
        self._mark = mark or (lambda: None)
        self._prev_excepthook: Callable[..., Any] | None = None
        self._prev_thread_hook: Callable[..., Any] | None = None
        self._prev_signals: dict[int, Any] = {}
        self._noted: tuple[int | None, str | None, object] | None = None  # code, signal, mark
        self._main_ident = threading.main_thread().ident
        self._main_frame: FrameType | None = None
        self._taken: int | None = None  # a signal the main thread's handler ran for
        self._watch = SignalWatch((), None, lambda: True, lambda _: None)

    def install(self, patches: Patches | None = None) -> None:
        self._prev_excepthook = sys.excepthook
        sys.excepthook = self._excepthook
        self._prev_thread_hook = threading.excepthook
        threading.excepthook = self._thread_excepthook
        atexit.register(self._atexit)
        if threading.current_thread() is threading.main_thread():
            for sig in TERMINATING_SIGNALS:
                self._install_signal(sig)
            self._main_frame = main_module_frame(sys._getframe())
            # signals whose default action we replaced: ended at once, even while the main
            # thread is blocked in C++ (``signal_watch``)
            fatal = [s for s, previous in self._prev_signals.items() if not callable(previous)]
            self._watch = SignalWatch(
                fatal, self._signal_handler, lambda: self._taken is not None, self._report_signal
            )
            self._watch.start()
        if patches is not None:
            patches.wrap(sys, "exit", before=self._before_sys_exit)
            patches.wrap(os, "_exit", before=self._before_os_exit)
            quitter = type(getattr(builtins, "exit", None))
            if quitter.__module__ == "_sitebuiltins":  # exit() and quit(), from site
                patches.wrap(quitter, "__call__", before=self._before_quit)

    def remove(self) -> None:
        if sys.excepthook == self._excepthook:
            sys.excepthook = self._prev_excepthook or sys.__excepthook__
        if threading.excepthook == self._thread_excepthook:
            threading.excepthook = self._prev_thread_hook or threading.__excepthook__
        atexit.unregister(self._atexit)
        if threading.current_thread() is threading.main_thread():
            self._watch.stop()
            for sig, previous in self._prev_signals.items():
                if signal.getsignal(sig) == self._signal_handler:
                    signal.signal(sig, previous)
        self._prev_signals.clear()

    def find_main_frame(self) -> None:
        """Find the main script's frame from another thread (ranks attached before it ran)."""
        if self._main_frame is None and self._main_ident is not None:
            self._main_frame = main_module_frame(sys._current_frames().get(self._main_ident))

    # what the process will exit with -------------------------------------------------
    def note_exit(self, code: int | None, signal_name: str | None = None) -> None:
        """Remember how the process is about to end. A code noted without a signal keeps the
        signal noted just before it (a SIGTERM handler that calls ``sys.exit(0)``)."""
        mark = self._mark()
        noted = self._noted
        if signal_name is None and noted is not None and noted[2] == mark:
            signal_name = noted[1]
        self._noted = (code, signal_name, mark)

    def outcome(self) -> tuple[int | None, str | None]:
        """(exit code, signal) at exit: what was noted unless the program went on since;
        else 0 when the main script returned, None when it ended by an unseen SystemExit."""
        noted = self._noted
        code, signal_name = (None, None) if noted is None or noted[2] != self._mark() else noted[:2]
        if code is None and self._main_returned() is not False:
            code = 0
        return code, signal_name

    def _main_returned(self) -> bool | None:
        frame = self._main_frame
        if frame is None or frame.f_lasti < 0:
            return None  # not known: assume it returned, the common case
        try:
            return finished_by_return(frame)
        except (IndexError, AttributeError):
            return None

    def _on_main_thread(self) -> bool:
        return threading.get_ident() == self._main_ident

    def _before_sys_exit(self, status: object = None, *args: Any) -> None:
        if self._on_main_thread():  # elsewhere it only ends that thread
            self.note_exit(exit_status(status))

    def _before_quit(self, quitter: Any, code: object = None, *args: Any) -> None:
        if self._on_main_thread():
            self.note_exit(exit_status(code))

    def _before_os_exit(self, status: object = 0, *args: Any) -> None:
        """``os._exit`` skips atexit: report now, bounded, and never stop it happening."""
        try:
            code = exit_status(status) if isinstance(status, int) else None
            self.note_exit(code)
            self._report_exit(self._noted[1] if self._noted else None, code)
        except BaseException:  # a KeyboardInterrupt here must not cancel the exit
            pass

    # hooks -------------------------------------------------------------------------
    def _install_signal(self, sig: int) -> None:
        previous = signal.getsignal(sig)
        if previous is signal.SIG_IGN or previous is None:
            return  # ignored or installed from C: leave it alone
        self._prev_signals[sig] = previous
        signal.signal(sig, self._signal_handler)

    def _excepthook(
        self, exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None
    ) -> None:
        if issubclass(exc_type, KeyboardInterrupt):
            # Python ends by killing itself with SIGINT: -2 as subprocess reports it
            self.note_exit(-int(signal.SIGINT) if os.name == "posix" else 1, "SIGINT")
        else:
            self.note_exit(1)
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

    def _report_exit(self, signal_name: str | None, code: int | None) -> None:
        try:
            self._on_exit(signal_name, code)
        except Exception as exc:
            log.debug("ddpwatch: could not report exit: %s", exc)

    def _signal_handler(self, signum: int, frame: FrameType | None) -> None:
        name = signal.Signals(signum).name
        previous = self._prev_signals.get(signum, signal.SIG_DFL)
        if callable(previous):
            # the program's own handler decides: it may exit (noted then) or go on
            self.note_exit(None, name)
            previous(signum, frame)
            return
        self._taken = signum  # the watch stands down: the report and the death are here
        self.note_exit(-signum, name)
        self._report_exit(name, -signum)
        signal.signal(signum, signal.SIG_DFL)  # die exactly as without ddpwatch
        signal.raise_signal(signum)

    def _report_signal(self, signum: int) -> None:
        """The watch's report of a signal the blocked main thread could not take."""
        name = signal.Signals(signum).name
        self.note_exit(-signum, name)
        self._report_exit(name, -signum)

    def _atexit(self) -> None:
        code, signal_name = self.outcome()
        self._report_exit(signal_name, code)
