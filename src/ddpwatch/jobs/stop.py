"""Stopping a launched job whole: the launcher and every process under it.

Used by ``ddpwatch run`` (``jobs/launch.py``) and ``ddpwatch demo`` (``demo/runner.py``).
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess


def descendants(pid: int) -> list[int]:
    """All processes below ``pid`` (Linux /proc). torchrun starts each worker in its own
    session, so killing torchrun's process group alone would orphan the ranks."""
    children: dict[int, list[int]] = {}
    for entry in os.listdir("/proc") if os.path.isdir("/proc") else []:
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as stat:
                fields = stat.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry))
    found, todo = [], [pid]
    while todo:
        for child in children.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def stop_job(
    job: subprocess.Popen[bytes] | subprocess.Popen[str] | None, grace: float = 5.0
) -> None:
    """Stop a launcher and every process under it; leave no child behind.

    SIGTERM first, as a person's Ctrl-C would (torchrun forwards it to its
    workers), then SIGKILL to whatever is left after ``grace`` seconds.
    """
    if job is None:
        return
    tree = descendants(job.pid)
    if job.poll() is None:
        with contextlib.suppress(ProcessLookupError):
            job.send_signal(signal.SIGTERM)
        with contextlib.suppress(subprocess.TimeoutExpired):
            job.wait(grace)
    for pid in [job.pid, *tree, *descendants(job.pid)]:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, signal.SIGKILL)
    with contextlib.suppress(subprocess.TimeoutExpired):
        job.wait(5)
