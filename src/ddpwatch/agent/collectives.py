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
from collections.abc import Callable
from typing import Any

from ddpwatch.agent.progress import Progress
from ddpwatch.protocol import Collective

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
FR_ENV = "TORCH_FR_BUFFER_SIZE"
FR_DEFAULT_SIZE = "2000"
FR_ON_BY_DEFAULT = (2, 13)  # torch releases from this one keep 2000 entries without the variable


class CollectiveWrappers:
    """Replaces ``torch.distributed.<op>`` with timing wrappers; ``restore`` undoes it."""

    def __init__(self, progress: Progress) -> None:
        self._progress = progress
        self._originals: dict[str, Callable[..., Any]] = {}

    def install(self, dist: Any) -> None:
        for name in WRAPPED:
            original = getattr(dist, name, None)
            if original is None or getattr(original, "__ddpwatch__", False):
                continue
            self._originals[name] = original
            setattr(dist, name, self._wrap(name, original))

    def restore(self, dist: Any) -> None:
        for name, original in self._originals.items():
            if getattr(getattr(dist, name, None), "__ddpwatch__", False):
                setattr(dist, name, original)
        self._originals.clear()

    def _wrap(self, name: str, original: Callable[..., Any]) -> Callable[..., Any]:
        progress = self._progress

        @functools.wraps(original)
        def wrapper(*args: Any, **kwargs: Any) -> Any:
            progress.enter_collective(name)
            try:
                return original(*args, **kwargs)
            finally:
                progress.exit_collective()

        wrapper.__ddpwatch__ = True  # type: ignore[attr-defined]
        return wrapper


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
    """Reads the oldest collective still in flight from the c10d flight recorder."""

    def __init__(self) -> None:
        self._dump: Callable[..., Any] | None = None
        try:
            from torch._C._distributed_c10d import _dump_fr_trace_json

            self._dump = _dump_fr_trace_json
        except (ImportError, AttributeError):
            log.debug("ddpwatch: flight recorder not available in this torch")

    @property
    def available(self) -> bool:
        return self._dump is not None

    def in_flight(self) -> Collective | None:
        """The oldest active collective, or None when nothing is in flight or FR is unusable."""
        if self._dump is None:
            return None
        try:
            raw = self._dump(True, True)  # include collectives, only active ones
            entries = json.loads(raw).get("entries") or []
        except Exception as exc:  # private API: any failure just turns this source off
            log.debug("ddpwatch: flight recorder unreadable (%s); using wrappers only", exc)
            self._dump = None
            return None
        return oldest_active(entries, time.time())


def oldest_active(entries: list[dict[str, Any]], now: float) -> Collective | None:
    """Pick the collective a rank is blocked in from flight-recorder entries."""
    active = [
        e
        for e in entries
        if e.get("state") in ("scheduled", "started")
        and not e.get("is_p2p")
        and not e.get("retired")
    ]
    if not active:
        return None
    entry = min(active, key=lambda e: (e.get("time_created_ns", 0), e.get("collective_seq_id", 0)))
    name = str(entry.get("profiling_name", "collective"))
    op = name.split(":", 1)[-1]
    group = entry.get("process_group") or ["0"]
    if str(group[0]) != "0":
        op = f"{op}[pg {group[0]}]"
    created = entry.get("time_created_ns") or 0
    since = max(0.0, now - created / 1e9) if created else 0.0
    return Collective(op=op, seq=entry.get("collective_seq_id"), since_s=since)
