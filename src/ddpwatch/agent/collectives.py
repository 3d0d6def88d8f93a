"""Seeing which collective a rank waits in.

Two sources: wrappers around the Python-level ``torch.distributed`` functions
(cheap, always there), and the c10d flight recorder, which also sees what runs
in C++, such as DDP's gradient all-reduce. The flight recorder API is private,
so every use of it is guarded and its absence only narrows the view.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import time
from collections.abc import Callable, Iterable
from typing import Any

from ddpwatch.agent.progress import Progress
from ddpwatch.core.protocol import Collective
from ddpwatch.core.vocabulary import CollectiveSource

log = logging.getLogger("ddpwatch")

WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "broadcast",
    "broadcast_object_list",
    "reduce",
    "gather",
    "gather_object",
    "scatter",
    "scatter_object_list",
    "all_to_all",
    "all_to_all_single",
    "barrier",
    "monitored_barrier",
)
CONTRIBUTED = {
    "all_reduce": (0, "tensor"),
    "broadcast": (0, "tensor"),
    "reduce": (0, "tensor"),
    "gather": (0, "tensor"),
    "scatter": (0, "tensor"),
    "all_gather": (1, "tensor"),
    "all_gather_into_tensor": (1, "input_tensor"),
    "reduce_scatter_tensor": (1, "input"),
    "all_to_all_single": (1, "input"),
}
"""Where each wrapped function takes the tensor this rank contributes (position, keyword):
its shape and dtype tell a size mismatch between ranks."""
REDUCE_OP_AT = {
    "all_reduce": 1,
    "reduce": 2,
    "reduce_scatter": 2,
    "reduce_scatter_tensor": 2,
}
"""Where each wrapped function takes its reduce op (position; keyword ``op``), as torch 2.13
declares them; absent, torch's default: ``SUM``."""
ROOT_AT = {
    "broadcast": (1, "src"),
    "broadcast_object_list": (1, "src"),
    "scatter": (2, "src"),
    "scatter_object_list": (2, "src"),
    "reduce": (1, "dst"),
    "gather": (2, "dst"),
    "gather_object": (2, "dst"),
}
"""Where each wrapped function takes its root, the rank it sends from or gathers to (position,
keyword; else ``group_<keyword>``, the root's rank in the group): every rank must pass the
same one. Under gloo (torch 2.13, measured) a broadcast whose ``src`` differs on one rank
hangs the ranks it leaves without a partner, while those the true root reached go on; NCCL's
reduce with a ``dst`` that differs on one rank finishes, with later work hanging
(pytorch/pytorch#39706)."""
PEER_AT = {"send": (1, "dst"), "recv": (1, "src")}
"""Where the blocking point-to-point ops take their peer (position, keyword; else
``group_<keyword>``, its rank in the group) and, at position 3 or keyword ``tag``, their tag."""
POSTED_AT = {"isend": (1, "dst"), "irecv": (1, "src")}
"""The same for the ops that post a request and return (``isend``, ``irecv``): wrapped by
``PostedP2P``, which torch still takes for its own function (``P2POp``'s checks)."""
FR_ENV = "TORCH_FR_BUFFER_SIZE"
FR_DEFAULT_SIZE = "2000"
FR_ON_BY_DEFAULT = (2, 13)  # torch releases from this one keep 2000 entries without the variable


class CollectiveWrappers:
    """Replaces ``torch.distributed.<op>`` with timing wrappers; ``restore`` undoes it."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._originals: dict[str, Callable[..., Any]] = {}
        self._dist: Any = None

    def _world_group(self) -> Any:
        """The default group object (a call passing it explicitly is on the default group)."""
        try:
            return self._dist.group.WORLD
        except Exception:
            return None

    def install(self, dist: Any) -> None:
        self._dist = dist
        for name in (*WRAPPED, *PEER_AT, *POSTED_AT, "batch_isend_irecv"):
            original = getattr(dist, name, None)
            if original is None or getattr(original, "__ddpwatch__", False):
                continue
            self._originals[name] = original
            wrapper: Callable[..., Any]
            if name in PEER_AT:
                wrapper = self._wrap_p2p(name, original)
            elif name in POSTED_AT:
                wrapper = PostedP2P(
                    name, original, self._progress, self._global_rank, self._world_group
                )
            elif name == "batch_isend_irecv":
                wrapper = self._wrap_batch(original)
            else:
                wrapper = self._wrap(name, original)
            setattr(dist, name, wrapper)

    def restore(self, dist: Any) -> None:
        for name, original in self._originals.items():
            if getattr(getattr(dist, name, None), "__ddpwatch__", False):
                setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, torch_collective: Callable[..., Any]) -> Callable[..., Any]:
        progress = self._progress
        world = self._world_group
        index, keyword = CONTRIBUTED.get(name, (-1, ""))
        op_at = REDUCE_OP_AT.get(name, -1)
        root_at, root_keyword = ROOT_AT.get(name, (-1, ""))
        in_group = f"group_{root_keyword}"

        # Its name and its one call line appear in every traceback through a collective, so
        # both say what it is: torch has no hook run on entering a Python-level collective
        # (process-group completion hooks run after it, and only under NCCL). The arguments
        # are only read here (an index or a dict look-up each); the publisher names them.
        @functools.wraps(torch_collective)
        def ddpwatch_passthrough(*args: Any, **kwargs: Any) -> Any:
            group = kwargs.get("group")
            given = len(args)
            tensor = args[index] if 0 <= index < given else kwargs.get(keyword)
            reduce_op = None
            if op_at >= 0:
                reduce_op = args[op_at] if op_at < given else kwargs.get("op")
            root = None
            if root_at >= 0:
                root = args[root_at] if root_at < given else kwargs.get(root_keyword)
                if root is None:
                    root = kwargs.get(in_group)
            counted = group is None or group is world()
            with _Recorded(progress, name, tensor, counted, reduce_op, root):
                return torch_collective(*args, **kwargs)  # ddpwatch only records the call

        ddpwatch_passthrough.__ddpwatch__ = True  # type: ignore[attr-defined]
        return ddpwatch_passthrough

    def _global_rank(self, group: Any, group_peer: Any) -> Any:
        """A peer given by its rank in ``group``, as the job's rank (None: unknown)."""
        try:
            return None if group_peer is None else self._dist.get_global_rank(group, group_peer)
        except Exception:
            return None

    def _wrap_p2p(self, name: str, torch_p2p: Callable[..., Any]) -> Callable[..., Any]:
        """A blocking ``send`` or ``recv``: in flight with its peer and tag while it runs, not
        counted (point-to-point calls are no collective every rank makes)."""
        progress = self._progress
        at, keyword = PEER_AT[name]
        in_group = f"group_{keyword}"
        world = self._world_group
        global_rank = self._global_rank

        @functools.wraps(torch_p2p)
        def ddpwatch_passthrough(*args: Any, **kwargs: Any) -> Any:
            given = len(args)
            peer = args[at] if at < given else kwargs.get(keyword)
            group = args[2] if given > 2 else kwargs.get("group")
            if peer is None and group is not None:
                peer = global_rank(group, kwargs.get(in_group))
            tag = args[3] if given > 3 else kwargs.get("tag", 0)
            progress.enter_p2p(name, peer, tag, None if group is world() else group)
            failed = True
            try:
                done = torch_p2p(*args, **kwargs)  # ddpwatch only records the call
                failed = False
                return done
            finally:
                progress.exit_collective(failed=failed)

        ddpwatch_passthrough.__ddpwatch__ = True  # type: ignore[attr-defined]
        return ddpwatch_passthrough

    def _wrap_batch(self, torch_batch: Callable[..., Any]) -> Callable[..., Any]:
        """``batch_isend_irecv``: its ops, each with its peer, tag and the request it returned,
        so the publisher can tell one still pending (``Progress.p2p_batch``). The requests
        are held weakly: the tensors they keep are the user's to free."""
        progress = self._progress
        world = self._world_group
        originals = self._originals

        @functools.wraps(torch_batch)
        def ddpwatch_passthrough(p2p_op_list: Any, *args: Any, **kwargs: Any) -> Any:
            names = []
            try:
                for op in p2p_op_list:
                    if isinstance(op.op, PostedP2P):  # torch asks ``op.op is isend``
                        op.op = op.op.__wrapped__
                    names.append("isend" if op.op is originals.get("isend") else "irecv")
                group = p2p_op_list[0].group
                progress.count_p2p(None if group is world() else group, len(p2p_op_list))
            except Exception:  # not a list of P2POp: torch says so, not ddpwatch
                pass
            works = torch_batch(p2p_op_list, *args, **kwargs)  # ddpwatch only records the call
            try:
                progress.note_p2p_batch(
                    [(name, op.peer, op.tag) for name, op in zip(names, p2p_op_list, strict=True)],
                    works,
                )
            except Exception:  # not a list of P2POp as torch 2.13 builds them: not recorded
                pass
            return works

        ddpwatch_passthrough.__ddpwatch__ = True  # type: ignore[attr-defined]
        return ddpwatch_passthrough


class PostedP2P:
    """``isend`` or ``irecv``, recorded: each request it returns joins the ones the rank
    posted since it last moved (``Progress.note_p2p_posted``; Megatron posts its sends and
    receives one by one, then waits for them all), reported once one stays pending while
    the rank waits, as a ``batch_isend_irecv``'s are.

    A plain function would break torch: ``P2POp`` accepts only ``op in [isend, irecv]``, so
    this object equals (and hashes as) the function it wraps; ``batch_isend_irecv`` asks
    ``op.op is isend``, so its wrapper hands torch the function itself, and a batch made
    without it (torch's own, imported before ``attach``) calls this one with the receive's
    ``group_src`` for a send, which is taken as ``group_dst``."""

    __ddpwatch__ = True

    def __init__(
        self,
        name: str,
        original: Callable[..., Any],
        progress: Progress,
        global_rank: Callable[[Any, Any], Any],
        world: Callable[[], Any],
    ) -> None:
        functools.update_wrapper(self, original)
        self.__wrapped__: Callable[..., Any] = original
        self._name = name
        self._at, self._keyword = POSTED_AT[name]
        self._other = "group_src" if name == "isend" else "group_dst"
        self._progress = progress
        self._global_rank = global_rank
        self._world = world

    def __eq__(self, other: object) -> bool:
        return other is self or other is self.__wrapped__

    def __hash__(self) -> int:
        return hash(self.__wrapped__)

    def __repr__(self) -> str:
        return f"<ddpwatch-recorded {self.__wrapped__!r}>"

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        if self._other in kwargs and f"group_{self._keyword}" not in kwargs:
            kwargs[f"group_{self._keyword}"] = kwargs.pop(self._other)
        given = len(args)
        peer = args[self._at] if self._at < given else kwargs.get(self._keyword)
        group = args[2] if given > 2 else kwargs.get("group")
        if peer is None and group is not None:
            peer = self._global_rank(group, kwargs.get(f"group_{self._keyword}"))
        tag = args[3] if given > 3 else kwargs.get("tag", 0)
        progress = self._progress
        group = None if group is self._world() else group
        progress.count_p2p(group)
        work = self.__wrapped__(*args, **kwargs)  # ddpwatch only records the call
        if work is not None:
            try:
                progress.note_p2p_posted(self._name, peer, tag, work)
            except Exception:  # a request that cannot be referenced weakly: not recorded
                pass
        return work


class _Recorded:
    """Enters one collective in ``Progress`` and leaves it, keeping whether it failed (a plain
    class: no generator frame of its own, and cheap on every collective)."""

    __slots__ = ("_counted", "_op", "_progress", "_reduce_op", "_root", "_tensor")

    def __init__(
        self,
        progress: Progress,
        op: str,
        tensor: Any,
        counted: bool,
        reduce_op: Any = None,
        root: Any = None,
    ) -> None:
        self._progress, self._op, self._tensor, self._counted = progress, op, tensor, counted
        self._reduce_op, self._root = reduce_op, root

    def __enter__(self) -> None:
        self._progress.enter_collective(
            self._op, self._tensor, self._counted, self._reduce_op, self._root
        )

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self._progress.exit_collective(failed=kind is not None)


def ensure_flight_recorder(torch_version: str, environ: dict[str, str] | None = None) -> None:
    """Turn the flight recorder on where this torch keeps it off, before the group exists.

    Follows torchtitan's rule for environment defaults: set only what is unset,
    and say so when the user's own choice leaves ddpwatch with less to see.
    """
    env = os.environ if environ is None else environ
    current = env.get(FR_ENV, env.get("TORCH_NCCL_TRACE_BUFFER_SIZE"))
    if current is None:
        if _version_tuple(torch_version) < FR_ON_BY_DEFAULT:
            env[FR_ENV] = FR_DEFAULT_SIZE
            log.info(
                "ddpwatch: set %s=%s so collectives run in C++ are visible", FR_ENV, FR_DEFAULT_SIZE
            )
    elif current.strip() in ("0", ""):
        log.warning(
            "ddpwatch: %s=%s disables the flight recorder; DDP's gradient all-reduce "
            "will not be visible, only Python-level collectives",
            FR_ENV,
            current,
        )


def _version_tuple(version: str) -> tuple[int, int]:
    parts = version.split("+")[0].split(".")
    try:
        return int(parts[0]), int(parts[1])
    except (IndexError, ValueError):
        return (0, 0)


class FlightRecorder:
    """Reads the collective a rank is blocked in from the c10d flight recorder.

    Cheap first: every heartbeat reads only the per-group status (a few hundred
    bytes, microseconds). Only when the same collective is still pending at the
    next heartbeat does it read the entries, once per stuck collective: with gloo
    "only active" filters nothing, and a full recorder is about 1 MB of JSON whose
    parsing would hold the GIL for tens of milliseconds every heartbeat.
    """

    def __init__(self) -> None:
        self._dump: Callable[..., Any] | None = None
        self._pending: tuple[str, int] | None = None  # (group, seq) pending at the last look
        self._found: tuple[tuple[str, int], str, float] | None = None  # key, op, created (unix s)
        try:
            from torch._C._distributed_c10d import (  # type: ignore[attr-defined]
                _dump_fr_trace_json,  # private: guarded, with a fallback
            )

            self._dump = _dump_fr_trace_json
        except (ImportError, AttributeError):
            log.debug("ddpwatch: flight recorder not available in this torch")

    def read(
        self, p2p: dict[str, int] | None = None
    ) -> tuple[Collective | None, dict[str, int] | None]:
        """One status read per heartbeat: the oldest collective still pending since the last
        heartbeat (else None), and the last enqueued sequence number of every group.

        ``p2p``: the point-to-point ops this rank posted per group, where the backend counts
        them in the group's sequence (gloo, measured: 3 sends and 2 all-reduces read 5, the
        recorder's entries numbering the all-reduces 1 and 2): taken off, so that a rank that
        sends and one that does not number the same collective alike."""
        if self._dump is None:
            return None, None
        try:
            pg_status = json.loads(self._dump(False, True)).get("pg_status") or {}
            if p2p:
                pg_status = without_p2p(pg_status, p2p)
            enqueued = enqueued_counts(pg_status, member_groups())
            pending = first_pending(pg_status)
            if pending is None or pending != self._pending:
                self._pending = pending  # new, or nothing: look again next heartbeat
                return None, enqueued
            if self._found is None or self._found[0] != pending:
                self._found = self._describe(pending)
        except Exception as exc:  # private API: any failure just turns this source off
            log.debug("ddpwatch: flight recorder unreadable (%s); using wrappers only", exc)
            self._dump = None
            return None, None
        _, op, created = self._found
        group, seq = pending
        since = max(0.0, time.time() - created) if created else 0.0
        name = op if group == "0" else f"{op}[pg {group}]"
        found = Collective(op=name, seq=seq, since_s=since, source=CollectiveSource.FR, group=group)
        return found, enqueued

    def _describe(self, key: tuple[str, int]) -> tuple[tuple[str, int], str, float]:
        """The op name and creation time of one pending collective (one full read)."""
        assert self._dump is not None
        entries = json.loads(self._dump(True, True)).get("entries") or []
        group, seq = key
        for entry in entries:
            in_group = str((entry.get("process_group") or ["0"])[0]) == group
            if in_group and entry.get("collective_seq_id") == seq and not entry.get("is_p2p"):
                name = str(entry.get("profiling_name", "collective")).split(":", 1)[-1]
                return key, name, (entry.get("time_created_ns") or 0) / 1e9
        return key, "collective", 0.0


def without_p2p(pg_status: dict[str, Any], p2p: dict[str, int]) -> dict[str, Any]:
    """``pg_status`` with ``p2p[group]`` point-to-point ops taken off each group's enqueued
    and completed counts (never below -1, "none yet"). A send or receive still pending makes
    the completed count one short: the Python-level op in flight says where the rank is."""
    fixed = dict(pg_status)
    for group, ops in p2p.items():
        status = pg_status.get(group)
        if not ops or not isinstance(status, dict):
            continue
        adjusted = dict(status)
        for key in ("last_enqueued_collective", "last_completed_collective"):
            try:
                adjusted[key] = max(-1, int(status.get(key, -1)) - ops)
            except (TypeError, ValueError):
                continue
        fixed[group] = adjusted
    return fixed


def first_pending(pg_status: dict[str, Any]) -> tuple[str, int] | None:
    """(group, seq) of the first collective enqueued but not completed; the default group
    first. Sequence numbers start at 1; a group with none completed says -1."""
    pending = []
    for group, status in pg_status.items():
        try:
            completed = int(status.get("last_completed_collective", -1))
            enqueued = int(status.get("last_enqueued_collective", -1))
        except (TypeError, ValueError, AttributeError):
            continue
        if enqueued > completed:
            pending.append((str(group) != "0", str(group), max(completed, 0) + 1))
    return min(pending)[1:] if pending else None


def enqueued_counts(pg_status: dict[str, Any], members: Iterable[str] = ()) -> dict[str, int]:
    """The last collective each process group has enqueued: how far this rank has got. A
    group of ``members`` (the groups this rank belongs to) that the recorder does not list
    yet has enqueued none: 0, so that a member that has not reached a subgroup's first
    collective is told apart from a rank that is not in that group (which sends nothing)."""
    counts = {str(group): 0 for group in members}
    for group, status in pg_status.items():
        try:
            counts[str(group)] = int(status.get("last_enqueued_collective", -1))
        except (TypeError, ValueError, AttributeError):
            continue
    return counts


def member_groups() -> list[str]:
    """The names of the process groups this rank is a member of (torch keeps none for a
    group a rank is not in); none when torch's private registry is not there."""
    try:
        from torch.distributed import distributed_c10d

        return [str(name) for name in distributed_c10d._world.pg_names.values()]
    except Exception:  # private: any change in torch turns this off
        return []


def pg_name(group: Any) -> str | None:
    """The flight recorder's name for a process group object (the default group's is "0");
    None when torch's private registry does not know it."""
    try:
        from torch.distributed import distributed_c10d

        name = distributed_c10d._world.pg_names.get(group)
        return None if name is None else str(name)
    except Exception:  # private: any change in torch turns this off
        return None
