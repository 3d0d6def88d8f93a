"""The black box's format, shared by the agent that writes it and the ddpwatch processes on the
rank's host that read it once the rank is late (``agent/blackbox.py`` says why it exists).

A box is one file, ``<rank>-<pid>-<token>.box`` in ``box_dir()``:

- bytes 0-63: ``MAGIC``, one length byte, then a MessagePack array ``[pid, rank, main thread
  id]`` (the thread whose stack in a dump is the training loop's);
- bytes 64-511: the last Python-level collective the rank entered: a flag byte (1 while
  inside it), its number (8 bytes, little-endian; 0 for a call on another group), the steps
  ended when it entered it plus one (8 bytes; 0 for none yet), the length of what follows
  (2 bytes), and a MessagePack array ``[op, dtype, element count, reduce op, root, phase]``;
- from byte 4096: what ``faulthandler`` wrote at a fatal signal, if anything: "Fatal Python
  error: Aborted", then each thread's Python stack.
"""

from __future__ import annotations

import os
import re
import tempfile
from dataclasses import dataclass

import msgspec

BOX_DIR_ENV = "DDPWATCH_BOX_DIR"
MAGIC = b"DDPWBOX1"
RECORD_AT = 64  # the header before it: magic, pid, rank, the main thread's id
RECORD_SIZE = 448  # a call's record: in-call flag, seq, step, length, the call's encoding
RECORD_HEAD = 19  # its fixed part: flag (1 byte), seq (8), step + 1 (8: 0 for none), length (2)
DUMP_AT = 4096  # faulthandler writes from here
READ_LIMIT = 1 << 16  # bytes of a box read at most (a dump of many threads is cut)
NAME = re.compile(r"^[0-9]+-[0-9]+-[0-9a-f]{16}\.box$")
"""A box's file name: ``<rank>-<pid>-<token>.box``; a hello naming anything else is ignored."""

Call = tuple[str, str | None, int | None, str | None, int | None]
"""A call as the box keeps it: op, dtype, element count, reduce op, root."""


def box_pid(name: str) -> int:
    """The pid in a box's file name (one that matches ``NAME``)."""
    return int(name.split("-", 2)[1])


def process_gone(pid: int) -> bool:
    """Whether process ``pid`` no longer exists; another user's counts as there (not ours)."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    except OSError:
        return False
    return False


def box_dir(environ: dict[str, str] | None = None) -> str:
    """The folder boxes are kept in: ``$DDPWATCH_BOX_DIR``, else one per user in the temp
    folder (the reader, on the same host and as the same user, looks in the same one)."""
    env = os.environ if environ is None else environ
    given = env.get(BOX_DIR_ENV)
    if given:
        return given
    return os.path.join(tempfile.gettempdir(), f"ddpwatch-{os.getuid()}")


@dataclass(frozen=True)
class BoxReading:
    """What a box says: whose it is, the last collective entered, and a fatal signal's dump."""

    pid: int
    rank: int
    seq: int  # the last Python-level collective's number (0: none counted)
    call: Call | None  # op, dtype, element count, reduce op, root; None: none entered
    in_call: bool  # still inside it
    step: int | None  # the steps the rank had ended when it entered it
    phase: str | None  # the phase it was in then
    signal: str | None  # the fatal signal faulthandler saw ("SIGABRT"); None: no dump
    stack: str | None  # the main thread's Python stack in the dump
    dump: str | None  # the whole dump, as faulthandler wrote it
    written_at: float  # when the file was last written (the dump's time, where there is one)


_FATAL = {
    "Aborted": "SIGABRT",
    "Segmentation fault": "SIGSEGV",
    "Bus error": "SIGBUS",
    "Floating-point exception": "SIGFPE",
    "Floating point exception": "SIGFPE",
    "Illegal instruction": "SIGILL",
}
_FATAL_LINE = re.compile(r"^Fatal Python error: (.+?)\s*$", re.MULTILINE)
_FRAME = re.compile(r'^\s*File "(.*)", line (\d+) in (.+?)\s*$')
_THREAD = re.compile(r"^(?:Current thread|Thread) (0x[0-9a-f]+)", re.MULTILINE)


def read_box(path: str) -> BoxReading | None:
    """Read a box; None for a file that is not one (or no longer there)."""
    try:
        with open(path, "rb") as f:
            data = f.read(READ_LIMIT)
            written_at = os.fstat(f.fileno()).st_mtime
    except OSError:
        return None
    if len(data) < DUMP_AT or not data.startswith(MAGIC):
        return None
    decoder = msgspec.msgpack.Decoder()
    try:
        size = data[len(MAGIC)]
        pid, rank, main = decoder.decode(data[len(MAGIC) + 1 : len(MAGIC) + 1 + size])
        flag = data[RECORD_AT]
        seq = int.from_bytes(data[RECORD_AT + 1 : RECORD_AT + 9], "little")
        step = int.from_bytes(data[RECORD_AT + 9 : RECORD_AT + 17], "little") - 1
        length = int.from_bytes(data[RECORD_AT + 17 : RECORD_AT + RECORD_HEAD], "little")
        call = phase = None
        if length:
            start = RECORD_AT + RECORD_HEAD
            raw = decoder.decode(data[start : start + length])
            op, dtype, numel, reduce_op, root, phase = (list(raw) + [None] * 6)[:6]
            call = (str(op), dtype, numel, reduce_op, root)
    except (msgspec.DecodeError, TypeError, ValueError):
        return None
    dump = data[DUMP_AT:].decode("utf-8", errors="replace").strip() or None
    signal_name = stack = None
    if dump is not None:
        found = _FATAL_LINE.search(dump)
        if found is None:
            return None  # being written, or not faulthandler's: read again later
        signal_name = _FATAL.get(found.group(1), found.group(1)[:40])
        stack = _thread_stack(dump, int(main) if isinstance(main, int) else 0)
    return BoxReading(
        int(pid),
        int(rank),
        seq,
        call,
        flag == 1,
        step if step >= 0 else None,
        phase if isinstance(phase, str) else None,
        signal_name,
        stack,
        dump,
        written_at,
    )


def _thread_stack(dump: str, main: int) -> str | None:
    """The main thread's frames in a faulthandler dump, else the current thread's, written
    as ``traceback.format_stack`` writes a stack (most recent call last), as the stacks the
    agent sends are."""
    blocks: dict[int, list[str]] = {}
    current = None
    starts = list(_THREAD.finditer(dump))
    for index, found in enumerate(starts):
        end = starts[index + 1].start() if index + 1 < len(starts) else len(dump)
        frames = []
        for line in dump[found.end() : end].splitlines():
            frame = _FRAME.match(line)
            if frame is not None:
                path, number, function = frame.groups()
                frames.append(f'  File "{path}", line {number}, in {function}')
        ident = int(found.group(1), 16)
        blocks[ident] = frames[::-1]
        if found.group(0).startswith("Current"):
            current = ident
    chosen = blocks.get(main) or blocks.get(current if current is not None else -1)
    return "\n".join(chosen) + "\n" if chosen else None
