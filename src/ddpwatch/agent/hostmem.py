"""Host memory of one rank, read from /proc and its memory cgroup on the agent thread.

A rank that keeps a little host memory every step (tensors kept "for logging", DataLoader
workers that copy a Python list of objects page by page as they read it, pytorch#13246)
grows until the kernel's OOM killer ends it with SIGKILL, and the other ranks hang. The
server sees it coming from these numbers (``docs/protocol.md``, the ``host_*`` fields).

Rules, as for ``probes.py``: never raise into training (an unreadable file is a None field),
stay cheap. Per heartbeat one read (``/proc/self/statm``); every ``WORKERS_EVERY_S`` one
``statm`` read per child process, whose list (``/proc/<pid>/task/<pid>/children``, the main
thread's children and theirs: DataLoader workers, a forkserver's too) is made again every
``CHILDREN_EVERY_S``; every ``NODE_EVERY_S`` ``/proc/meminfo`` and the cgroup's usage (its
limit every ``LIMIT_EVERY_S``). Values read less often are sent with every heartbeat, so the
server, for which each sample replaces the last, always has them.

Resident set sizes count pages shared with other processes in each of them: a worker forked
from its rank counts the rank's pages it still shares. Proportional or unique sizes
(``smaps_rollup``) would walk every page table, too slow for every beat; the summed RSS of the
workers over-counts, but its *growth* is what the server judges, and the node's available
memory and the cgroup's usage count each page once.
"""

from __future__ import annotations

import dataclasses
import os
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

WORKERS_EVERY_S = 1.0
CHILDREN_EVERY_S = 5.0
NODE_EVERY_S = 2.0
LIMIT_EVERY_S = 30.0
MAX_CHILDREN = 64  # workers read at most (the first found)
NO_LIMIT = 1 << 60
"""A cgroup v1 ``memory.limit_in_bytes`` at least this large means "no limit" (the kernel
writes 9223372036854771712)."""
PROC = "/proc"
CGROUP_ROOT = "/sys/fs/cgroup"


@dataclass
class HostMemoryInfo:
    """The host memory fields of ``protocol.Sample``; None wherever unknown."""

    host_rss_bytes: int | None = None
    workers_rss_bytes: int | None = None
    host_available_bytes: int | None = None
    host_total_bytes: int | None = None
    cgroup_limit_bytes: int | None = None
    cgroup_used_bytes: int | None = None

    def as_fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def _read(path: str) -> bytes:
    with open(path, "rb") as f:
        return f.read()


def rss_of(statm: bytes, page: int) -> int:
    """Resident bytes from a ``/proc/<pid>/statm`` line (its second field, in pages)."""
    return int(statm.split()[1]) * page


def meminfo_bytes(text: bytes, key: bytes) -> int | None:
    """``MemAvailable`` (any ``key``) of ``/proc/meminfo`` in bytes; None if absent."""
    for line in text.splitlines():
        name, _, rest = line.partition(b":")
        if name == key:
            fields = rest.split()
            value = int(fields[0])
            return value * 1024 if len(fields) > 1 and fields[1] == b"kB" else value
    return None


def cgroup_dirs(cgroup: bytes, root: str = CGROUP_ROOT) -> list[tuple[str, str, str]]:
    """(directory, limit file, usage file) for the memory cgroup of a ``/proc/self/cgroup``
    text and each of its ancestors, the process's own first: cgroup v2 (``0::/path``,
    ``memory.max``) where the unified hierarchy has the memory controller, else v1
    (``N:...memory...:/path``, ``memory.limit_in_bytes``). A path that is not under the
    mount (a container that sees only its own cgroup, mounted as the root) ends at the
    mount itself."""
    v1: list[tuple[str, str, str]] = []
    v2: list[tuple[str, str, str]] = []
    for line in cgroup.decode(errors="replace").splitlines():
        number, _, rest = line.partition(":")
        controllers, _, path = rest.partition(":")
        if number == "0" and controllers == "":
            v2 = _chain(root, path, "memory.max", "memory.current")
        elif "memory" in controllers.split(","):
            v1 = _chain(
                os.path.join(root, "memory"), path, "memory.limit_in_bytes", "memory.usage_in_bytes"
            )
    return v2 or v1


def _chain(base: str, path: str, limit: str, usage: str) -> list[tuple[str, str, str]]:
    """The cgroup's directory under ``base`` and its ancestors, from the deepest that has a
    ``limit`` file; empty when none has one (no such controller there)."""
    parts = [p for p in path.strip().split("/") if p]
    chain = [os.path.join(base, *parts[:n]) for n in range(len(parts), -1, -1)]
    for n, directory in enumerate(chain):
        if os.path.exists(os.path.join(directory, limit)):
            return [(d, limit, usage) for d in chain[n:]]
    return []


def _limit(text: bytes) -> int | None:
    """A limit file's value; None for ``max`` or a v1 "unlimited"."""
    value = text.strip()
    if not value or value == b"max":
        return None
    number = int(value)
    return number if 0 < number < NO_LIMIT else None


class HostMemory:
    """Reads the fields; ``proc``, ``cgroup_root`` and ``clock`` are the test seam."""

    def __init__(
        self,
        proc: str = PROC,
        cgroup_root: str = CGROUP_ROOT,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.proc = proc
        self.cgroup_root = cgroup_root
        self.clock = clock
        self.page = _page_size()
        self._reset()

    def _reset(self) -> None:
        """Forget what was read (a forked child's own process is another)."""
        self._pid = os.getpid()
        self._children: list[int] | None = None
        self._children_at = -float("inf")
        self._workers: int | None = None
        self._workers_at = -float("inf")
        self._node: tuple[int | None, int | None] = (None, None)
        self._node_at = -float("inf")
        self._cgroup: tuple[str, str, str] | None = None
        self._cgroup_known = False
        self._limit: int | None = None
        self._limit_at = -float("inf")
        self._used: int | None = None

    def read(self) -> HostMemoryInfo:
        """This beat's values (the slower ones as last read); never raises."""
        now = self.clock()
        if os.getpid() != self._pid:  # a forked child: nothing of the parent's holds
            self._reset()
        info = HostMemoryInfo(host_rss_bytes=self._safe(self._own_rss))
        if now - self._workers_at >= WORKERS_EVERY_S:
            self._workers_at = now
            self._workers = self._safe(lambda: self._workers_rss(now))
        if now - self._node_at >= NODE_EVERY_S:
            self._node_at = now
            self._node = self._safe(self._meminfo) or (None, None)
            self._used = self._safe(lambda: self._cgroup_read(now))
        info.workers_rss_bytes = self._workers
        info.host_available_bytes, info.host_total_bytes = self._node
        info.cgroup_limit_bytes = self._limit
        info.cgroup_used_bytes = self._used
        return info

    @staticmethod
    def _safe(read: Callable[[], Any]) -> Any:
        try:
            return read()
        except (OSError, ValueError, IndexError):
            return None

    def _own_rss(self) -> int:
        return rss_of(_read(f"{self.proc}/self/statm"), self.page)

    def _workers_rss(self, now: float) -> int:
        if self._children is None or now - self._children_at >= CHILDREN_EVERY_S:
            self._children_at = now
            self._children = self._descendants()
        total = 0
        for child in self._children:
            try:
                total += rss_of(_read(f"{self.proc}/{child}/statm"), self.page)
            except (OSError, ValueError, IndexError):
                continue  # it ended since the list was made
        return total

    def _descendants(self) -> list[int]:
        """The main thread's child processes, and theirs (a forkserver's workers), at most
        ``MAX_CHILDREN``; raises OSError where the kernel keeps no ``children`` file."""
        pid = self._pid
        found = _children_of(self.proc, pid)
        for child in list(found):
            if len(found) >= MAX_CHILDREN:
                break
            try:
                found += _children_of(self.proc, child)
            except OSError:
                continue
        return found[:MAX_CHILDREN]

    def _meminfo(self) -> tuple[int | None, int | None]:
        text = _read(f"{self.proc}/meminfo")
        return meminfo_bytes(text, b"MemAvailable"), meminfo_bytes(text, b"MemTotal")

    def _cgroup_read(self, now: float) -> int | None:
        """The cgroup's usage; its limit (the smallest of it and its ancestors', the one
        that binds) found once and read again every ``LIMIT_EVERY_S``."""
        if not self._cgroup_known:
            self._cgroup_known = True
            self._cgroup = self._find_cgroup()
        if self._cgroup is None:
            return None
        directory, limit, usage = self._cgroup
        if now - self._limit_at >= LIMIT_EVERY_S:
            self._limit_at = now
            self._limit = self._safe(lambda: _limit(_read(os.path.join(directory, limit))))
        return int(_read(os.path.join(directory, usage)).strip())

    def _find_cgroup(self) -> tuple[str, str, str] | None:
        """The directory whose limit binds (the smallest set), else the process's own."""
        try:
            dirs = cgroup_dirs(_read(f"{self.proc}/self/cgroup"), self.cgroup_root)
        except (OSError, ValueError):
            return None
        best: tuple[int, tuple[str, str, str]] | None = None
        for entry in dirs:
            directory, limit, _ = entry
            try:
                value = _limit(_read(os.path.join(directory, limit)))
            except (OSError, ValueError):
                continue
            if value is not None and (best is None or value < best[0]):
                best = (value, entry)
        if best is not None:
            return best[1]
        return dirs[0] if dirs else None


def _children_of(proc: str, pid: int) -> list[int]:
    return [int(p) for p in _read(f"{proc}/{pid}/task/{pid}/children").split()]


def _page_size() -> int:
    try:
        return int(os.sysconf("SC_PAGE_SIZE"))
    except (ValueError, OSError, AttributeError):
        return 4096


_default = HostMemory()


def read() -> HostMemoryInfo:
    """This process's host memory fields (the watcher calls it on the publisher thread)."""
    try:
        return _default.read()
    except Exception:
        return HostMemoryInfo()
