"""Fail-soft NVML access for the agent, after nvitop's ``libnvml``.

NVML is initialised on first use behind a lock and shut down at exit. Every NVML function is
called through ``Nvml.query``, the one guarded point: it turns any error (no ``pynvml``, no
``libnvidia-ml``, a lost GPU, a function this driver lacks) into None, and a missing library is
logged once. The methods around it only check what ``query`` returned, so none of them raises
either. Nothing here touches CUDA, so it is safe on the agent thread before (or without) the
user's CUDA initialisation.

``Nvml`` takes the ``pynvml`` module as a parameter so tests can hand it a fake GPU.
"""

from __future__ import annotations

import atexit
import contextlib
import logging
import os
import re
import threading
from collections.abc import Iterator, Mapping
from typing import Any

# re-exported: the parser lives where the server can import it without torch or pynvml
from ddpwatch.core.devices import parse_cuda_visible_devices

__all__ = ["Handle", "Nvml", "default", "parse_cuda_visible_devices"]

log = logging.getLogger("ddpwatch")

Handle = Any  # an opaque pynvml device handle
_UNSET: Any = object()
# instance ids are small: a longer number matches no device (and never reaches int())
_LEGACY_MIG = re.compile(r"^MIG-(GPU-[0-9A-Za-z-]+)/([0-9]{1,9})/([0-9]{1,9})$")
NVML_DEVICE_MIG_ENABLE = 1
_PROCESS_QUERIES = ("nvmlDeviceGetComputeRunningProcesses", "nvmlDeviceGetGraphicsRunningProcesses")


def _text(value: Any) -> str | None:
    if value is None:
        return None
    if isinstance(value, bytes):
        return value.decode("utf-8", errors="replace").rstrip("\0") or None
    return str(value) or None


class Nvml:
    """One lazily initialised NVML session; every method answers None (or ``(None, None)``)
    where NVML cannot tell, and none raises."""

    def __init__(self, lib: Any = None, environ: Mapping[str, str] | None = None) -> None:
        self._lib = lib  # None: import pynvml on first use
        self._environ = environ
        self._lock = threading.Lock()
        self._state = "new"  # "new" -> "ready" | "failed"
        self._atexit = False
        self._failed_functions: set[str] = set()

    # session ---------------------------------------------------------------------------------
    def available(self) -> bool:
        """Initialise NVML once; False (and one log line) if it cannot be."""
        if self._state == "new":
            with self._lock:
                if self._state == "new":
                    self._state = self._init()
        return self._state == "ready"

    def _init(self) -> str:
        lib = self._lib
        if lib is None:
            try:
                import pynvml as lib  # type: ignore[no-redef,unused-ignore]
            except Exception as exc:
                log.debug("ddpwatch: NVML unavailable (nvidia-ml-py not importable: %s)", exc)
                return "failed"
            self._lib = lib
        try:
            lib.nvmlInit()
        except Exception as exc:
            self._report_init_failure(exc)
            return "failed"
        if not self._atexit:
            atexit.register(self.shutdown)
            self._atexit = True
        return "ready"

    def _report_init_failure(self, exc: Exception) -> None:
        # On a machine with an NVIDIA driver a missing NVML hides GPU memory and processes: say
        # so. On a CPU-only machine it is expected: keep quiet unless debugging.
        gpu_machine = os.path.exists("/dev/nvidiactl")
        log.log(
            logging.WARNING if gpu_machine else logging.DEBUG,
            "ddpwatch: NVML unavailable (%s: %s); GPU memory and processes will read as null",
            type(exc).__name__,
            exc,
        )

    def shutdown(self) -> None:
        """Release NVML (registered with atexit); the next query initialises it again."""
        with self._lock:
            if self._state != "ready":
                return
            self._state = "new"
            with contextlib.suppress(Exception):
                self._lib.nvmlShutdown()

    def reset_after_fork(self) -> None:
        """A forked child must not inherit a lock held by the parent's other threads."""
        self._lock = threading.Lock()
        self._state = "new"

    def query(self, func: str, *args: Any) -> Any:
        """Call the NVML function named ``func``; None on any error, bytes decoded to str.

        The one guarded point: every NVML call in this module goes through here.
        """
        if not self.available():
            return None
        try:
            value = getattr(self._lib, func)(*args)
        except Exception as exc:
            if func not in self._failed_functions and len(self._failed_functions) < 256:
                self._failed_functions.add(func)
                log.debug("ddpwatch: NVML %s failed: %s", func, exc)
            return None
        if isinstance(value, bytes):
            return _text(value)
        return value

    # handles ---------------------------------------------------------------------------------
    def device_count(self) -> int | None:
        """Physical GPUs NVML sees (all of them, whatever CUDA_VISIBLE_DEVICES says)."""
        count = self.query("nvmlDeviceGetCount")
        return count if isinstance(count, int) and count >= 0 else None

    def handle_by_index(self, index: int) -> Handle | None:
        return self.query("nvmlDeviceGetHandleByIndex", index)

    def _all_handles(self) -> Iterator[Handle]:
        """Every physical GPU, then each one's MIG devices."""
        count = self.device_count() or 0
        for index in range(count):
            handle = self.handle_by_index(index)
            if handle is None:
                continue
            yield handle
            yield from self._mig_handles(handle)

    def _mig_handles(self, handle: Handle) -> Iterator[Handle]:
        mode = self.query("nvmlDeviceGetMigMode", handle)  # [current, pending]
        if not isinstance(mode, (list, tuple)) or not mode or mode[0] != NVML_DEVICE_MIG_ENABLE:
            return
        count = self.query("nvmlDeviceGetMaxMigDeviceCount", handle)
        for mig_index in range(count if isinstance(count, int) else 0):
            mig = self.query("nvmlDeviceGetMigDeviceHandleByIndex", handle, mig_index)
            if mig is not None:
                yield mig

    def handle_by_uuid(self, uuid: str) -> Handle | None:
        """A GPU or MIG device by UUID: full or abbreviated, with or without ``GPU-``/``MIG-``.

        torch reports UUIDs without a prefix; NVML wants ``GPU-`` for GPUs and ``MIG-`` for MIG
        instances, so a bare UUID is tried both ways.
        """
        if not uuid:
            return None
        candidates = [uuid] if uuid[:4] in ("GPU-", "MIG-") else [f"GPU-{uuid}", f"MIG-{uuid}"]
        for candidate in candidates:
            handle = self.query("nvmlDeviceGetHandleByUUID", candidate)
            if handle is not None:
                return handle
        # abbreviated: accept a unique prefix, as CUDA does
        found = [
            h for h in self._all_handles() if any(self._uuid_startswith(h, c) for c in candidates)
        ]
        return found[0] if len(found) == 1 else None

    def _uuid_startswith(self, handle: Handle, prefix: str) -> bool:
        full = self.uuid(handle)
        return full is not None and full.lower().startswith(prefix.lower())

    def handle_by_pci_bus_id(self, bus_id: str) -> Handle | None:
        if not bus_id:
            return None
        return self.query("nvmlDeviceGetHandleByPciBusId", bus_id)

    def device_by_uuid_or_pci(
        self, uuid: str | None = None, pci_bus_id: str | None = None
    ) -> Handle | None:
        """The device by UUID if given and found, else by PCI bus id."""
        handle = self.handle_by_uuid(uuid) if uuid else None
        if handle is None and pci_bus_id:
            handle = self.handle_by_pci_bus_id(pci_bus_id)
        return handle

    def handle_for_cuda_ordinal(
        self, ordinal: int, cuda_visible_devices: Any = _UNSET
    ) -> Handle | None:
        """The device CUDA calls ``cuda:<ordinal>``, honouring ``CUDA_VISIBLE_DEVICES``.

        A fallback for when torch gives no UUID. Integer lists follow NVML's PCI order, which is
        CUDA's only with ``CUDA_DEVICE_ORDER=PCI_BUS_ID`` or identical GPUs (CUDA's default puts
        the fastest first); with mixed models and no PCI order this returns None, not a guess.
        """
        if ordinal < 0:
            return None
        environ = os.environ if self._environ is None else self._environ
        if cuda_visible_devices is _UNSET:
            cuda_visible_devices = environ.get("CUDA_VISIBLE_DEVICES")
        entries = parse_cuda_visible_devices(cuda_visible_devices)
        if entries is None:
            physical: int | str = ordinal
        elif ordinal < len(entries):
            physical = entries[ordinal]
        else:
            return None
        if isinstance(physical, str):
            return self._handle_for_name(physical)
        if environ.get("CUDA_DEVICE_ORDER") != "PCI_BUS_ID" and not self._homogeneous():
            return None
        handle = self.handle_by_index(physical)
        if handle is None:
            return None
        # CUDA shows a MIG-enabled GPU as its first MIG instance
        return next(self._mig_handles(handle), handle)

    def _handle_for_name(self, name: str) -> Handle | None:
        legacy = _LEGACY_MIG.match(name)  # MIG-GPU-<uuid>/<gpu instance>/<compute instance>
        if legacy is None:
            return self.handle_by_uuid(name)
        parent = self.handle_by_uuid(legacy.group(1))
        if parent is None:
            return None
        wanted = (int(legacy.group(2)), int(legacy.group(3)))
        for mig in self._mig_handles(parent):
            gi = self.query("nvmlDeviceGetGpuInstanceId", mig)
            ci = self.query("nvmlDeviceGetComputeInstanceId", mig)
            if (gi, ci) == wanted:
                return mig
        return None

    def _homogeneous(self) -> bool:
        handles = [self.handle_by_index(i) for i in range(self.device_count() or 0)]
        names = {self.name(h) for h in handles}
        return len(names) <= 1 and None not in names

    def visible_device_count(self, cuda_visible_devices: Any = _UNSET) -> int | None:
        """How many devices CUDA would show, without initialising CUDA (None if unknown)."""
        environ = os.environ if self._environ is None else self._environ
        if cuda_visible_devices is _UNSET:
            cuda_visible_devices = environ.get("CUDA_VISIBLE_DEVICES")
        entries = parse_cuda_visible_devices(cuda_visible_devices)
        count = self.device_count()
        if count is None:
            return 0 if entries == [] else None
        if entries is None:
            return count
        if entries and isinstance(entries[0], str):
            visible = 0
            for entry in entries:  # CUDA stops at the first it cannot find
                if self._handle_for_name(str(entry)) is None:
                    break
                visible += 1
            return visible
        visible = 0
        for ordinal in entries:
            if not isinstance(ordinal, int) or ordinal >= count:
                break
            visible += 1
        return visible

    # per-device queries ----------------------------------------------------------------------
    def uuid(self, handle: Handle) -> str | None:
        return _text(self.query("nvmlDeviceGetUUID", handle))

    def name(self, handle: Handle) -> str | None:
        return _text(self.query("nvmlDeviceGetName", handle))

    def index(self, handle: Handle) -> int | None:
        index = self.query("nvmlDeviceGetIndex", handle)
        return index if isinstance(index, int) else None

    def pci_bus_id(self, handle: Handle) -> str | None:
        """``"00000000:3B:00.0"``; a MIG instance reports its parent GPU's."""
        info = self.query("nvmlDeviceGetPciInfo", handle)
        if info is None:
            parent = self.query("nvmlDeviceGetDeviceHandleFromMigDeviceHandle", handle)
            info = self.query("nvmlDeviceGetPciInfo", parent) if parent is not None else None
        return _text(getattr(info, "busId", None)) if info is not None else None

    def memory(self, handle: Handle) -> tuple[int | None, int | None]:
        """Device memory (used, total) in bytes, for every process on the GPU."""
        info = self.query("nvmlDeviceGetMemoryInfo", handle)
        if info is None:
            return None, None
        used, total = getattr(info, "used", None), getattr(info, "total", None)
        return (
            used if isinstance(used, int) else None,
            total if isinstance(total, int) else None,
        )

    def process_pids(self, handle: Handle) -> list[int] | None:
        """PIDs of compute and graphics processes on the device; None if NVML cannot say.

        In a container these are host PIDs, so they may not match ``os.getpid()``.
        """
        pids: list[int] = []
        answered = False
        for func in _PROCESS_QUERIES:
            processes = self.query(func, handle)
            if processes is None:
                continue
            if not isinstance(processes, (list, tuple)):
                return None  # not an answer NVML gives: it cannot say
            answered = True
            for process in processes:
                pid = getattr(process, "pid", None)
                if isinstance(pid, int) and pid not in pids:
                    pids.append(pid)
        return pids if answered else None


_default = Nvml()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default.reset_after_fork)


def default() -> Nvml:
    """The process-wide NVML session the probes use."""
    return _default
