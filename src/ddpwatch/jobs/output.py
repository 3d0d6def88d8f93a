"""The job's stderr, passed through to the terminal unchanged, with its first and last lines
kept: when the launcher ends before any rank reported, they say why (``jobs/failure.py``).

``ddpwatch run`` gives the job a stderr of its own (``StderrTee.child_fd``) and a thread
copies every byte read there to ddpwatch's own stderr as it comes, then keeps the text.
Why this way, and not another:

- **stderr only.** The launchers' errors (torchrun's traceback and failure report, Python's
  "can't open file", argparse's usage error, c10d's and gloo's log lines) all go to stderr.
  stdout stays the terminal itself: through a pipe, Python would buffer a rank's ``print``
  in 8 KiB blocks instead of lines, and that changes what the user sees and when.
- **a pseudo-terminal where stderr is a terminal, a pipe where it is not.** A job that wrote
  to a terminal still does: ``isatty(2)`` stays true, so colours, tqdm's bars (their width
  is the pty's, kept equal to the terminal's, on SIGWINCH too) and Python's own tracebacks
  look as they did. The pty is raw on output (no ``OPOST``): it passes the bytes untouched,
  carriage returns included, and the real terminal does its own output processing as it did
  before. A job whose stderr was a file or a pipe (CI, ``2> log``) gets a pipe, which it
  cannot tell from those in any way that matters to it (it was not a terminal either).
- **never in the job's way.** The thread does nothing but read, write and split lines,
  holding no lock the collector holds; the pipe is widened to 1 MiB where Linux allows, so
  a burst never waits on ddpwatch. Writing to the terminal can block the thread only where
  the terminal would have blocked the job itself. If ddpwatch's stderr goes away (a closed
  pipe), the thread goes on reading and drops what it cannot write: the job is never
  blocked by a reader that stopped.
- **bounded.** The first ``HEAD_LINES`` and the last ``TAIL_LINES`` lines are kept
  (``OutputTail``): a launcher prints its root cause early (one "can't open file" per rank)
  and sums up at the end; an unfinished line longer than ``MAX_LINE`` bytes keeps its end.

What changes: processes still writing to the job's stderr after ddpwatch itself has exited
(daemons left behind by the job) write into a closed pipe or pty (``EPIPE``/``EIO``), where
before they wrote to a terminal that was still open.
"""

from __future__ import annotations

import contextlib
import errno
import os
import select
import signal
import threading
from collections import deque
from collections.abc import Callable
from types import FrameType
from typing import Any

HEAD_LINES = 100
TAIL_LINES = 200
MAX_LINE = 8192  # bytes of an unfinished line kept (a progress bar redrawn with \r for hours)
CHUNK = 65536
PIPE_SIZE = 1 << 20
F_SETPIPE_SZ = 1031  # Linux fcntl; fcntl.F_SETPIPE_SZ from Python 3.10 on Linux only


def visible(raw: bytes) -> str:
    """A line as a terminal leaves it: what follows its last carriage return."""
    parts = [part for part in raw.split(b"\r") if part.strip()]
    return (parts[-1] if parts else b"").decode("utf-8", errors="replace")


class OutputTail:
    """The first ``head`` and last ``keep`` lines of a byte stream, fed in any chunks."""

    def __init__(
        self,
        head: int = HEAD_LINES,
        keep: int = TAIL_LINES,
        on_line: Callable[[str], None] | None = None,
    ) -> None:
        self.on_line = on_line
        """Called with each complete line as it is read (on the reading thread), for what
        watches the output live (``jobs/aborts.py``); never lets an error of its own out."""
        self._head: list[str] = []
        self._head_size = head
        self._tail: deque[str] = deque(maxlen=keep)  # the lines after the head
        self._keep = keep
        self._partial = b""
        self._lock = threading.Lock()

    def feed(self, data: bytes) -> None:
        with self._lock:
            *complete, partial = (self._partial + data).split(b"\n")
            if len(partial) > MAX_LINE:  # keep its last redraw, at most MAX_LINE bytes
                partial = partial[partial.rfind(b"\r", 0, len(partial) - 1) + 1 :][-MAX_LINE:]
            self._partial = partial
            room = max(0, self._head_size - len(self._head))
            self._head.extend(visible(raw) for raw in complete[:room])
            self._tail.extend(visible(raw) for raw in complete[room:][-self._keep :])
        on_line = self.on_line
        if on_line is not None:
            for raw in complete:
                try:
                    on_line(visible(raw))
                except Exception:  # a watcher's bug never stops the job's output
                    self.on_line = None
                    break

    def lines(self) -> list[str]:
        """The kept lines in order, the unfinished last one too."""
        with self._lock:
            last = [visible(self._partial)] if self._partial.strip() else []
            return [*self._head, *self._tail, *last]


def tail_of_file(path: str, head: int = HEAD_LINES, keep: int = TAIL_LINES) -> list[str]:
    """A log's first ``head`` and last ``keep`` lines (``ddpwatch run --tui`` logs the job's
    output to a file); [] when it cannot be read."""
    try:
        with open(path, "rb") as log:
            size = os.fstat(log.fileno()).st_size
            window = (head + keep) * 512
            if size <= 2 * window:
                tail = OutputTail(head, keep)
                tail.feed(log.read())
                return tail.lines()
            first = log.read(window).split(b"\n")[:-1][:head]  # the cut line is left out
            log.seek(size - window)
            last = log.read().split(b"\n")[1:]
    except OSError:
        return []
    ending = [visible(raw) for raw in last]
    if ending and not ending[-1]:
        ending.pop()
    return [*(visible(raw) for raw in first), *ending[-keep:]]


class StderrTee:
    """The job's stderr: give ``child_fd`` to the job, call ``started()`` once it has it;
    every byte written there reaches ``target_fd`` (ddpwatch's stderr) unchanged, and
    ``tail`` keeps the lines. See the module's docstring for why a pty or a pipe."""

    def __init__(self, target_fd: int = 2, tail: OutputTail | None = None) -> None:
        self.tail = tail or OutputTail()
        self._target = target_fd
        self._forwarding = True
        self._winch: Any = None
        self._open = threading.RLock()  # held while the reading end closes (a nested SIGWINCH)
        pair = _terminal_pair(target_fd)
        self.is_pty = pair is not None
        self._read_fd, self.child_fd = pair or _pipe()
        if self.is_pty:
            self._follow_window_size()
        self._thread = threading.Thread(target=self._run, name="ddpwatch-job-stderr", daemon=True)
        self._thread.start()

    def started(self) -> None:
        """The job holds its own copy of ``child_fd`` (or never will): close ours, so that
        the reader sees the end once the job and its children are gone."""
        if self.child_fd >= 0:
            os.close(self.child_fd)
            self.child_fd = -1

    def finish(self, timeout: float = 2.0) -> list[str]:
        """Wait up to ``timeout`` for the job's last bytes (the end comes when every process
        holding the job's stderr has exited), then the kept lines. Processes the job left
        behind may still write: the thread goes on passing their output through."""
        self.started()
        self._thread.join(timeout)
        if self._winch is not None:
            with contextlib.suppress(ValueError):  # not the main thread
                signal.signal(signal.SIGWINCH, self._winch)
            self._winch = None
        return self.tail.lines()

    def _run(self) -> None:
        try:
            while True:
                try:
                    data = os.read(self._read_fd, CHUNK)
                except OSError:  # EIO: a pty none holds any more
                    break
                if not data:
                    break
                if self._forwarding:
                    self._write(data)
                self.tail.feed(data)
        finally:
            with self._open:
                os.close(self._read_fd)
                self._read_fd = -1

    def _write(self, data: bytes) -> None:
        view = memoryview(data)
        while view:
            try:
                view = view[os.write(self._target, view) :]
            except BlockingIOError:  # a non-blocking stderr: wait until it takes more
                select.select([], [self._target], [], 1.0)
            except OSError as exc:
                if exc.errno != errno.EINTR:
                    self._forwarding = False  # gone: keep reading, so the job never blocks
                    return

    def _follow_window_size(self) -> None:
        """Keep the pty's size the terminal's, as a job reading it on SIGWINCH expects."""
        _copy_window_size(self._target, self.child_fd)

        def resized(signum: int, frame: FrameType | None) -> None:
            with self._open:  # the master end sets the pair's size, while it is open
                if self._read_fd >= 0:
                    _copy_window_size(self._target, self._read_fd)
            if callable(previous):
                previous(signum, frame)

        try:
            previous = signal.signal(signal.SIGWINCH, resized)
        except (ValueError, AttributeError):  # not the main thread; no SIGWINCH here
            return
        self._winch = previous


def _pipe() -> tuple[int, int]:
    read_fd, write_fd = os.pipe()
    try:
        import fcntl

        fcntl.fcntl(read_fd, F_SETPIPE_SZ, PIPE_SIZE)
    except (ImportError, OSError):
        pass  # not Linux, or over /proc/sys/fs/pipe-max-size: the default 64 KiB
    return read_fd, write_fd


def _terminal_pair(fd: int) -> tuple[int, int] | None:
    """A pty (ours, the job's) that writes through as raw as the terminal at ``fd`` shows,
    or None when ``fd`` is no terminal or no pty can be had (then a pipe)."""
    try:
        if not os.isatty(fd):
            return None
        import termios

        master, slave = os.openpty()
    except (ImportError, OSError, AttributeError):  # no termios or openpty here (Windows)
        return None
    try:
        attributes = termios.tcgetattr(fd)
        attributes[1] &= ~termios.OPOST  # the real terminal processes output, as before
        termios.tcsetattr(slave, termios.TCSANOW, attributes)
    except (termios.error, OSError):
        os.close(master)
        os.close(slave)
        return None
    return master, slave


def _copy_window_size(source: int, pty_fd: int) -> None:
    try:
        import fcntl
        import termios

        size = fcntl.ioctl(source, termios.TIOCGWINSZ, b"\0" * 8)
        fcntl.ioctl(pty_fd, termios.TIOCSWINSZ, size)
    except (ImportError, OSError):
        pass


class LogFollower:
    """Reads a file the job writes as it grows (``ddpwatch run --tui``: the dashboard owns the
    terminal, the job's output goes to a log) and feeds it to ``tail``, on a thread of its own.

    Not a pipe between the job and the file: the job writes to the file itself, so it never
    waits on ddpwatch, and a job the user detaches from keeps writing where it did after
    ddpwatch has exited. The cost is ``interval`` of delay, well inside what reads it live
    (a C++ abort's message, paired with a black box within seconds: ``core/boxreader.py``)."""

    def __init__(self, path: str, tail: OutputTail, interval: float = 0.2) -> None:
        self.tail = tail
        self._path = path
        self._interval = interval
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="ddpwatch-job-log", daemon=True)
        self._thread.start()

    def stop(self, timeout: float = 2.0) -> None:
        """Read what is left, then stop."""
        self._stop.set()
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            with open(self._path, "rb") as log:
                while True:
                    stopping = self._stop.is_set()
                    while data := log.read(CHUNK):
                        self.tail.feed(data)
                    if stopping:
                        return
                    self._stop.wait(self._interval)
        except OSError:
            return  # the log went away: nothing more to follow
