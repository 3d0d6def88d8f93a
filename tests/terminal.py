"""A real terminal for tests: a command on a pseudo-terminal, its screen kept by ``pyte``.

For what only a terminal exercises: ``ddpwatch run --tui`` owns the terminal
while the job it starts writes to a file.
"""

from __future__ import annotations

import fcntl
import os
import select
import struct
import subprocess
import termios
import time
from collections.abc import Callable, Sequence

import pyte


class Terminal:
    """Runs ``command`` on a pty of ``columns`` x ``lines``; ``wait_for`` reads its screen."""

    def __init__(
        self,
        command: Sequence[str],
        env: dict[str, str],
        columns: int = 120,
        lines: int = 36,
    ) -> None:
        master, slave = os.openpty()
        fcntl.ioctl(slave, termios.TIOCSWINSZ, struct.pack("HHHH", lines, columns, 0, 0))
        self.screen = pyte.Screen(columns, lines)
        self.stream = pyte.ByteStream(self.screen)
        self.master = master
        self.raw = bytearray()
        self.proc = subprocess.Popen(
            list(command),
            stdin=slave, stdout=slave, stderr=slave,
            env={**env, "TERM": "xterm-256color", "COLUMNS": str(columns), "LINES": str(lines)},
            start_new_session=True,
        )  # fmt: skip
        os.close(slave)

    @property
    def text(self) -> str:
        return "\n".join(self.screen.display)

    def pump(self, seconds: float) -> None:
        """Read what the program wrote for up to ``seconds``."""
        deadline = time.monotonic() + seconds
        while True:
            left = deadline - time.monotonic()
            ready, _, _ = select.select([self.master], [], [], max(0.0, min(left, 0.05)))
            if ready:
                try:
                    data = os.read(self.master, 1 << 16)
                except OSError:  # the program ended and closed the pty
                    return
                self.raw += data
                self.stream.feed(data)
            elif left <= 0:
                return

    def wait_for(self, *texts: str, timeout: float = 60.0) -> str:
        """Until every one of ``texts`` is on screen; returns the screen."""
        self._until(
            lambda screen: all(t in screen for t in texts), timeout, f"not on screen: {texts}"
        )
        return self.text

    def wait_gone(self, text: str, timeout: float = 30.0) -> None:
        self._until(lambda screen: text not in screen, timeout, f"still on screen: {text}")

    def _until(self, done: Callable[[str], bool], timeout: float, failure: str) -> None:
        """Read the program's output until ``done(screen)``, for at most ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while not done(self.text):
            if time.monotonic() > deadline:
                raise AssertionError(f"after {timeout} s, {failure}\n{self.text}")
            self.pump(0.1)

    def press(self, keys: str) -> None:
        os.write(self.master, keys.encode())

    def wait_exit(self, timeout: float = 30.0) -> int:
        deadline = time.monotonic() + timeout
        while self.proc.poll() is None and time.monotonic() < deadline:
            self.pump(0.1)
        self.pump(0.2)
        code = self.proc.poll()
        if code is None:
            self.close()
            raise AssertionError(f"still running after {timeout} s:\n{self.text}")
        return code

    def close(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)
        if self.master >= 0:
            os.close(self.master)
            self.master = -1
