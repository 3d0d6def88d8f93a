"""What a rank was doing when it died too fast to say so: a record that outlives the process.

A rank that gloo aborts from C++ (SIGABRT: "Received data size doesn't match expected size",
pytorch/pytorch#150248's family), or that segfaults in an extension, runs no Python again:
no excepthook, no atexit, no last heartbeat. The collective it entered since its last
heartbeat (within half a second, and the abort comes within microseconds) never reaches the
server, which then cannot tell how it called the collective that killed it, nor that it died.

``BlackBox`` keeps two things in one small file that the kernel keeps once the process is gone:

- **the last Python-level collective entered**, written by the training thread into a shared
  file mapping at each entry (one slice assignment of bytes encoded once per distinct call:
  a memory store, no system call) and marked done at its exit;
- **the Python stack of every thread at a fatal signal**: ``faulthandler`` (C code, safe in
  a signal handler) writes it after the record, then lets the signal end the process as it
  would have. Not where the process had enabled ``faulthandler`` itself (its output is the
  user's): the record is still kept.

The file is named in the rank's hello (``box``); a ddpwatch process on the same host reads it
once the rank is late (``core/boxreader.py``). A clean exit removes it; a box whose process is
gone is removed by the next agent that starts in the same folder, once it is ten minutes old.
"""

from __future__ import annotations

import contextlib
import faulthandler
import logging
import mmap
import os
import secrets
import threading
import time
from collections.abc import Callable
from typing import Any

import msgspec

from ddpwatch.core.blackbox import (
    DUMP_AT,
    MAGIC,
    NAME,
    RECORD_AT,
    RECORD_HEAD,
    RECORD_SIZE,
    box_dir,
    box_pid,
    process_gone,
)

log = logging.getLogger("ddpwatch")
_encode = msgspec.msgpack.Encoder().encode
_Call = tuple[str, str | None, int | None, str | None, int | None]
ORPHAN_AFTER_S = 600.0  # a dead rank's box kept this long for a reader that has not read it
ENCODED_KEPT = 256  # distinct (call, phase) encodings kept: most loops make a handful


class BlackBox:
    """A rank's box, open for the life of the process (see the module docstring)."""

    def __init__(
        self, path: str, fd: int, view: mmap.mmap, names: Callable[[Any], _Call]
    ) -> None:
        self.path = path
        self.name = os.path.basename(path)
        self._fd = fd
        self._view = view
        self._names = names
        self._encoded: dict[Any, bytes] = {}
        self.dumps = False  # whether faulthandler writes into this box
        self._pid = os.getpid()

    @classmethod
    def open(
        cls, rank: int, names: Callable[[Any], _Call], directory: str | None = None
    ) -> BlackBox | None:
        """A new box for this process as ``rank`` (``names``: a raw call as kept on the
        training thread, in words); None where no file can be made (logged at debug)."""
        folder = directory or box_dir()
        try:
            os.makedirs(folder, mode=0o700, exist_ok=True)
            _remove_orphans(folder)
            name = f"{rank}-{os.getpid()}-{secrets.token_hex(8)}.box"
            path = os.path.join(folder, name)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError as exc:
            log.debug("ddpwatch: no black box: %s", exc)
            return None
        try:
            os.ftruncate(fd, DUMP_AT)
            view = mmap.mmap(fd, DUMP_AT, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
        except (OSError, ValueError) as exc:
            os.close(fd)
            with contextlib.suppress(OSError):
                os.unlink(path)
            log.debug("ddpwatch: no black box: %s", exc)
            return None
        main = threading.main_thread().ident or 0
        said = _encode([os.getpid(), rank, main])
        header = MAGIC + len(said).to_bytes(1, "little") + said
        view[: len(header)] = header
        box = cls(path, fd, view, names)
        box._dump_here()
        return box

    def _dump_here(self) -> None:
        """faulthandler writes every thread's stack here at a fatal signal, unless this
        process enabled it already; a child forked from the rank (a DataLoader worker) does
        not write into its parent's box."""
        if faulthandler.is_enabled():
            return
        try:
            os.lseek(self._fd, DUMP_AT, os.SEEK_SET)
            faulthandler.enable(file=self._fd, all_threads=True)
        except (OSError, ValueError, RuntimeError) as exc:
            log.debug("ddpwatch: faulthandler not enabled: %s", exc)
            return
        self.dumps = True
        os.register_at_fork(after_in_child=self._forked)

    def _forked(self) -> None:
        if self.dumps and os.getpid() != self._pid:
            self.dumps = False
            with contextlib.suppress(Exception):
                faulthandler.disable()

    def enter(self, seq: int, raw: Any, step: int | None, phase: str) -> None:
        """The training thread enters a Python-level collective: ``seq`` its number (0 for
        one not counted), ``raw`` the call as ``Progress`` keeps it, at ``step`` (the steps
        ended so far) in ``phase``."""
        key: tuple[Any, str] | None = (raw, phase)
        try:
            encoded = self._encoded.get(key)
        except TypeError:  # an unhashable part (a ReduceOp made for one call)
            encoded, key = None, None
        if encoded is None:
            encoded = _encode([*self._names(raw), phase])[: RECORD_SIZE - RECORD_HEAD]
            if key is not None and len(self._encoded) < ENCODED_KEPT:
                self._encoded[key] = encoded
        record = (
            b"\x01"
            + seq.to_bytes(8, "little")
            + (0 if step is None else step + 1).to_bytes(8, "little")
            + len(encoded).to_bytes(2, "little")
        )
        self._view[RECORD_AT : RECORD_AT + RECORD_HEAD + len(encoded)] = record + encoded

    def leave(self) -> None:
        """...and is out of it."""
        self._view[RECORD_AT] = 0

    def close(self) -> None:
        """A clean end: nothing to read after it. The file goes; the mapping stays (a few
        KiB until the process ends), so that a collective the training thread is still in,
        or enters, writes where it always did and never meets a closed one."""
        if os.getpid() != self._pid:
            return
        if self.dumps:
            self.dumps = False
            with contextlib.suppress(Exception):
                faulthandler.disable()
        with contextlib.suppress(OSError):
            os.unlink(self.path)


def _remove_orphans(folder: str) -> None:
    """Boxes whose process is gone and that no reader took (a rank killed while no ddpwatch
    watched on its host): removed, so the folder does not grow run after run. Only once
    ``ORPHAN_AFTER_S`` old: a box its reader has not read yet (a rank that died a second
    ago, while a restarted attempt's or another job's ranks start on the same host) is kept
    for it."""
    try:
        names = os.listdir(folder)
    except OSError:
        return
    now = time.time()
    for name in names:
        if not NAME.match(name):
            continue
        path = os.path.join(folder, name)
        if process_gone(box_pid(name)):  # not another user's, nor one still running
            with contextlib.suppress(OSError):
                if now - os.stat(path).st_mtime >= ORPHAN_AFTER_S:
                    os.unlink(path)
