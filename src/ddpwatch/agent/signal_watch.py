"""A terminating signal ends a rank as fast as it would without ddpwatch.

The agent reports a SIGTERM before the rank dies through a Python-level handler
(``hooks.ProcessHooks``). Python runs such handlers on the main thread only, between
bytecodes: a main thread blocked in C++ that does not return on a signal (the rendezvous
store's wait in ``init_process_group``, a collective's wait) runs none, and the signal that
would have ended the rank at once is put off until the call returns. A launcher stopping its
ranks then waits out its grace period and kills them (torchrun: 30 s; seen: a restart under
``torchrun --max-restarts`` took 33 s instead of 1 s).

``SignalWatch`` hears the signal at once on its own thread, through the wakeup fd that
Python's C-level handler writes the signal's number to (``signal.set_wakeup_fd``). When the
main thread has not taken the signal within ``GRACE_S``, the watch reports it itself and ends
the process by the signal's default action: the same death, a moment later. Where the
process's wakeup fd is someone else's (an asyncio loop on the main thread), nothing changes.

A child forked from the rank (a DataLoader worker) would share the pipe, and a SIGTERM that
stops the worker would read, in the rank, as its own: the child lets go of it as it is forked
(``os.register_at_fork``).
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import os
import signal
import threading
import time
from collections.abc import Callable, Collection

log = logging.getLogger("ddpwatch")

GRACE_S = 0.25
"""How long the main thread has to run the Python handler itself (it reports and re-raises
the signal) before the watch takes it as blocked."""


class SignalWatch:
    """Watches ``signals`` (ones whose default action ended the process before ddpwatch put
    a Python handler in its place). ``handler`` is that handler: a signal counts only while
    it is still the one installed (a program that installed its own since, to save a
    checkpoint on SIGTERM, decides for itself). ``taken()`` says the main thread's handler
    ran; ``report(signum)`` reports the exit (bounded, about a second)."""

    def __init__(
        self,
        signals: Collection[int],
        handler: object,
        taken: Callable[[], bool],
        report: Callable[[int], None],
    ) -> None:
        self._signals = frozenset(signals)
        self._handler = handler
        self._taken = taken
        self._report = report
        self._write_fd = -1
        self._thread: threading.Thread | None = None

    def start(self) -> bool:
        """From the main thread: take the wakeup fd unless it is someone else's."""
        if not self._signals or threading.current_thread() is not threading.main_thread():
            return False
        read_fd, write_fd = os.pipe()
        os.set_blocking(write_fd, False)
        try:
            previous = signal.set_wakeup_fd(write_fd, warn_on_full_buffer=False)
        except (ValueError, OSError):
            previous = None
        if previous != -1:  # someone else's (or none to be had): leave it to them
            if previous is not None:
                signal.set_wakeup_fd(previous)
            os.close(read_fd)
            os.close(write_fd)
            return False
        self._write_fd = write_fd
        _watching.add(self)
        self._thread = threading.Thread(
            target=self._run, args=(read_fd,), name="ddpwatch-signals", daemon=True
        )
        self._thread.start()
        return True

    def stop(self) -> None:
        """From the main thread: give the wakeup fd back; the thread ends at its pipe's end."""
        self._let_go()

    def _let_go(self) -> None:
        _watching.discard(self)
        if self._write_fd < 0:
            return
        with contextlib.suppress(ValueError):
            current = signal.set_wakeup_fd(-1)
            if current != self._write_fd:  # someone else's since: theirs it stays
                signal.set_wakeup_fd(current)
        with contextlib.suppress(OSError):
            os.close(self._write_fd)
        self._write_fd = -1

    def _run(self, read_fd: int) -> None:
        try:
            while True:
                data = os.read(read_fd, 64)
                if not data:
                    return
                for signum in data:
                    if signum in self._signals and signal.getsignal(signum) == self._handler:
                        self._settle(signum)
        except OSError:
            return
        finally:
            os.close(read_fd)

    def _settle(self, signum: int) -> None:
        """Give the main thread ``GRACE_S`` to take the signal; then take it here."""
        deadline = time.monotonic() + GRACE_S
        while time.monotonic() < deadline:
            if self._taken():
                return
            time.sleep(0.02)
        if self._taken() or signal.getsignal(signum) != self._handler:
            return
        try:
            self._report(signum)
        except Exception as exc:
            log.debug("ddpwatch: could not report %s: %r", signum, exc)
        die_by(signum)


_watching: set[SignalWatch] = set()
"""Watches started in this process (one, in practice)."""


def _after_fork_in_child() -> None:
    """The forked child's signals are its own: it writes none to the rank's pipe (its
    watch's thread did not survive the fork; the rank's reads the pipe)."""
    for watch in list(_watching):
        watch._let_go()


if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_after_fork_in_child)


def die_by(signum: int) -> None:
    """End the process by ``signum``'s default action, from any thread: ``signal.signal``
    works on the main thread only, the C library's ``signal`` sets it for the process."""
    try:
        libc = ctypes.CDLL(None)
        libc.signal.argtypes = (ctypes.c_int, ctypes.c_void_p)
        libc.signal.restype = ctypes.c_void_p
        libc.signal(signum, None)  # SIG_DFL
        os.kill(os.getpid(), signum)
        time.sleep(1.0)  # delivery is asynchronous; it ends the process
    finally:
        os._exit(128 + signum)  # no C library to call: the shell's code for that death
