"""Which GPU each rank is on, kept as identities arrive: the device rules (two ranks on one
GPU, the global rank used as the CUDA index, a GPU other than cuda:<local rank>, a process of
another job on a rank's GPU) read only the ranks this index flags, not every rank every time
they run.

A rank's identity changes a few times in its life (its hello, its ``set_device``), while
the rules rerun on every new generation (a checkpoint, an exit): at 131,072 ranks a pass over
every record cost them 0.1-0.4 s a run. Here each identity costs a few dictionary updates,
and a healthy job (every rank on its own GPU, at cuda:<local rank>) flags nobody.
"""

from __future__ import annotations

from collections.abc import Iterable
from functools import lru_cache

from ddpwatch.core.devices import parse_cuda_visible_devices
from ddpwatch.state.records import RankRecord

DeviceKey = tuple[object, ...]


def device_key(record: RankRecord) -> DeviceKey | None:
    """The physical GPU a rank uses, as far as can be told, or None for CPU ranks."""
    if not record.host:
        return None
    if record.device_uuid:
        return (record.host, "uuid", record.device_uuid)
    device = record.device
    if not device or not device.startswith("cuda"):
        return None
    return (record.host, *_physical_gpu(device, record.device_index, record.cuda_visible_devices))


@lru_cache(maxsize=4096)
def _physical_gpu(device: str, index: int | None, visible_devices: str | None) -> tuple[str, str]:
    """Map a CUDA ordinal through CUDA_VISIBLE_DEVICES (cuda:0 under "1" is physical GPU 1)."""
    if index is None and ":" in device:
        tail = device.split(":", 1)[1]
        index = int(tail) if tail.isdecimal() and len(tail) <= 9 else None  # "cuda:²", huge
    visible = parse_cuda_visible_devices(visible_devices) or []  # as the rank's CUDA reads it
    if index is not None and index < len(visible):
        return ("visible", str(visible[index]))
    return ("device", device if index is None else f"cuda:{index}")


def uses_rank_as_ordinal(r: RankRecord) -> bool:
    """The rank's CUDA index is its global rank where that is wrong: several nodes, or a
    rank beyond its host's GPUs."""
    if not (r.device or "").startswith("cuda") or r.local_rank is None:
        return False
    if r.device_index != r.rank or r.rank == r.local_rank:
        return False
    multi_node = bool(r.world_size and r.local_world_size and r.world_size > r.local_world_size)
    return multi_node or (r.device_count is not None and r.rank >= r.device_count)


def shares_gpu(r: RankRecord) -> bool:
    """Its GPU's process list (``gpu_pids``) holds another process, or not its own: all that
    ``foreign_memory`` looks at (a rank alone on its GPU, as most are, does not)."""
    return bool(r.gpu_pids) and r.gpu_pids != [r.pid]


def off_local_rank(r: RankRecord) -> bool:
    """On a host of several GPUs, the rank is on one other than cuda:<local rank>."""
    return (
        (r.device or "").startswith("cuda")
        and (r.device_count or 0) > 1
        and r.local_rank is not None
        and r.device_index is not None
        and r.device_index != r.local_rank
    )


class DeviceIndex:
    """Every rank's GPU, and the ranks each device rule may name, whatever their state: the
    rules keep the live ones."""

    def __init__(self) -> None:
        self._key_of: dict[int, DeviceKey] = {}
        self._members: dict[DeviceKey, set[int]] = {}
        self.shared: dict[DeviceKey, set[int]] = {}
        """GPUs two or more ranks reported, with those ranks."""
        self.ordinal: set[int] = set()
        """Ranks for which ``uses_rank_as_ordinal`` holds."""
        self.off_local: set[int] = set()
        """Ranks for which ``off_local_rank`` holds."""
        self.sharing: set[int] = set()
        """Ranks for which ``shares_gpu`` holds."""

    @classmethod
    def of(cls, records: Iterable[RankRecord]) -> DeviceIndex:
        index = cls()
        for record in records:
            index.place(record)
        return index

    def place(self, record: RankRecord) -> None:
        """Where ``record``'s identity puts it: called when a rank's identity changes or a
        new record (a new rank, a restarted process) replaces its last."""
        rank = record.rank
        self.drop(rank)
        key = device_key(record)
        if key is not None:
            self._key_of[rank] = key
            members = self._members.setdefault(key, set())
            members.add(rank)
            if len(members) > 1:
                self.shared[key] = members
        if uses_rank_as_ordinal(record):
            self.ordinal.add(rank)
        if off_local_rank(record):
            self.off_local.add(rank)
        self.place_pids(record)

    def place_pids(self, record: RankRecord) -> None:
        """Where ``record``'s GPU process list puts it: called when the list changes."""
        if shares_gpu(record):
            self.sharing.add(record.rank)
        else:
            self.sharing.discard(record.rank)

    def drop(self, rank: int) -> None:
        """The rank is no longer in the job's state (its attempt ended), or is placed anew."""
        key = self._key_of.pop(rank, None)
        if key is not None:
            members = self._members[key]
            members.discard(rank)
            if len(members) < 2:
                self.shared.pop(key, None)
            if not members:
                del self._members[key]
        self.ordinal.discard(rank)
        self.off_local.discard(rank)
        self.sharing.discard(rank)
