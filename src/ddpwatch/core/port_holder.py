"""Which process holds a TCP port on this node: what turns ``Address already in use`` into
"held by pid 1234 (python3 -m http.server 29500)".

Linux only, from ``/proc`` and without a subprocess (no ``ss`` or ``lsof``): the sockets bound
to the port come from ``/proc/net/tcp`` and ``/proc/net/tcp6`` (each with its inode and the uid
that created it), and a process holds one when a link in ``/proc/<pid>/fd`` reads
``socket:[<inode>]``. Another user's ``fd`` folder is unreadable without root, so such a socket
is told as another user's process; one that no readable process holds (another PID namespace,
a process that just ended) as an unknown one. Where there is no ``/proc`` the answer is None:
the node cannot tell.

``holder_of(port)`` gives the phrase; ``find_holder(port)`` the ``Holder`` it is made from.
Both take ``proc``, the ``/proc`` to read, so tests can hand them a made-up one.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

PROC = Path("/proc")
LISTEN = "0A"  # the TCP states in /proc/net/tcp are hexadecimal: 0A is LISTEN, 06 TIME_WAIT
TIME_WAIT = "06"
COMMAND_CHARS = 100  # a longer command line is cut, with "..."


@dataclass(frozen=True)
class Socket:
    """A socket bound to the port: its inode, the uid that created it, and its TCP state."""

    inode: int
    uid: int
    state: str


@dataclass(frozen=True)
class Holder:
    """Who holds the port: the processes found (``pids``, lowest first, and the first one's
    ``command``), or none found, with the uid that created the socket."""

    uid: int
    pids: tuple[int, ...] = ()
    command: str | None = None
    own_uid: int | None = None  # this process's uid, to tell another user's socket

    @property
    def other_user(self) -> bool:
        """Nobody readable here holds it and another user's process made the socket."""
        return not self.pids and self.own_uid is not None and self.uid != self.own_uid

    def __str__(self) -> str:
        if self.pids:
            text = f"pid {self.pids[0]}" + (f" ({self.command})" if self.command else "")
            others = len(self.pids) - 1
            if others:
                text += f" and {others} other process" + ("es" if others > 1 else "")
            return text
        if self.other_user:
            return f"another user's process ({_user(self.uid)})"
        return "an unknown process (none readable in /proc here holds it)"


def _user(uid: int) -> str:
    try:
        import pwd

        return f"{pwd.getpwuid(uid).pw_name}, uid {uid}"
    except (ImportError, KeyError):
        return f"uid {uid}"


def sockets_on(table: str, port: int) -> list[Socket]:
    """The sockets of one ``/proc/net/tcp``-style table bound to local ``port``, listening ones
    first; TIME_WAIT leftovers (inode 0, held by no process) are left out."""
    found = []
    for line in table.splitlines()[1:]:
        fields = line.split()
        if len(fields) < 10:
            continue
        _, _, hex_port = fields[1].rpartition(":")
        try:
            if int(hex_port, 16) != port:
                continue
            inode, uid = int(fields[9]), int(fields[7])
        except ValueError:
            continue
        if inode and fields[3] != TIME_WAIT:
            found.append(Socket(inode, uid, fields[3]))
    return sorted(found, key=lambda s: s.state != LISTEN)


def _read(path: Path) -> str | None:
    try:
        return path.read_text(encoding="utf-8", errors="replace")
    except OSError:
        return None


def _command(pid_dir: Path) -> str | None:
    """The process's command line, its program as a base name (``python3 -m http.server 29500``);
    its name in brackets when it has none (a kernel thread, a zombie)."""
    raw = _read(pid_dir / "cmdline")
    argv = [arg for arg in (raw or "").split("\0") if arg]
    if argv:
        text = " ".join([os.path.basename(argv[0]), *argv[1:]])
    else:
        name = (_read(pid_dir / "comm") or "").strip()
        text = f"[{name}]" if name else ""
    if len(text) > COMMAND_CHARS:
        text = text[: COMMAND_CHARS - 3] + "..."
    return text or None


def _pids_holding(proc: Path, inodes: set[int]) -> dict[int, list[int]]:
    """For each inode, the pids (in order) with a file descriptor on it, among the processes
    whose ``fd`` folder this process may read."""
    links = {f"socket:[{inode}]": inode for inode in inodes}
    held: dict[int, list[int]] = {}
    try:
        entries = sorted(int(name) for name in os.listdir(proc) if name.isdigit())
    except OSError:
        return held
    for pid in entries:
        fd_dir = proc / str(pid) / "fd"
        try:
            names = os.listdir(fd_dir)
        except OSError:  # another user's process, or one that just ended
            continue
        for name in names:
            try:
                target = os.readlink(fd_dir / name)
            except OSError:
                continue
            inode = links.get(target)
            if inode is not None:
                held.setdefault(inode, []).append(pid)
                break
    return held


def find_holder(port: int, proc: Path = PROC) -> Holder | None:
    """Who holds TCP ``port`` here; None when no socket is bound to it that ``proc`` shows
    (nothing holds it, or there is no ``/proc`` to read)."""
    sockets: list[Socket] = []
    for table in ("tcp", "tcp6"):
        text = _read(proc / "net" / table)
        if text is not None:
            sockets += sockets_on(text, port)
    if not sockets:
        return None
    sockets.sort(key=lambda s: s.state != LISTEN)
    held = _pids_holding(proc, {s.inode for s in sockets})
    own = os.getuid() if hasattr(os, "getuid") else None
    for sock in sockets:
        pids = held.get(sock.inode)
        if pids:
            return Holder(sock.uid, tuple(pids), _command(proc / str(pids[0])), own)
    return Holder(sockets[0].uid, own_uid=own)


def holder_of(port: int, proc: Path = PROC) -> str | None:
    """Who holds TCP ``port`` on this node, in words: ``"pid 1234 (python3 -m http.server
    29500)"``, ``"another user's process (ann, uid 1001)"``, ``"an unknown process (...)"``;
    None when the node cannot tell (no socket on it in ``/proc``, or no ``/proc``)."""
    holder = find_holder(port, proc)
    return None if holder is None else str(holder)
