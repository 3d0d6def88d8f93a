"""The devices family (``diagnosis/rules/devices.py``): two ranks on one GPU, a device ordinal
the rank cannot see, local ranks that disagree, and uneven or foreign GPU memory."""

from __future__ import annotations

from typing import Any

import pytest
from lockstep import (
    GIB,
    NOW,
    ORDINAL,
    TH,
    job,
    kinds,
    only,
    rank,
    state_of,
)

from ddpwatch.core.protocol import ErrorInfo
from ddpwatch.diagnosis.alerts import Alert
from ddpwatch.diagnosis.rules import (
    diagnose,
    rule_device_ordinal,
    rule_duplicate_device,
    rule_foreign_memory,
    rule_local_rank_mismatch,
    rule_uneven_memory,
)
from ddpwatch.state.records import RankRecord
from ddpwatch.state.state import ServerState


def gpu(r: int, index: int, local: int | None = None, **changes: Any) -> RankRecord:
    local = r if local is None else local
    return rank(
        r, device=f"cuda:{index}", device_index=index, local_rank=local, device_count=4, **changes
    )


def test_duplicate_device_names_the_rank_on_the_wrong_gpu() -> None:
    state = state_of(gpu(0, 0), gpu(1, 0), gpu(2, 2), gpu(3, 3))
    alerts = diagnose(state, NOW, TH)
    alert = only(alerts, "duplicate_device")
    assert (alert.severity, alert.ranks) == ("error", (1,))
    assert "ranks 0, 1 share GPU cuda:0 on host node0" in alert.message
    assert "local_rank_mismatch" not in kinds(alerts)


def test_duplicate_device_by_uuid_and_visible_devices() -> None:
    same = state_of(
        rank(0, device="cuda:0", device_index=0, device_uuid="GPU-a"),
        rank(1, device="cuda:0", device_index=0, device_uuid="GPU-a", local_rank=0),
    )
    assert only(rule_duplicate_device(same, NOW, TH), "duplicate_device").ranks == (0, 1)
    split = state_of(  # SLURM style: one visible GPU per rank, each is cuda:0
        rank(0, device="cuda:0", device_index=0, cuda_visible_devices="0", local_rank=0),
        rank(1, device="cuda:0", device_index=0, cuda_visible_devices="1", local_rank=0),
    )
    assert rule_duplicate_device(split, NOW, TH) == []
    hosts = state_of(gpu(0, 0, 0), gpu(1, 0, 0, host="node1"))
    assert rule_duplicate_device(hosts, NOW, TH) == []


def test_duplicate_device_from_an_nccl_crash() -> None:
    error = ErrorInfo(
        type="torch.distributed.DistBackendError",
        message="NCCL error in: ProcessGroupNCCL.cpp:1691, invalid usage, NCCL version 2.19.3\n"
        "ncclInvalidUsage: This usually reflects invalid usage of NCCL library.\nLast error:\n"
        "Duplicate GPU detected : rank 1 and rank 0 both on CUDA device 2000",
    )
    state = job(2)
    state.ranks[1] = rank(1, 2, error=error, error_time=NOW - 1)
    alert = only(rule_duplicate_device(state, NOW, TH), "duplicate_device")
    assert alert.ranks == (0, 1)
    assert "set_device(local_rank)" in alert.hint and "CUDA_VISIBLE_DEVICES" in alert.hint


def test_device_ordinal_from_a_crash_has_the_real_local_rank() -> None:
    state = state_of(*(rank(r, 8, local_world_size=4, local_rank=r % 4) for r in range(8)))
    state.ranks[4] = rank(4, 8, local_world_size=4, local_rank=0, error=ORDINAL, error_time=NOW)
    alert = only(rule_device_ordinal(state, NOW, TH), "device_ordinal")
    assert (alert.severity, alert.ranks) == ("error", (4,))
    assert alert.hint == (
        "use torch.cuda.set_device(local_rank) — LOCAL_RANK is 0 on this rank — not the global rank"
    )


def test_device_ordinal_from_a_live_rank() -> None:
    multi = dict(world=8, local_world_size=4, device_count=4, host="node1")
    state = state_of(
        rank(4, device="cuda:0", device_index=0, local_rank=0, **multi),
        rank(5, device="cuda:5", device_index=5, local_rank=1, **multi),
    )
    alert = only(diagnose(state, NOW, TH), "device_ordinal")
    assert alert.ranks == (5,)
    assert "LOCAL_RANK is 1 on this rank" in alert.hint
    assert "local_rank_mismatch" not in kinds(diagnose(state, NOW, TH))
    node0 = state_of(rank(1, device="cuda:1", device_index=1, local_rank=1, **multi))
    assert rule_device_ordinal(node0, NOW, TH) == []


ORDINAL_CRASH = {"error": ORDINAL, "error_time": NOW - 1, "exit_time": NOW - 0.5, "exit_code": 1}
NO_GPU_FIX = (
    "the machine or container shows this rank no GPU: check the driver (nvidia-smi), the "
    "container's GPUs (docker --gpus) and CUDA_VISIBLE_DEVICES, or the job's GPU allocation; "
    "or run on CPU: the gloo backend and no cuda device"
)


def ordinal_alerts(state: ServerState) -> tuple[Alert, Alert]:
    """The device_ordinal alert and the crash's own: both give the same fix."""
    alerts = diagnose(state, NOW, TH)
    ordinal, crashed = only(alerts, "device_ordinal"), only(alerts, "crashed")
    assert crashed.hint == ordinal.hint
    return ordinal, crashed


@pytest.mark.parametrize(
    ("seen", "why"),
    [
        ({"device_count": 0}, "it counts 0 CUDA devices"),
        ({"cuda_visible_devices": "-1"}, "CUDA_VISIBLE_DEVICES='-1' hides every GPU"),
        ({"cuda_visible_devices": ""}, "CUDA_VISIBLE_DEVICES='' hides every GPU"),
        (
            {"cuda_visible_devices": "NoDevFiles"},
            "CUDA_VISIBLE_DEVICES='NoDevFiles' hides every GPU",
        ),
    ],
)
def test_device_ordinal_on_a_rank_that_sees_no_gpu(seen: dict[str, Any], why: str) -> None:
    """One node, local rank 3 == global rank 3, no GPU visible: set_device(local_rank) would
    crash the same way, so the fix is the GPUs (or CPU), not the index."""
    state = job(4, **seen)
    state.ranks[3] = rank(3, 4, **seen, **ORDINAL_CRASH)
    ordinal, crashed = ordinal_alerts(state)
    assert ordinal.ranks == (3,)
    assert ordinal.message == (
        "rank 3 crashed with RuntimeError: CUDA error: invalid device ordinal — rank 3 sees no "
        f"GPU on host node0 ({why})"
    )
    assert ordinal.hint == NO_GPU_FIX
    assert "set_device" not in ordinal.hint and "global rank" not in crashed.message


def test_device_ordinal_with_more_ranks_per_node_than_gpus() -> None:
    """One GPU, two ranks per node: local rank 1 is global rank 1, and cuda:1 is not there."""
    state = state_of(
        rank(0, 2, device="cuda:0", device_index=0, device_count=1),
        rank(1, 2, device_count=1, **ORDINAL_CRASH),
    )
    ordinal, crashed = ordinal_alerts(state)
    assert ordinal.ranks == (1,)
    assert ordinal.message == (
        "rank 1 crashed with RuntimeError: CUDA error: invalid device ordinal — host node0 runs "
        "2 ranks but rank 1 sees 1 GPU: local rank 1 has no cuda:1"
    )
    assert ordinal.hint == (
        "this node runs more ranks than it has GPUs (--nproc-per-node 2 for 1 GPU): lower "
        "--nproc-per-node to 1, or expose 2 GPUs to each node (the job's GPU allocation, "
        "CUDA_VISIBLE_DEVICES)"
    )
    assert crashed.message.endswith("local rank 1 has no cuda:1")


def test_device_ordinal_from_the_global_rank_on_the_second_node() -> None:
    """Two nodes of four GPUs: rank 5 (local rank 1) asked for cuda:5. Here, and only here,
    set_device(local_rank) is the fix."""
    per_node = {"local_world_size": 4, "device_count": 4}
    state = state_of(
        *(
            rank(r, 8, local_rank=r % 4, node_rank=r // 4, host=f"node{r // 4}",
                 device=f"cuda:{r % 4}", device_index=r % 4, **per_node)
            for r in range(8)
        )
    )  # fmt: skip
    state.ranks[5] = rank(
        5, 8, local_rank=1, node_rank=1, host="node1", **per_node, **ORDINAL_CRASH
    )
    alerts = diagnose(state, NOW, TH)
    ordinal = only(alerts, "device_ordinal")
    assert ordinal.ranks == (5,)
    assert ordinal.message == (
        "rank 5 crashed with RuntimeError: CUDA error: invalid device ordinal — the global rank "
        "was used as the CUDA device index; host node1 has 4 GPUs"
    )
    assert ordinal.hint == (
        "use torch.cuda.set_device(local_rank) — LOCAL_RANK is 1 on this rank — not the global rank"
    )
    assert only(alerts, "crashed").hint.startswith("use torch.cuda.set_device(local_rank)")


def test_device_ordinal_fixes_per_case_when_ranks_differ() -> None:
    """Ranks in different cases get each case's fix with their ranks."""
    per_node = {"local_world_size": 2, "world": 4}
    state = state_of(
        rank(0, local_rank=0, device_count=0, **per_node, **ORDINAL_CRASH),
        rank(3, local_rank=1, node_rank=1, device_count=2, **per_node, **ORDINAL_CRASH),
    )
    hint = only(rule_device_ordinal(state, NOW, TH), "device_ordinal").hint
    assert hint == (
        f"rank 0: {NO_GPU_FIX}; rank 3: use torch.cuda.set_device(local_rank) — LOCAL_RANK is "
        "1 on this rank — not the global rank"
    )


def test_local_rank_mismatch() -> None:
    state = state_of(gpu(0, 0), gpu(1, 2), gpu(2, 1), gpu(3, 3))
    alert = only(diagnose(state, NOW, TH), "local_rank_mismatch")
    assert (alert.severity, alert.ranks) == ("warning", (1, 2))
    single = state_of(rank(1, device="cuda:0", device_index=0, device_count=1))
    assert rule_local_rank_mismatch(single, NOW, TH) == []


@pytest.mark.parametrize(
    ("used", "culprits"),
    [
        ((20, 10, 10, 10), (0,)),
        ((12, 10, 10, 10), ()),  # 1.2x: normal
        ((0.9, 0.3, 0.3, 0.3), ()),  # 3x but only 0.6 GiB apart
        ((20,), ()),  # one rank: nothing to compare
    ],
)
def test_uneven_memory(used: tuple[float, ...], culprits: tuple[int, ...]) -> None:
    state = state_of(*(rank(r, gpu_mem_used_bytes=int(g * GIB)) for r, g in enumerate(used)))
    alerts = rule_uneven_memory(state, NOW, TH)
    assert [a.ranks for a in alerts] == ([culprits] if culprits else [])
    if culprits:
        assert alerts[0].message == ("rank 0 uses 20.0 GiB of GPU memory, 2.0x the median 10.0 GiB")


def test_uneven_memory_falls_back_to_reserved() -> None:
    state = state_of(*(rank(r, mem_reserved_bytes=(30 if r == 2 else 8) * GIB) for r in range(4)))
    assert only(rule_uneven_memory(state, NOW, TH), "uneven_memory").ranks == (2,)


def test_uneven_memory_on_a_shared_gpu_compares_what_each_rank_reserved() -> None:
    """Two ranks on one GPU (gloo over CUDA tensors): NVML's used memory is the whole GPU's,
    the same for both, so rank 1's extra 10 GiB shows only in its allocator's reservation."""
    one_gpu = {"device": "cuda:0", "device_uuid": "GPU-1", "gpu_mem_used_bytes": 14 * GIB}
    state = state_of(
        rank(0, 2, mem_reserved_bytes=2 * GIB, **one_gpu),
        rank(1, 2, mem_reserved_bytes=12 * GIB, **one_gpu),
        rank(2, 2, mem_reserved_bytes=2 * GIB, **{**one_gpu, "device_uuid": "GPU-2"}),
    )
    assert only(rule_uneven_memory(state, NOW, TH), "uneven_memory").ranks == (1,)


def test_foreign_memory() -> None:
    state = state_of(
        gpu(0, 0, gpu_pids=[1000, 555]),
        gpu(1, 1, gpu_pids=[1001]),
        gpu(2, 2, gpu_pids=[1002, 1000]),  # rank 0 touching GPU 2 is not foreign
    )
    alert = only(rule_foreign_memory(state, NOW, TH), "foreign_memory")
    assert (alert.severity, alert.ranks) == ("warning", (0,))
    assert alert.message == (
        "the GPU of rank 0 (cuda:0 on node0) also holds process 555 that is not a rank of this job"
    )


def test_foreign_memory_quiet_when_pids_come_from_another_namespace() -> None:
    state = state_of(gpu(0, 0, gpu_pids=[91000]), gpu(1, 1, gpu_pids=[91001]))
    assert rule_foreign_memory(state, NOW, TH) == []
