"""Device and memory probes: a fake two-GPU rank end to end, and the real CPU-only path."""

from __future__ import annotations

import dataclasses
import logging
import threading
from collections import Counter
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

import pytest

import ddpwatch.core.devices
from ddpwatch.agent.nvml import Nvml, parse_cuda_visible_devices
from ddpwatch.agent.probes import DeviceInfo, MemoryInfo, Probes, TorchCuda
from ddpwatch.core.protocol import Sample, decode, encode
from ddpwatch.diagnosis.alerts import Thresholds
from ddpwatch.diagnosis.rules.devices import rule_duplicate_device
from ddpwatch.state import devices as device_rules
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState

GiB = 1 << 30


class FakeNVMLError(Exception):
    """What pynvml raises; the probes must catch anything, not just pynvml's classes."""


@dataclasses.dataclass(eq=False)
class FakeGpu:
    index: int
    uuid: str
    name: str = "NVIDIA H100 80GB HBM3"
    bus_id: str = ""
    used: int = 0
    total: int = 80 * GiB
    compute_pids: list[int] = dataclasses.field(default_factory=list)
    graphics_pids: list[int] = dataclasses.field(default_factory=list)
    migs: list[FakeGpu] = dataclasses.field(default_factory=list)
    parent: FakeGpu | None = None
    instance: tuple[int, int] = (0, 0)


def _machine(count: int = 4) -> list[FakeGpu]:
    return [
        FakeGpu(
            index=i,
            uuid=f"GPU-{i}{i}{i}{i}aaaa-bbbb-cccc-dddd-{i:012d}",
            bus_id=f"00000000:{0x18 + i:02X}:00.0",
            used=(i + 1) * GiB,
            compute_pids=[1000 + i],
            graphics_pids=[1000 + i, 2000 + i],
        )
        for i in range(count)
    ]


class FakePynvml:
    """The slice of pynvml the agent calls, over a list of fake GPUs."""

    def __init__(self, gpus: list[FakeGpu], init_error: Exception | None = None) -> None:
        self.gpus = gpus
        self.init_error = init_error
        self.calls: Counter[str] = Counter()

    def __getattribute__(self, name: str) -> Any:
        if name.startswith("nvml"):
            object.__getattribute__(self, "calls")[name] += 1
        return object.__getattribute__(self, name)

    def _all(self) -> list[FakeGpu]:
        return [g for gpu in self.gpus for g in (gpu, *gpu.migs)]

    def nvmlInit(self) -> None:
        if self.init_error is not None:
            raise self.init_error

    def nvmlShutdown(self) -> None:
        pass

    def nvmlDeviceGetCount(self) -> int:
        return len(self.gpus)

    def nvmlDeviceGetHandleByIndex(self, index: int) -> FakeGpu:
        return self.gpus[index]

    def nvmlDeviceGetHandleByUUID(self, uuid: str) -> FakeGpu:
        for gpu in self._all():
            if gpu.uuid == uuid:
                return gpu
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetHandleByPciBusId(self, bus_id: str) -> FakeGpu:
        for gpu in self.gpus:
            if gpu.bus_id == bus_id:
                return gpu
        raise FakeNVMLError("Not Found")

    def nvmlDeviceGetUUID(self, gpu: FakeGpu) -> str:
        return gpu.uuid

    def nvmlDeviceGetName(self, gpu: FakeGpu) -> bytes:
        return gpu.name.encode()  # older pynvml returns bytes

    def nvmlDeviceGetIndex(self, gpu: FakeGpu) -> int:
        return gpu.index

    def nvmlDeviceGetPciInfo(self, gpu: FakeGpu) -> SimpleNamespace:
        if gpu.parent is not None:
            raise FakeNVMLError("Not Supported")
        return SimpleNamespace(busId=gpu.bus_id.encode())

    def nvmlDeviceGetMemoryInfo(self, gpu: FakeGpu) -> SimpleNamespace:
        return SimpleNamespace(used=gpu.used, total=gpu.total, free=gpu.total - gpu.used)

    def nvmlDeviceGetComputeRunningProcesses(self, gpu: FakeGpu) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=GiB) for pid in gpu.compute_pids]

    def nvmlDeviceGetGraphicsRunningProcesses(self, gpu: FakeGpu) -> list[SimpleNamespace]:
        return [SimpleNamespace(pid=pid, usedGpuMemory=GiB) for pid in gpu.graphics_pids]

    def nvmlDeviceGetMigMode(self, gpu: FakeGpu) -> list[int]:
        if not gpu.migs:
            raise FakeNVMLError("Not Supported")
        return [1, 1]

    def nvmlDeviceGetMaxMigDeviceCount(self, gpu: FakeGpu) -> int:
        return len(gpu.migs)

    def nvmlDeviceGetMigDeviceHandleByIndex(self, gpu: FakeGpu, index: int) -> FakeGpu:
        return gpu.migs[index]

    def nvmlDeviceGetGpuInstanceId(self, gpu: FakeGpu) -> int:
        return gpu.instance[0]

    def nvmlDeviceGetComputeInstanceId(self, gpu: FakeGpu) -> int:
        return gpu.instance[1]

    def nvmlDeviceGetDeviceHandleFromMigDeviceHandle(self, gpu: FakeGpu) -> FakeGpu:
        if gpu.parent is None:
            raise FakeNVMLError("Invalid Argument")
        return gpu.parent


class CudaUuid:
    """Like torch's ``_CUuuid``: ``str()`` gives the bare ``8-4-4-4-12`` hex form."""

    def __init__(self, nvml_uuid: str) -> None:
        self.text = nvml_uuid[4:]

    def __str__(self) -> str:
        return self.text


class FakeCuda:
    """torch.cuda as seen by one rank whose CUDA_VISIBLE_DEVICES selects ``visible``."""

    def __init__(
        self, visible: list[FakeGpu], initialized: bool = True, with_uuid: bool = True
    ) -> None:
        self.visible = visible
        self.initialized = initialized
        self.with_uuid = with_uuid
        self.current = 0
        self.stats: dict[int, dict[str, int]] = {i: {} for i in range(len(visible))}
        self.calls: Counter[str] = Counter()

    def set_device(self, index: int) -> None:
        self.current = index

    def is_initialized(self) -> bool:
        return self.initialized

    def device_count(self) -> int | None:
        return len(self.visible)

    def current_device(self) -> int | None:
        self.calls["current_device"] += 1
        assert self.initialized, "would initialise CUDA"
        return self.current

    def device_properties(self, index: int) -> Any:
        self.calls["device_properties"] += 1
        assert self.initialized, "would initialise CUDA"
        gpu = self.visible[index]
        props = SimpleNamespace(name=gpu.name, total_memory=gpu.total)
        if self.with_uuid:
            props.uuid = CudaUuid(gpu.uuid)
        return props

    def memory_stats(self, index: int) -> Mapping[str, Any]:
        self.calls["memory_stats"] += 1
        assert self.initialized, "would initialise CUDA"
        return self.stats[index]


def _allocated(allocated: int, reserved: int, peak: int) -> dict[str, int]:
    return {
        "allocated_bytes.all.current": allocated,
        "reserved_bytes.all.current": reserved,
        "allocated_bytes.all.peak": peak,
        "num_ooms": 0,
    }


@pytest.fixture
def gpus() -> list[FakeGpu]:
    return _machine(4)


def _rank(
    gpus: list[FakeGpu], visible: str, env: dict[str, str] | None = None, **cuda: Any
) -> tuple[Probes, FakeCuda, FakePynvml]:
    """A rank with CUDA_VISIBLE_DEVICES=``visible`` (indices) on the fake machine."""
    environ = {"CUDA_VISIBLE_DEVICES": visible, **(env or {})}
    chosen = [gpus[int(i)] for i in visible.split(",")]
    lib = FakePynvml(gpus)
    fake_cuda = FakeCuda(chosen, **cuda)
    probes = Probes(cuda=fake_cuda, nvml=Nvml(lib, environ=environ), environ=environ)
    return probes, fake_cuda, lib


def _in_thread(func: Callable[[], Any]) -> Any:
    """Run like the publisher does: on a thread whose CUDA current device is its own."""
    result: list[Any] = []
    thread = threading.Thread(target=lambda: result.append(func()))
    thread.start()
    thread.join(10)
    return result[0]


# the whole path on a fake GPU ----------------------------------------------------------------


def test_set_device_1_with_visible_2_3_is_physical_gpu_3(gpus: list[FakeGpu]) -> None:
    probes, cuda, _ = _rank(gpus, "2,3")
    cuda.set_device(1)
    cuda.stats[1] = _allocated(3 * GiB, 4 * GiB, 5 * GiB)

    device = probes.device_info()
    assert device == DeviceInfo(
        device="cuda:1",
        device_index=1,
        device_name="NVIDIA H100 80GB HBM3",
        device_uuid=gpus[3].uuid,
        device_pci_bus_id="00000000:1B:00.0",
        device_count=2,
    )
    assert device.device_uuid.startswith("GPU-")

    memory = probes.memory_info(device)
    assert memory == MemoryInfo(
        mem_allocated_bytes=3 * GiB,
        mem_reserved_bytes=4 * GiB,
        mem_peak_bytes=5 * GiB,
        gpu_mem_used_bytes=4 * GiB,  # NVML's view of physical GPU 3
        gpu_mem_total_bytes=80 * GiB,
        gpu_pids=[1003, 2003],  # compute and graphics, each pid once
    )


def test_device_is_re_read_after_set_device(gpus: list[FakeGpu]) -> None:
    probes, cuda, _ = _rank(gpus, "2,3")
    assert probes.device_info().device_uuid == gpus[2].uuid
    cuda.set_device(1)
    assert probes.device_info().device_uuid == gpus[3].uuid


def test_properties_and_nvml_lookups_are_cached_per_index(gpus: list[FakeGpu]) -> None:
    probes, cuda, lib = _rank(gpus, "2,3")
    for _ in range(5):
        probes.memory_info(probes.device_info())
    assert cuda.calls["device_properties"] == 1
    assert lib.calls["nvmlDeviceGetHandleByUUID"] == 1
    assert cuda.calls["memory_stats"] == 5  # one allocator read per sample
    assert lib.calls["nvmlDeviceGetMemoryInfo"] == 5


def test_sample_accepts_the_probe_fields(gpus: list[FakeGpu]) -> None:
    probes, cuda, _ = _rank(gpus, "2,3")
    cuda.stats[0] = _allocated(1, 2, 3)
    device = probes.device_info()
    memory = probes.memory_info(device)
    sample = Sample(v=1, rank=0, t=0.0, **dataclasses.asdict(device), **memory.as_fields())
    decoded = decode(encode(sample))
    assert isinstance(decoded, Sample)
    assert (decoded.device, decoded.gpu_pids) == ("cuda:0", [1002, 2002])


def test_without_torch_uuid_the_visible_devices_mapping_is_used(gpus: list[FakeGpu]) -> None:
    probes, cuda, _ = _rank(gpus, "2,3", with_uuid=False)
    cuda.set_device(1)
    device = probes.device_info()
    assert (device.device_uuid, device.device_pci_bus_id) == (gpus[3].uuid, "00000000:1B:00.0")


def test_mixed_models_without_pci_order_give_no_uuid_rather_than_a_guess(
    gpus: list[FakeGpu],
) -> None:
    gpus[0].name = "NVIDIA A100-SXM4-40GB"  # CUDA puts the fastest first unless PCI_BUS_ID
    probes, cuda, _ = _rank(gpus, "2,3", with_uuid=False)
    cuda.set_device(1)
    device = probes.device_info()
    assert device.device == "cuda:1"
    assert device.device_uuid is None and device.device_pci_bus_id is None
    assert probes.memory_info(device).gpu_mem_used_bytes is None

    ordered, cuda2, _ = _rank(gpus, "2,3", {"CUDA_DEVICE_ORDER": "PCI_BUS_ID"}, with_uuid=False)
    cuda2.set_device(1)
    assert ordered.device_info().device_uuid == gpus[3].uuid


def test_mig_instance_by_torch_uuid(gpus: list[FakeGpu]) -> None:
    parent = gpus[1]
    parent.migs = [
        FakeGpu(
            index=0, uuid=f"MIG-{n}abc1234-0000-1111-2222-333344445555", used=GiB, total=10 * GiB
        )
        for n in range(2)
    ]
    for n, mig in enumerate(parent.migs):
        mig.parent, mig.instance, mig.name = parent, (n + 7, 0), "NVIDIA H100 MIG 1g.10gb"
    lib = FakePynvml(gpus)
    cuda = FakeCuda([parent.migs[1]])
    probes = Probes(cuda=cuda, nvml=Nvml(lib, environ={}), environ={})
    device = probes.device_info()
    assert device.device_uuid == parent.migs[1].uuid  # the MIG- prefix, as NVML names it
    assert device.device_pci_bus_id == parent.bus_id  # a MIG instance sits on its GPU's bus
    memory = probes.memory_info(device)
    assert (memory.gpu_mem_used_bytes, memory.gpu_mem_total_bytes) == (GiB, 10 * GiB)

    nvml = Nvml(lib, environ={})
    legacy = f"MIG-{parent.uuid}/8/0"  # MIG-GPU-<uuid>/<gpu instance>/<compute instance>
    assert nvml.handle_for_cuda_ordinal(0, legacy) is parent.migs[1]
    assert nvml.handle_for_cuda_ordinal(0, parent.migs[0].uuid) is parent.migs[0]
    assert nvml.handle_for_cuda_ordinal(0, "1") is parent.migs[0]  # CUDA shows the first instance


def test_visible_devices_by_abbreviated_uuid(gpus: list[FakeGpu]) -> None:
    nvml = Nvml(FakePynvml(gpus), environ={})
    visible = f"{gpus[3].uuid[:9]},{gpus[0].uuid}"
    assert nvml.handle_for_cuda_ordinal(0, visible) is gpus[3]
    assert nvml.handle_for_cuda_ordinal(1, visible) is gpus[0]
    assert nvml.handle_for_cuda_ordinal(2, visible) is None
    assert nvml.visible_device_count(visible) == 2
    assert nvml.visible_device_count("GPU-nope") == 0


@pytest.mark.parametrize(
    ("visible", "expected"),
    [(None, 4), ("2,3", 2), ("3,7,1", 1), ("0,0", 0), ("", 0), ("1,-1,2", 1)],
)
def test_visible_device_count(gpus: list[FakeGpu], visible: str | None, expected: int) -> None:
    assert Nvml(FakePynvml(gpus), environ={}).visible_device_count(visible) == expected


def test_nvml_lookup_helpers(gpus: list[FakeGpu]) -> None:
    nvml = Nvml(FakePynvml(gpus), environ={})
    assert nvml.device_by_uuid_or_pci(uuid=gpus[2].uuid) is gpus[2]
    assert nvml.device_by_uuid_or_pci(uuid=gpus[2].uuid[4:]) is gpus[2]  # torch's bare form
    assert nvml.device_by_uuid_or_pci(uuid="GPU-gone", pci_bus_id=gpus[1].bus_id) is gpus[1]
    assert nvml.device_by_uuid_or_pci() is None
    assert nvml.name(gpus[0]) == "NVIDIA H100 80GB HBM3"  # bytes decoded
    assert nvml.index(gpus[3]) == 3
    assert nvml.process_pids(gpus[0]) == [1000, 2000]


# agent thread: CUDA's current device is per host thread ------------------------------------------


def test_agent_thread_uses_the_device_noted_on_the_training_thread(gpus: list[FakeGpu]) -> None:
    probes, cuda, _ = _rank(gpus, "2,3")
    cuda.set_device(1)
    assert probes.note_current_device() == 1  # from the training (main) thread
    cuda.set_device(0)  # what a fresh thread would see, whatever the training thread chose
    assert _in_thread(probes.device_info).device == "cuda:1"


def test_agent_thread_infers_the_only_device_holding_memory(gpus: list[FakeGpu]) -> None:
    probes, cuda, _ = _rank(gpus, "2,3")
    assert _in_thread(probes.device_info).device == "cuda"  # nothing allocated: unknown index
    cuda.stats[1] = _allocated(1, GiB, 1)
    device = _in_thread(probes.device_info)
    assert (device.device, device.device_uuid) == ("cuda:1", gpus[3].uuid)
    assert probes.memory_info(DeviceInfo(device="cuda")) == MemoryInfo()


def test_agent_thread_with_one_visible_device(gpus: list[FakeGpu]) -> None:
    probes, _, _ = _rank(gpus, "3")
    assert _in_thread(probes.device_info).device_uuid == gpus[3].uuid


# CPU, uninitialised CUDA, failures ---------------------------------------------------------------


def test_uninitialised_cuda_reports_cpu_without_touching_cuda(gpus: list[FakeGpu]) -> None:
    probes, cuda, _ = _rank(gpus, "2,3", initialized=False)
    cuda.set_device(1)
    device = probes.device_info()
    assert device == DeviceInfo(device="cpu", device_count=2)
    assert probes.memory_info(device) == MemoryInfo()
    assert probes.memory_info(DeviceInfo("cuda:1", device_index=1)) == MemoryInfo()
    assert probes.note_current_device() is None
    assert sum(cuda.calls.values()) == 0  # FakeCuda asserts too: nothing would initialise CUDA


def test_nvml_failing_leaves_torch_values(gpus: list[FakeGpu]) -> None:
    lib = FakePynvml(gpus, init_error=FakeNVMLError("Driver Not Loaded"))
    cuda = FakeCuda([gpus[2], gpus[3]])
    cuda.stats[0] = _allocated(1, 2, 3)
    probes = Probes(cuda=cuda, nvml=Nvml(lib, environ={}), environ={})
    device = probes.device_info()
    assert device.device == "cuda:0"
    assert device.device_uuid == gpus[2].uuid  # torch's UUID, with NVML's prefix added
    assert device.device_pci_bus_id is None
    memory = probes.memory_info(device)
    assert (memory.mem_allocated_bytes, memory.mem_reserved_bytes) == (1, 2)
    assert (memory.gpu_mem_used_bytes, memory.gpu_mem_total_bytes, memory.gpu_pids) == (
        None,
        None,
        None,
    )
    assert lib.calls["nvmlInit"] == 1  # tried once, not every beat


class BrokenCuda:
    """Every call raises: the probes must still answer."""

    def __getattr__(self, name: str) -> Any:
        def fail(*args: Any) -> Any:
            raise RuntimeError(f"{name} broke")

        return fail


def test_a_broken_backend_never_raises() -> None:
    probes = Probes(cuda=BrokenCuda(), nvml=Nvml(BrokenCuda(), environ={}), environ={})
    assert probes.device_info() == DeviceInfo()
    assert probes.memory_info(DeviceInfo("cuda:0", device_index=0)) == MemoryInfo()
    assert probes.note_current_device() is None


def test_garbage_allocator_stats_become_none(gpus: list[FakeGpu]) -> None:
    probes, cuda, _ = _rank(gpus, "2,3")
    cuda.stats[0] = {"allocated_bytes.all.current": -1, "reserved_bytes.all.current": True}
    memory = probes.memory_info(probes.device_info())
    assert (memory.mem_allocated_bytes, memory.mem_reserved_bytes, memory.mem_peak_bytes) == (
        None,
        None,
        None,
    )


def test_nvml_initialises_once_across_threads(gpus: list[FakeGpu]) -> None:
    lib = FakePynvml(gpus)
    nvml = Nvml(lib, environ={})
    assert lib.calls["nvmlInit"] == 0  # lazy: nothing at construction
    threads = [threading.Thread(target=nvml.device_count) for _ in range(8)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert lib.calls["nvmlInit"] == 1
    nvml.shutdown()
    assert lib.calls["nvmlShutdown"] == 1
    assert nvml.device_count() == 4  # initialised again on next use
    assert lib.calls["nvmlInit"] == 2


# the real path on this machine -------------------------------------------------------------------


def test_real_probes_on_this_machine() -> None:
    import torch

    assert not torch.cuda.is_initialized()
    probes = Probes(nvml=Nvml(environ={}), environ={})
    device = probes.device_info()
    assert device.device == "cpu"
    assert device.device_index is device.device_uuid is device.device_pci_bus_id is None
    if not torch.cuda._is_compiled():
        assert device.device_count == 0
    assert probes.memory_info(device) == MemoryInfo()
    assert _in_thread(probes.device_info) == device
    assert not torch.cuda.is_initialized()  # the probes did not initialise CUDA


def test_real_torch_backend_does_not_initialise_cuda() -> None:
    import torch

    backend = TorchCuda()
    assert backend.is_initialized() is False
    count = backend.device_count()
    assert count == 0 if not torch.cuda._is_compiled() else count is None
    assert not torch.cuda.is_initialized()


def test_real_nvml_without_the_library_is_none_and_logged_once(
    caplog: pytest.LogCaptureFixture,
) -> None:
    pytest.importorskip("pynvml")
    nvml = Nvml(environ={})
    caplog.set_level(logging.DEBUG, logger="ddpwatch")
    if nvml.available():
        pytest.skip("this machine has an NVML library")
    for _ in range(3):
        assert nvml.device_count() is None
        assert nvml.handle_by_uuid("GPU-0000") is None
        assert nvml.memory(object()) == (None, None)
        assert nvml.process_pids(object()) is None
        assert nvml.handle_for_cuda_ordinal(0, "0") is None
        assert nvml.visible_device_count("0,1") is None
    reports = [r for r in caplog.records if "NVML unavailable" in r.getMessage()]
    assert len(reports) == 1


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        (None, None),
        ("", []),
        ("2,3", [2, 3]),
        (" 1 , 0 ", [1, 0]),
        ("1gpu,2ampere", [1, 2]),  # read like strtoul
        ("0,0", []),  # a repeated ordinal hides every device
        ("0,-1,2", [0]),  # an invalid entry ends the list
        ("0,GPU-abc", [0]),
        ("GPU-abc,GPU-def", ["GPU-abc", "GPU-def"]),
        ("GPU-abc,1", ["GPU-abc"]),
        ("MIG-abc", ["MIG-abc"]),
        ("GPU-abc,GPU-abc", []),
        ("GPU-abc,", ["GPU-abc"]),  # a trailing comma adds nothing
        ("3,1,", [3, 1]),
        ("+1,02", [1, 2]),
        ("00,0", []),  # the same ordinal, however written
        ("9" * 5000, [2**64 - 1]),  # saturates like strtoul, never too long for int()
    ],
)
def test_parse_cuda_visible_devices(value: str | None, expected: list[Any] | None) -> None:
    assert parse_cuda_visible_devices(value) == expected


def test_one_parser_for_agent_server_and_doctor() -> None:
    """The agent, ``ddpwatch doctor`` (through the agent's module) and the server's device index
    use the one parser in ``ddpwatch.core.devices``."""
    assert parse_cuda_visible_devices is ddpwatch.core.devices.parse_cuda_visible_devices
    assert device_rules.parse_cuda_visible_devices is ddpwatch.core.devices.parse_cuda_visible_devices


def _mig_machine() -> list[FakeGpu]:
    """Four GPUs; GPU 1 is split into two MIG instances."""
    gpus = _machine(4)
    parent = gpus[1]
    parent.migs = [
        FakeGpu(index=0, uuid=f"MIG-{n}abc1234-0000-1111-2222-33334444555{n}", parent=parent)
        for n in range(2)
    ]
    return gpus


_G = _machine(4)  # the same UUIDs as _mig_machine()'s GPUs
_MIG0, _MIG1 = (gpu.uuid for gpu in _mig_machine()[1].migs)
CROSS_SIDE_VALUES = [
    None,
    "2,3",
    " 3 , 1 ",
    "3,1,",  # trailing comma
    "+1,02",
    "1gpu,2ampere",  # read like strtoul
    "0,x,2",  # an invalid entry stops the list
    "1,-1,2",
    "0,0",  # a repeat hides every GPU
    "",
    f"{_G[3].uuid},{_G[0].uuid}",
    f"{_G[3].uuid[:9]},{_G[0].uuid},",  # abbreviated UUID, trailing comma
    f"{_G[3].uuid},1",  # a number after UUIDs stops the list
    f"{_G[2].uuid},{_G[2].uuid}",
    f"{_MIG1},{_MIG0},",
    f"{_MIG1},{_G[0].uuid}",  # a GPU- entry after MIG- ones stops the list
]


@pytest.mark.parametrize("visible", CROSS_SIDE_VALUES)
def test_agent_and_server_read_visible_devices_alike(visible: str | None) -> None:
    """For every CUDA ordinal, the physical device the server's duplicate-GPU rule keys a rank on
    is the one the agent resolves through NVML (indices in PCI order, UUIDs, MIG instances)."""
    gpus = _mig_machine()
    nvml = Nvml(FakePynvml(gpus), environ={"CUDA_DEVICE_ORDER": "PCI_BUS_ID"})
    everything = [g for gpu in gpus for g in (gpu, *gpu.migs)]

    def physical(index: int) -> FakeGpu | None:
        gpu = gpus[index] if index < len(gpus) else None
        return gpu.migs[0] if gpu is not None and gpu.migs else gpu  # a MIG GPU: its first

    for ordinal in range(6):
        agent = nvml.handle_for_cuda_ordinal(ordinal, visible)
        kind, name = device_rules._physical_gpu(f"cuda:{ordinal}", ordinal, visible)
        if kind == "visible":  # the server maps the ordinal through the list
            if name.isdigit():
                expected = physical(int(name))
            else:
                [expected] = [g for g in everything if g.uuid.startswith(name)]
            assert agent is expected, (ordinal, name)
        elif visible is None:  # unset: cuda:<n> is GPU n on both sides
            assert (name, agent) == (f"cuda:{ordinal}", physical(ordinal))
        else:  # past the end of the list as CUDA reads it: no device for the agent either
            assert agent is None, ordinal
    listed = sum(
        device_rules._physical_gpu(f"cuda:{i}", i, visible)[0] == "visible" for i in range(6)
    )
    assert nvml.visible_device_count(visible) == (4 if visible is None else listed)


def _on_gpu(r: int, visible: str, index: int) -> RankRecord:
    return RankRecord(
        rank=r, first_seen=990.0, last_seen=999.8, pid=1000 + r, host="node0", local_rank=index,
        device=f"cuda:{index}", device_index=index, cuda_visible_devices=visible,
    )  # fmt: skip


@pytest.mark.parametrize(
    ("first", "second", "shared"),
    [
        (("1gpu", 0), ("1", 0), True),  # both read as GPU 1
        (("3,1,", 1), ("+1", 0), True),
        (("0,1", 1), ("1,0", 1), False),
        ((f"{_G[2].uuid},", 0), (f"{_G[3].uuid},{_G[2].uuid}", 1), True),
        (("0,x,1", 0), ("1", 0), False),
    ],
)
def test_duplicate_device_rule_reads_visible_devices_as_cuda_does(
    first: tuple[str, int], second: tuple[str, int], shared: bool
) -> None:
    state = ServerState(started=900.0)
    state.ranks = {0: _on_gpu(0, *first), 1: _on_gpu(1, *second)}
    alerts = rule_duplicate_device(state, 1000.0, Thresholds())
    assert [a.ranks for a in alerts] == ([(0, 1)] if shared else [])


class GarbageNvml:
    """A pynvml whose every function answers ``value``: nothing NVML really returns."""

    def __init__(self, value: Any) -> None:
        self.value = value

    def __getattr__(self, name: str) -> Any:
        return lambda *args: self.value


@pytest.mark.parametrize("value", [object(), "x", -1, 2, 3.5, True, [object()], [1], b"\xff", ()])
def test_no_nvml_method_raises_on_a_garbage_answer(value: Any) -> None:
    """``query`` is the one fail-soft point: what it returns is checked, never trusted."""
    nvml = Nvml(GarbageNvml(value), environ={})
    handle = object()
    nvml.device_count()
    nvml.handle_by_index(0)
    nvml.handle_by_uuid("GPU-0000")
    nvml.handle_by_uuid("1234")
    nvml.handle_by_pci_bus_id("00000000:18:00.0")
    nvml.device_by_uuid_or_pci("GPU-0000", "00000000:18:00.0")
    nvml.handle_for_cuda_ordinal(0, "0")
    nvml.handle_for_cuda_ordinal(0, "MIG-GPU-0000/1/0")
    nvml.handle_for_cuda_ordinal(0, "MIG-GPU-0000/1/" + "9" * 5000)
    nvml.visible_device_count("9" * 5000)
    nvml.visible_device_count("0,1")
    nvml.visible_device_count("GPU-0000")
    nvml.uuid(handle)
    nvml.name(handle)
    nvml.index(handle)
    nvml.pci_bus_id(handle)
    memory = nvml.memory(handle)
    pids = nvml.process_pids(handle)
    assert all(value is None or isinstance(value, int) for value in memory)
    assert pids is None or all(isinstance(pid, int) for pid in pids)
