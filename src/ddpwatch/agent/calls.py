"""What each rank's Python-level collectives were called with, window by window.

The training thread keeps, between two marks (every ``MARK_EVERY``-th step), each default-group
call as it was given: op, dtype, element count, reduce op and root (``Progress.calls``: one
tuple and one append per collective). This module, on the publisher thread, turns each closed
window into a digest that compares across ranks, and the latest window's distinct calls into
words the server can quote. Ranks that call the same number of collectives with another root
or dtype differ here and nowhere else while the backend runs on: gloo completes an all_reduce
whose reduce op differs on one rank (measured: mixed values, no error), NCCL an all_reduce whose
dtype differs (pytorch/pytorch#150248) or a reduce whose ``dst`` does (pytorch/pytorch#39706).
A broadcast whose ``src`` differs hangs under gloo (torch 2.13, measured): a rank's last call
before the collective it is in (``Collective.before``, from ``call``) lets the ranks that got
past it say how they called it.
"""

from __future__ import annotations

import zlib
from typing import Any

from ddpwatch.agent.progress import MARKS_KEPT, Progress, reduce_op_name, root_number
from ddpwatch.core.protocol import CallSeen, CallWindow

WINDOW_KINDS = 8
"""Distinct calls described for the latest window: most loops make a handful a step."""
EARLIER_SENT = 3
"""Windows closed before the latest that one heartbeat describes at most (the server keeps
the latest four): a step faster than a heartbeat's eighth closes more, and the marks the
ranks first differ at are the latest they share."""
UNSIZED = frozenset({"all_gather", "all_to_all", "all_to_all_single"})
"""Collectives whose ranks may pass tensors of different sizes (torch allows uneven all_gather
and split sizes): their element count is left out of digests and descriptions."""

Call = tuple[str, str | None, int | None, str | None, int | None]
"""A call as it compares across ranks: op, dtype name, element count, reduce op, root."""


class CallDigests:
    """Reads ``Progress.windows`` from the publisher thread: each closed window's digest
    (worked out once: a window is never written again once closed) and the latest one's
    distinct calls."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._done: dict[tuple[int, int], tuple[int, CallWindow]] = {}
        """By (step, start count): each closed window's digest and description."""
        self._dtypes: dict[Any, str | None] = {}
        self._read_up_to = -1
        """The step of the latest window the previous ``read`` returned."""

    def read(
        self,
    ) -> tuple[list[tuple[int, int]] | None, CallWindow | None, list[CallWindow] | None]:
        """(step, digest) for the windows still kept, the latest window's calls, and those of
        the windows closed since the previous read before the latest (oldest first; None for
        none): at more than one mark a heartbeat, the server is told every window, so the
        ranks' descriptions meet at the mark where their digests first differ. (None, None,
        None) while the rank made no Python-level collective on the default group."""
        progress = self._progress
        if not progress.collective_seq:
            return None, None, None  # nothing to compare (DDP's own all-reduce runs in C++)
        windows = list(progress.windows)
        if not windows:
            return None, None, None
        done = self._done
        digests = []
        for step, start, calls in windows:
            found = done.get((step, start))
            if found is None:
                found = done[step, start] = self._digest(step, start, calls)
            digests.append((step, found[0]))
        if len(done) > MARKS_KEPT:
            kept = {(step, start) for step, start, _ in windows}
            for key in [key for key in done if key not in kept]:
                del done[key]
        step, start, _ = windows[-1]
        latest = done[step, start][1]
        earlier = [
            described
            for s, begun, _ in windows[:-1]
            if s > self._read_up_to and (described := done[s, begun][1]).calls
        ]
        self._read_up_to = step
        return digests, latest if latest.calls else None, earlier[-EARLIER_SENT:] or None

    def call(self, seq: int) -> CallSeen | None:
        """The default-group call numbered ``seq``, if still kept: in this window's calls,
        else the window before's; None past ``WINDOW_CALLS`` or further back. A call, once
        made, never changes; each list is read with the count it started at, as one."""
        if seq < 1:
            return None
        progress = self._progress
        found = None
        start, calls = progress.window  # the list and its start, swapped as one at a mark
        if start < seq <= start + len(calls):
            found = calls[seq - start - 1]
        else:
            windows = progress.windows
            if windows:
                _, start, calls = windows[-1]
                if start < seq <= start + len(calls):
                    found = calls[seq - start - 1]
        if found is None:
            return None
        op, dtype, numel, reduce_op, root = self.words(found)
        return CallSeen(seq=seq, op=op, dtype=dtype, numel=numel, reduce_op=reduce_op, root=root)

    def words(self, raw: tuple[Any, ...]) -> Call:
        """A call as kept on the training thread, in the terms that compare across ranks:
        ``exact``'s, less the element count of an op whose sizes may differ by rank."""
        op, dtype, numel, reduce_op, root = self.exact(raw)
        return op, dtype, None if op in UNSIZED else numel, reduce_op, root

    def exact(self, raw: tuple[Any, ...]) -> Call:
        """A call in words, its element count kept whatever the op: what the rank passed,
        as a collective in flight says it (the black box's)."""
        op, dtype, numel, reduce_op, root = raw
        return (
            op,
            self._dtype(dtype),
            None if numel is None else int(numel),
            reduce_op_name(op, reduce_op),
            root_number(root),
        )

    def _digest(self, step: int, start: int, raw: list[Any]) -> tuple[int, CallWindow]:
        """One window: a CRC-32 over its start count and its calls in order (stable across
        processes, unlike ``hash``), and its first ``WINDOW_KINDS`` distinct calls."""
        digest = zlib.crc32(str(start).encode())
        seen: dict[Call, int] = {}
        for index, kept in enumerate(raw):
            call = self.words(kept)
            digest = zlib.crc32(repr(call).encode(), digest)
            if call not in seen and len(seen) < WINDOW_KINDS:
                seen[call] = start + index + 1
        described = [
            CallSeen(seq=seq, op=op, dtype=dtype, numel=numel, reduce_op=reduce_op, root=root)
            for (op, dtype, numel, reduce_op, root), seq in seen.items()
        ]
        return digest, CallWindow(step=step, calls=described)

    def _dtype(self, dtype: Any) -> str | None:
        """``float32`` for ``torch.float32``, once per dtype."""
        if dtype is None:
            return None
        name = self._dtypes.get(dtype)
        if name is None:
            name = self._dtypes[dtype] = str(dtype).removeprefix("torch.")
        return name
