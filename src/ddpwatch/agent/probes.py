"""Which device a rank uses and how much memory it holds, read on the agent thread every beat.

Rules, because this runs inside the user's training process: never initialise CUDA (torch.cuda is
read only once the user's code has initialised it, and torch itself is never imported here),
never synchronise the GPU, never raise, stay cheap (one allocator-stats read and two or three
NVML calls per beat; device properties are cached per index).

CUDA's current device belongs to each host thread: ``torch.cuda.current_device()`` on the agent
thread says nothing about the training thread's ``set_device``. So the training thread records
its device with ``note_current_device()`` (cheap; call it from ``step()``); until it has, the agent
uses the one visible device, or the only device whose allocator holds memory, or says "cuda"
without an index rather than guess ``cuda:0`` for every rank.
"""

from __future__ import annotations

import dataclasses
import os
import sys
import threading
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Protocol

from ddpwatch.agent import nvml as nvml_module
from ddpwatch.agent.nvml import Handle, Nvml


@dataclass
class DeviceInfo:
    """The device fields of ``protocol.Sample``; ``device`` is ``"cuda:1"``, ``"cpu"``, ``"cuda"``
    (CUDA in use, index not known yet) or None (the probe failed)."""

    device: str | None = None
    device_index: int | None = None
    device_name: str | None = None
    device_uuid: str | None = None
    device_pci_bus_id: str | None = None
    device_count: int | None = None

    def as_fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


@dataclass
class MemoryInfo:
    """The memory fields of ``protocol.Sample``: torch's allocator for this process, NVML's view
    of the whole device (every process on it). None wherever unknown, never invented."""

    mem_allocated_bytes: int | None = None
    mem_reserved_bytes: int | None = None
    mem_peak_bytes: int | None = None
    gpu_mem_used_bytes: int | None = None
    gpu_mem_total_bytes: int | None = None
    gpu_pids: list[int] | None = None

    def as_fields(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


class CudaBackend(Protocol):
    """The few torch.cuda calls the probes make; a fake GPU in tests implements the same."""

    def is_initialized(self) -> bool: ...

    def device_count(self) -> int | None:
        """Visible devices without initialising CUDA; None when only NVML could tell."""
        ...

    def current_device(self) -> int | None:
        """The calling thread's current device; only called once CUDA is initialised."""
        ...

    def device_properties(self, index: int) -> Any: ...

    def memory_stats(self, index: int) -> Mapping[str, Any]: ...


class TorchCuda:
    """The real backend: reads ``torch.cuda`` only if the user's process imported torch."""

    @staticmethod
    def _torch() -> Any | None:
        return sys.modules.get("torch")

    def is_initialized(self) -> bool:
        torch = self._torch()
        cuda = getattr(torch, "cuda", None)
        return bool(cuda is not None and cuda.is_initialized())

    def device_count(self) -> int | None:
        torch = self._torch()
        if torch is None:
            return None
        cuda = torch.cuda
        compiled = getattr(cuda, "_is_compiled", None)
        if not (compiled() if callable(compiled) else hasattr(torch._C, "_cuda_getDeviceCount")):
            return 0  # a CPU build sees no device whatever the machine has
        if cuda.is_initialized():
            return int(cuda.device_count())  # cached by torch once initialised
        # Before initialisation torch.cuda.device_count() asks NVML but falls back to
        # cudaGetDeviceCount (cuInit: poisons fork) when NVML fails or sees MIG UUIDs, and
        # it warns on every call. The probes count with their own NVML session instead.
        return None

    def current_device(self) -> int | None:
        return int(self._torch().cuda.current_device())  # type: ignore[union-attr]

    def device_properties(self, index: int) -> Any:
        return self._torch().cuda.get_device_properties(index)  # type: ignore[union-attr]

    def memory_stats(self, index: int) -> Mapping[str, Any]:
        return self._torch().cuda.memory_stats(index)  # type: ignore[union-attr,no-any-return]


@dataclass
class _StaticDevice:
    """What never changes for a CUDA ordinal in this process."""

    name: str | None
    uuid: str | None
    pci_bus_id: str | None
    handle: Handle | None


def _count(value: Any) -> int | None:
    """An allocator counter: a non-negative int (bools and garbage are not)."""
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        return value
    return None


def _pci_from_properties(props: Any) -> str | None:
    """NVML's bus-id format from torch's properties, where this torch exposes the PCI ids."""
    parts = [
        getattr(props, name, None) for name in ("pci_domain_id", "pci_bus_id", "pci_device_id")
    ]
    if all(isinstance(part, int) and part >= 0 for part in parts):
        return f"{parts[0]:08X}:{parts[1]:02X}:{parts[2]:02X}.0"
    return None


def _uuid_from_properties(props: Any) -> str | None:
    """torch's UUID (``str()`` of a ``_CUuuid``: bare ``8-4-4-4-12`` hex), or None."""
    raw = getattr(props, "uuid", None)
    if raw is None:
        return None
    text = str(raw).strip()
    return text or None


class Probes:
    """Device identity and memory for one process; ``cuda`` and ``nvml`` are the test seam."""

    def __init__(
        self,
        cuda: CudaBackend | None = None,
        nvml: Nvml | None = None,
        environ: Mapping[str, str] | None = None,
    ) -> None:
        self.cuda: CudaBackend = cuda if cuda is not None else TorchCuda()
        self.nvml: Nvml = nvml if nvml is not None else nvml_module.default()
        self._environ = environ
        self._static: dict[int, _StaticDevice] = {}
        self._nvml_counts: dict[str | None, int | None] = {}
        self._noted: int | None = None

    def _env(self) -> Mapping[str, str]:
        return os.environ if self._environ is None else self._environ

    # training thread -------------------------------------------------------------------------
    def note_current_device(self) -> int | None:
        """Record the calling (training) thread's CUDA device; cheap, no CUDA init, no sync."""
        try:
            if not self.cuda.is_initialized():
                return None
            index = self.cuda.current_device()
            if isinstance(index, int) and index >= 0:
                self._noted = index
            return self._noted
        except Exception:
            return None

    # agent thread ----------------------------------------------------------------------------
    def device_info(self, index: int | None = None) -> DeviceInfo:
        """The device this rank uses (re-read every call: it changes with ``set_device``)."""
        try:
            return self._device_info(index)
        except Exception:
            return DeviceInfo()

    def _device_info(self, index: int | None) -> DeviceInfo:
        initialised = self.cuda.is_initialized()
        count = self._device_count()
        if not initialised:
            return DeviceInfo(device="cpu", device_count=count)
        chosen = self._pick_index(index, count)
        if chosen is None:
            return DeviceInfo(device="cuda", device_count=count)
        static = self._static_for(chosen)
        return DeviceInfo(
            device=f"cuda:{chosen}",
            device_index=chosen,
            device_name=static.name,
            device_uuid=static.uuid,
            device_pci_bus_id=static.pci_bus_id,
            device_count=count,
        )

    def _device_count(self) -> int | None:
        count = self.cuda.device_count()
        if count is not None:
            return count
        visible = self._env().get("CUDA_VISIBLE_DEVICES")
        if visible not in self._nvml_counts:  # physical devices do not come and go
            self._nvml_counts[visible] = self.nvml.visible_device_count(visible)
        return self._nvml_counts[visible]

    def _pick_index(self, index: int | None, count: int | None) -> int | None:
        if isinstance(index, int) and index >= 0:
            return index
        if threading.current_thread() is threading.main_thread():
            return self.cuda.current_device()  # the calling thread is the training thread
        if self._noted is not None:
            return self._noted
        if count == 1:
            return 0
        holding = []
        for candidate in range(count or 0):
            stats = self._memory_stats(candidate)
            if (_count(stats.get("reserved_bytes.all.current")) or 0) > 0:
                holding.append(candidate)
        return holding[0] if len(holding) == 1 else None

    def _memory_stats(self, index: int) -> Mapping[str, Any]:
        try:
            stats = self.cuda.memory_stats(index)
        except Exception:
            return {}
        return stats if isinstance(stats, Mapping) else {}

    def _static_for(self, index: int) -> _StaticDevice:
        cached = self._static.get(index)
        if cached is not None:
            return cached
        try:
            props = self.cuda.device_properties(index)
        except Exception:
            props = None
        raw_uuid = _uuid_from_properties(props)
        if raw_uuid is not None:
            # torch's UUID names the device exactly; the CUDA_VISIBLE_DEVICES mapping is only a
            # fallback, never a second opinion that could name a different GPU.
            handle = self.nvml.handle_by_uuid(raw_uuid)
        else:
            visible = self._env().get("CUDA_VISIBLE_DEVICES")
            handle = self.nvml.handle_for_cuda_ordinal(index, visible)
        uuid = self.nvml.uuid(handle) if handle is not None else None
        if uuid is None and raw_uuid is not None:
            uuid = raw_uuid if raw_uuid[:4] in ("GPU-", "MIG-") else f"GPU-{raw_uuid}"
        name = getattr(props, "name", None)
        if not isinstance(name, str) or not name:
            name = self.nvml.name(handle) if handle is not None else None
        pci = self.nvml.pci_bus_id(handle) if handle is not None else None
        if pci is None and props is not None:
            pci = _pci_from_properties(props)
        static = _StaticDevice(name=name, uuid=uuid, pci_bus_id=pci, handle=handle)
        if props is not None:  # a failed read is retried next beat
            self._static[index] = static
        return static

    def memory_info(self, device: DeviceInfo) -> MemoryInfo:
        """Allocator counters (one ``memory_stats`` read) and NVML's used/total/processes."""
        try:
            return self._memory_info(device)
        except Exception:
            return MemoryInfo()

    def _memory_info(self, device: DeviceInfo) -> MemoryInfo:
        index = device.device_index
        if index is None or not (device.device or "").startswith("cuda"):
            return MemoryInfo()
        if not self.cuda.is_initialized():
            return MemoryInfo()
        stats = self._memory_stats(index)
        handle = self._static_for(index).handle
        used, total = self.nvml.memory(handle) if handle is not None else (None, None)
        return MemoryInfo(
            mem_allocated_bytes=_count(stats.get("allocated_bytes.all.current")),
            mem_reserved_bytes=_count(stats.get("reserved_bytes.all.current")),
            mem_peak_bytes=_count(stats.get("allocated_bytes.all.peak")),
            gpu_mem_used_bytes=used,
            gpu_mem_total_bytes=total,
            gpu_pids=self.nvml.process_pids(handle) if handle is not None else None,
        )

    def reset_after_fork(self) -> None:
        """A forked child has its own CUDA state and NVML session: forget the parent's."""
        self._static.clear()
        self._nvml_counts.clear()
        self._noted = None


_default = Probes()
if hasattr(os, "register_at_fork"):
    os.register_at_fork(after_in_child=_default.reset_after_fork)


def default() -> Probes:
    """The process-wide probes the watcher uses."""
    return _default


def note_current_device() -> int | None:
    """Call on the training thread (e.g. in ``step()``) so the agent knows its CUDA device."""
    return _default.note_current_device()


def device_info(index: int | None = None) -> DeviceInfo:
    """This rank's device; ``index`` overrides the detected CUDA ordinal."""
    return _default.device_info(index)


def memory_info(device: DeviceInfo) -> MemoryInfo:
    """Memory on ``device`` (all None on CPU)."""
    return _default.memory_info(device)
