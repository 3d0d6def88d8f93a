"""The knowledge base of error signatures, against the texts torch, NCCL and gloo really print.

Texts marked "seen here" were produced on this machine with torch 2.13 (gloo, CPU), most
with tests/scripts/error_texts.py (the scenario is named); the NCCL and CUDA ones are copied
from real reports of those failures. Each newer case names a public report of users
hitting the same text.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from conftest import SCRIPTS

from ddpwatch.core.ports import free_port_pair
from ddpwatch.core.protocol import ErrorInfo
from ddpwatch.core.vocabulary import ALERT_KINDS
from ddpwatch.diagnosis.knowledge import (
    FAMILIES,
    SIGNATURES,
    TIMEOUT_NAMES,
    clients_joined,
    explain,
    explain_error,
    named_ranks,
    reporting_rank,
)
from ddpwatch.jobs.stop import stop_job

JOB = SCRIPTS / "error_texts.py"
FORKED = SCRIPTS / "forked_ranks.py"

GLOO_CLOSED = (  # seen here: ranks 0 and 1 of all_gather_size, after rank 2 raised
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:2698. This is typically caused by a remote worker "
    "crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️"
)
GLOO_RESET = (  # seen here: ranks 1 and 2 of all_gather_like, when rank 0 was SIGABRTed
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
    "Read error [127.0.0.1]:59046: Connection reset by peer. This is typically caused by a "
    "remote worker hanging or bugs in the application. Check the logs of the remote worker "
    "before reporting an error. GLHF! 🏖️"
)
# seen here: all_gather_like (rank 2 passes 5 elements and sizes its outputs from them): rank
# 0, the next in gloo's ring, aborts from C++ (std::terminate, SIGABRT, no Python exception);
# only stderr has this what(). Reported: https://github.com/pytorch/gloo/pull/456 quotes users.
GLOO_MISMATCH = (
    "gloo::EnforceNotMet: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
    "tcp/pair.cc:456] op.preamble.length <= op.nbytes. 10 vs 8. Received data size doesn't "
    "match expected size. Is there a distributed collective mismatch in your code?"
)
# seen here: all_gather_size, on rank 2 only (it passes 5 elements into outputs of 4); ranks 0
# and 1 then get GLOO_CLOSED. Users hit it: https://github.com/pytorch/pytorch/pull/178844
# (fixes pytorch#178798, all_gather_into_tensor rejected with "invalid tensor size").
GLOO_INVALID_SIZE = (
    "RuntimeError: ProcessGroupGloo::allgather: invalid tensor size at index 0 "
    "(expected (5), got (4))"
)
# seen here: all_reduce_size with TORCH_DISTRIBUTED_DEBUG=DETAIL, rank 0 (rank 2 passes 5
# elements); every rank raises, none aborts. Users hit it:
# https://github.com/Lightning-AI/pytorch-lightning/issues/19106
DETAIL_SIZE = (
    "RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running "
    "collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], "
    "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, "
    "layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), "
    "memory_format=(nullopt))), but Rank 2 is running collective: CollectiveFingerPrint("
    "SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[5], TensorDtypes=Float, "
    "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided "
    "(default), requires_grad=false (default), pinned_memory=false (default), "
    "memory_format=(nullopt))).Collectives differ in the following aspects:   Tensor Tensor "
    "shapes: 4vs 5"
)
# seen here: the same job, rank 2 (the odd one) names rank 0
DETAIL_SIZE_ODD = (
    "RuntimeError: Detected mismatch between collectives on ranks. Rank 2 is running "
    "collective: CollectiveFingerPrint(SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[5], "
    "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, "
    "layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), "
    "memory_format=(nullopt))), but Rank 0 is running collective: CollectiveFingerPrint("
    "SequenceNumber=0, OpType=ALLREDUCE, TensorShape=[4], TensorDtypes=Float, "
    "TensorDeviceTypes=TensorOptions(dtype=float (default), device=cpu, layout=Strided "
    "(default), requires_grad=false (default), pinned_memory=false (default), "
    "memory_format=(nullopt))).Collectives differ in the following aspects:   Tensor Tensor "
    "shapes: 5vs 4"
)
# seen here: allreduce_vs_barrier with DETAIL, rank 1 (rank 2 calls all_reduce, 0 and 1 barrier).
# Users hit it: https://github.com/deepspeedai/DeepSpeed/issues/7568 ("but Rank 3 is running
# collective: CollectiveFingerPrint(SequenceNumber=0OpType=GATHER)")
DETAIL_OP = (
    "RuntimeError: Detected mismatch between collectives on ranks. Rank 1 is running "
    "collective: CollectiveFingerPrint(SequenceNumber=0OpType=BARRIER), but Rank 2 is running "
    "collective: CollectiveFingerPrint(SequenceNumber=0OpType=GATHER).Collectives differ in "
    "the following aspects:   Op type: BARRIERvs GATHER"
)
# torch < 2.0 named only the other rank: https://github.com/pytorch/pytorch/issues/78022
DETAIL_OLD = (
    "RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running "
    "inconsistent collective: CollectiveFingerPrint(OpType=BROADCAST, TensorShape=[34112], "
    "TensorDtypes=Float, TensorDeviceTypes=TensorOptions(dtype=float (default), device=cuda, "
    "layout=Strided (default), requires_grad=false (default), pinned_memory=false (default), "
    "memory_format=(nullopt))"
)
# NCCL's own check, from a PyTorch DDP job: https://github.com/NVIDIA/nccl/issues/296
NCCL_MISMATCHED = (
    "init.cc:1247 NCCL WARN Mismatched collective detected, please check your collective calls "
    "at and around rank 39. You can use NCCL_DEBUG=INFO and NCCL_DEBUG_SUBSYS=COLL to see the "
    "collective logs"
)
# NCCL's InfiniBand transport received more than posted: https://github.com/NVIDIA/nccl/issues/969
NCCL_IB_MISMATCH = (
    "transport/net_ib.cc:1038 NCCL WARN NET/IB : req 0/1 tag 0 peer 10.10.23.6<58683> "
    "collective mismatch error, local size 496640 remote size 65536"
)
# NCCL's own size check in all_gather_into_tensor, under DeepSpeed ZeRO-3:
# https://github.com/hiyouga/LlamaFactory/issues/9194 (the traceback runs through deepspeed)
NCCL_GATHER_SIZE = (
    "ValueError: output tensor size must be equal to world_size times input tensor size"
)
# seen here: ddp_unused (rank 1 skips a submodule in forward, find_unused_parameters=False):
# only rank 1 raises, at its next forward; ranks 0 and 2 get GLOO_CLOSED. Users hit it:
# https://github.com/pytorch/pytorch/issues/70099
DDP_UNUSED = (
    "RuntimeError: Expected to have finished reduction in the prior iteration before starting a "
    "new one. This error indicates that your module has parameters that were not used in "
    "producing loss. You can enable unused parameter detection by passing the keyword argument "
    "`find_unused_parameters=True` to `torch.nn.parallel.DistributedDataParallel`, and by \n"
    "making sure all `forward` function outputs participate in calculating loss. \n"
    "If you already have done the above, then the distributed data parallel module wasn't able "
    "to locate the output tensors in the return value of your module's `forward` function. "
    "Please include the loss function and the structure of the return value of `forward` of "
    "your module when reporting this issue (e.g. list, dict, iterable).\n"
    "Parameter indices which did not receive grad for rank 1: 2 3\n"
    " In addition, you can set the environment variable TORCH_DISTRIBUTED_DEBUG to either INFO "
    "or DETAIL to print out information about which particular parameters did not receive "
    "gradient on this rank as part of this error"
)
# seen here: the same with TORCH_DISTRIBUTED_DEBUG=INFO (DETAIL segfaults in DDP's constructor
# on torch 2.13 CPU/gloo, see the report); the tail of the message
DDP_UNUSED_INFO_TAIL = (
    "Parameters which did not receive grad for rank 1: extra.bias, extra.weight\n"
    "Parameter indices which did not receive grad for rank 1: 2 3"
)
# seen here: monitored_barrier_all (ranks 1 and 2 sleep past the 2 s timeout), rank 0.
# Users hit it: https://github.com/NVIDIA/nccl/issues/849 ("Ranks 4, 5, 6, 7 failed to pass")
MONITORED_ALL = "RuntimeError: [Rank 0]: Ranks 1, 2 failed to pass monitoredBarrier in 2000 ms"
# seen here: monitored_barrier (wait_all_ranks=False), rank 0
MONITORED_ONE = (
    "RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms\n Original "
    "exception: \n[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
    "unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete"
)
# seen here: monitored_barrier_one (only rank 2 is late), rank 1; users hit it:
# https://github.com/pytorch/pytorch/issues/121606
MONITORED_PEER = (
    "RuntimeError: Rank 1 successfully reached monitoredBarrier, but received errors while "
    "waiting for send/recv from rank 0. Please check rank 0 logs for faulty rank.\n Original "
    "exception: \n[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:34726. This is typically caused by a remote worker "
    "crashing. Check the logs of the remote worker before reporting an error. GLHF! 🏖️"
)
# seen here: ddp_model_mismatch (rank 1 has a layer fewer), rank 1; rank 0 and 2 name rank 1
DDP_MODEL = (
    "RuntimeError: DDP expects same model across all ranks, but Rank 1 has 2 params, while "
    "rank 0 has inconsistent 4 params."
)
# seen here: dataloader_killed (the worker SIGKILLs itself in __getitem__, num_workers=1).
# Users hit it: https://github.com/pytorch/pytorch/issues/8976
DATALOADER_KILLED = "RuntimeError: DataLoader worker (pid 12283) is killed by signal: Killed. "
# seen here: the same, when DataLoader's own liveness check sees the dead worker first (and
# always off the main thread, which has no SIGCHLD handler). Users hit it:
# https://github.com/pytorch/pytorch/issues/59438
DATALOADER_EXITED = "RuntimeError: DataLoader worker (pid(s) 13458) exited unexpectedly"
# seen here: the same, with DIE=BUS. Users hit it: https://github.com/pytorch/pytorch/issues/108861
DATALOADER_BUS = (
    "RuntimeError: DataLoader worker (pid 13505) is killed by signal: Bus error. It is possible "
    "that dataloader's workers are out of shared memory. Please try to raise your shared "
    "memory limit."
)
# seen here: dataloader_timeout (DataLoader(timeout=1), a 5 s __getitem__). Users hit it:
# https://github.com/pytorch/pytorch/issues/68643
DATALOADER_TIMEOUT = "RuntimeError: DataLoader timed out after 1 seconds"
# seen here: dataloader_killed, 2 runs in 6: the read of the dead worker's batch fails before
# DataLoader's checks name the worker. The frames from DataLoader down, as the agent records
# them. Lightning's maintainers on the same text: "Connection reset by peer means the dataloader
# worker was killed by something externally":
# https://github.com/Lightning-AI/pytorch-lightning/issues/19302
DATALOADER_RESET_TRACEBACK = (
    "Traceback (most recent call last):\n"
    '  File "/work/main/.venv/lib/python3.11/site-packages/torch/utils/data/dataloader.py", '
    "line 1291, in _try_get_data\n"
    "    data = self._data_queue.get(timeout=timeout)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/queues.py", line 122, '
    "in get\n"
    "    return _ForkingPickler.loads(res)\n"
    "           ^^^^^^^^^^^^^^^^^^^^^^^^^^\n"
    '  File "/root/.pyenv/versions/3.11.7/lib/python3.11/multiprocessing/connection.py", '
    "line 395, in _recv\n"
    "    chunk = read(handle, remaining)\n"
    "            ^^^^^^^^^^^^^^^^^^^^^^^\n"
    "ConnectionResetError: [Errno 104] Connection reset by peer\n"
)
# seen here: missing_rank_tcp (2 processes, world_size=3, rank 0 hosts the store), rank 0.
# Users hit it: https://github.com/vllm-project/vllm/issues/17056 ("1/4 clients joined"); no
# PyTorch, Lightning, DeepSpeed or Accelerate report found
STORE_CLIENTS = (
    "torch.distributed.DistStoreError: Timed out after 5 seconds waiting for clients. "
    "2/3 clients joined."
)
# seen here: missing_rank (torchrun starts 2, the script says 3: torchrun's agent hosts the
# store), ranks 0 and 1; the same run's rank 1 of missing_rank_tcp waits for "/0". Users hit it:
# https://github.com/vllm-project/vllm/issues/12526
STORE_WAIT = (
    "torch.distributed.DistStoreError: wait timeout after 4000ms, keys: /default_pg/0//cpu//0/2"
)
NCCL_REMOTE = (
    "torch.distributed.DistBackendError: NCCL error in: /pytorch/torch/csrc/distributed/c10d/"
    "NCCLUtils.hpp:268, remote process exited or there was a network error, NCCL version 2.21.5\n"
    "ncclRemoteError: A call failed possibly due to a network error or a remote process exiting "
    "prematurely.\nLast error:\nsocketProgressOpt: Call to recv from 10.0.0.2<33759> failed : "
    "Connection reset by peer"
)
NCCL_REMOTE_WITH_TIMEOUT_LINE = (
    "RuntimeError: [E ProcessGroupNCCL.cpp:455] Some NCCL operations have failed or timed out. "
    "Due to the asynchronous nature of CUDA kernels, subsequent GPU operations might run on "
    "corrupted/incomplete data.\nNCCL error: remote process exited or there was a network error, "
    "NCCL version 2.14.3"
)
NCCL_DUPLICATE = (
    "torch.distributed.DistBackendError: NCCL error in: ../torch/csrc/distributed/c10d/"
    "ProcessGroupNCCL.cpp:1691, invalid usage (run with NCCL_DEBUG=WARN for details), NCCL "
    "version 2.19.3\nncclInvalidUsage: This usually reflects invalid usage of NCCL library.\n"
    "Last error:\nDuplicate GPU detected : rank 1 and rank 0 both on CUDA device 2000"
)
NCCL_WATCHDOG = (
    "RuntimeError: [Rank 1] Watchdog caught collective operation timeout: WorkNCCL(SeqNum=808, "
    "OpType=ALLREDUCE, NumelIn=9801523, NumelOut=9801523, Timeout(ms)=600000) ran for 600020 "
    "milliseconds before timing out."
)
INVALID_ORDINAL = (
    "RuntimeError: CUDA error: invalid device ordinal\nCUDA kernel errors might be "
    "asynchronously reported at some other API call, so the stacktrace below might be "
    "incorrect.\nFor debugging consider passing CUDA_LAUNCH_BLOCKING=1."
)

CASES = [
    # (text, signature name, peer failure)
    (GLOO_CLOSED, "connection_closed", True),
    (GLOO_RESET, "connection_reset", True),
    (  # seen here: rank 0 of all_gather_like with SIZE=3, when rank 2 was SIGABRTed
        "RuntimeError: Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/"
        "gloo/transport/tcp/pair.cc:553] Connection closed by peer [127.0.0.1]:2222. This is "
        "typically caused by a remote worker crashing. Check the logs of the remote worker "
        "before reporting an error. GLHF! 🏖️",
        "connection_closed",
        True,
    ),
    (
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:598] Write error "
        "[10.0.0.3]:41234: Broken pipe",
        "gloo_broken_pipe",
        True,
    ),
    (NCCL_REMOTE, "nccl_remote_error", True),
    (NCCL_REMOTE_WITH_TIMEOUT_LINE, "nccl_remote_error", True),
    (
        "torch.distributed.DistBackendError: NCCL communicator was aborted on rank 3.",
        "nccl_aborted",
        True,
    ),
    (
        "torch.distributed.DistNetworkError: Failed to recv, got 0 bytes. Connection was likely "
        "closed. Did the remote server shutdown or crash?",
        "store_closed",
        True,
    ),
    (INVALID_ORDINAL, "invalid_device_ordinal", False),
    ("torch.AcceleratorError: CUDA error: invalid device ordinal", "invalid_device_ordinal", False),
    (NCCL_DUPLICATE, "duplicate_gpu", False),
    (  # seen here
        "torch.distributed.DistNetworkError: The server socket has failed to listen on any local "
        "network address. port: 29544, useIpv6: false, code: -98, name: EADDRINUSE, message: "
        "address already in use",
        "address_in_use",
        False,
    ),
    ("RuntimeError: Address already in use", "address_in_use", False),
    (
        "torch.OutOfMemoryError: CUDA out of memory. Tried to allocate 2.00 GiB. GPU 0 has a "
        "total capacity of 79.15 GiB of which 1.06 GiB is free.",
        "cuda_oom",
        False,
    ),
    (GLOO_MISMATCH, "collective_mismatch", False),
    (DETAIL_SIZE, "collective_mismatch", False),
    (DETAIL_SIZE_ODD, "collective_mismatch", False),
    (DETAIL_OP, "collective_mismatch", False),
    (DETAIL_OLD, "collective_mismatch", False),
    (NCCL_MISMATCHED, "collective_mismatch", False),
    (GLOO_INVALID_SIZE, "collective_size_mismatch", False),
    (NCCL_GATHER_SIZE, "collective_size_mismatch", False),
    (  # NCCL's size check in reduce_scatter_tensor: https://github.com/intel/torch-xpu-ops/issues/2738
        "ValueError: input tensor must be the same size as output size times world size",
        "collective_size_mismatch",
        False,
    ),
    (NCCL_IB_MISMATCH, "nccl_net_size_mismatch", False),
    (  # from a PyTorch job: https://github.com/NVIDIA/nccl/issues/615
        "transport/net_ib.cc:665 NCCL WARN NET/IB : collective mismatch error local size 546816 "
        "remote 524288 addr 7ff7d1530000 rkey 2553d seq 14/1c",
        "nccl_net_size_mismatch",
        False,
    ),
    (DDP_UNUSED, "ddp_unused_parameters", False),
    (
        "RuntimeError: Expected to mark a variable ready only once. This error is caused by ...",
        "ddp_ready_twice",
        False,
    ),
    (DDP_MODEL, "ddp_model_mismatch", False),
    (NCCL_WATCHDOG, "nccl_timeout", False),
    (  # seen here
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
        "unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete",
        "gloo_timeout",
        False,
    ),
    (  # seen here: torchrun --max-restarts 1, the second attempt's init_process_group
        "RuntimeError: Gloo connectFullMesh failed with [/__w/pytorch/pytorch/third_party/gloo/"
        "gloo/transport/tcp/pair.cc:152] timed out connecting: SO_ERROR: Connection refused, "
        "remote=[127.0.0.1]:39329",
        "gloo_connect",
        False,
    ),
    (MONITORED_ONE, "monitored_barrier", False),
    (MONITORED_ALL, "monitored_barrier", False),
    (MONITORED_PEER, "monitored_barrier_peer", True),
    (STORE_CLIENTS, "store_clients_timeout", False),
    (  # torch 2.2's wording: https://github.com/pytorch/pytorch/pull/111805
        "torch.distributed.DistStoreError: Timed out after 6 seconds waiting for workers. "
        "1/2 workers joined.",
        "store_clients_timeout",
        False,
    ),
    (  # torch < 2.0: https://github.com/Lightning-AI/pytorch-lightning/issues/4420 (its logs)
        "RuntimeError: Timed out initializing process group in store based barrier on rank: 4, "
        "for key: store_based_barrier_key:1 (world_size=8, worker_count=7, timeout=0:30:00)",
        "store_clients_timeout",
        False,
    ),
    (STORE_WAIT, "store_wait_timeout", False),
    (DATALOADER_KILLED, "dataloader_worker_died", False),
    (DATALOADER_EXITED, "dataloader_worker_died", False),
    (  # seen here: dataloader_killed with DIE=EXIT (the worker calls os._exit(3))
        "RuntimeError: DataLoader worker (pid 13582) exited unexpectedly with exit code 3. "
        "Details are lost due to multiprocessing. Rerunning with num_workers=0 may give better "
        "error trace.",
        "dataloader_worker_died",
        False,
    ),
    (DATALOADER_BUS, "dataloader_shm", False),
    (DATALOADER_TIMEOUT, "dataloader_timeout", False),
    (  # seen here: nobody listens on MASTER_PORT
        "torch.distributed.DistNetworkError: The client socket has timed out after 3000ms while "
        "trying to connect to (127.0.0.1, 29545).",
        "rendezvous",
        False,
    ),
    (  # seen here: torchrun --nnodes 2 with one node started, --rdzv-conf join_timeout=5 (the
        # launcher raises it, with no message); users hit it (same empty message):
        # https://github.com/facebookresearch/av_hubert/issues/19
        "torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: ",
        "rendezvous_timeout",
        False,
    ),
    ("ConnectionRefusedError: [Errno 111] Connection refused", "rendezvous", False),
    (
        "torch.distributed.DistNetworkError: The client socket has failed to connect to any "
        "network address of (node-0, 29500).",
        "rendezvous",
        False,
    ),
    ("RuntimeError: No CUDA GPUs are available", "no_cuda_gpus", False),
    ("ValueError: Tensors must be CUDA and dense", "nccl_cpu_tensor", False),
    (
        "RuntimeError: CUDA error: device-side assert triggered\nCompile with "
        "`TORCH_USE_CUDA_DSA` to enable device-side assertions.",
        "device_side_assert",
        False,
    ),
    (
        "RuntimeError: CUDA error: an illegal memory access was encountered",
        "illegal_memory_access",
        False,
    ),
    (
        "ValueError: Default process group has not been initialized, please make sure to call "
        "init_process_group.",
        "pg_not_initialized",
        False,
    ),
    (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1970, unhandled "
        "system error (run with NCCL_DEBUG=INFO for details), NCCL version 2.21.5",
        "nccl_system_error",
        False,
    ),
    (
        "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:2006, internal "
        "error - please report this issue to the NCCL developers, NCCL version 2.21.5\n"
        "ncclInternalError: Internal check failed.",
        "nccl_error",
        False,
    ),
]


@pytest.mark.parametrize(("text", "name", "peer"), CASES, ids=[c[1] for c in CASES])
def test_explain_real_texts(text: str, name: str, peer: bool) -> None:
    signature = explain(text)
    assert signature is not None
    assert signature.name == name
    assert signature.peer_failure is peer


def test_every_signature_has_a_real_text() -> None:
    named = {name for _, name, _ in CASES}
    assert named == {sig.name for sig in SIGNATURES}


def test_signatures_are_well_formed() -> None:
    names = [sig.name for sig in SIGNATURES]
    assert len(names) == len(set(names))
    assert TIMEOUT_NAMES.issubset(names)
    for sig in SIGNATURES:
        assert sig.cause and sig.hint
        assert sig.kind is None or sig.kind in ALERT_KINDS
        assert not (sig.peer_failure and sig.kind)
        assert sig.family in FAMILIES
        assert sig.peer_failure is (sig.family == "peer_failure")
        assert (sig.name in TIMEOUT_NAMES) is (sig.family == "timeout")


@pytest.mark.parametrize(
    "text",
    [
        "",
        "ValueError: boom",
        "KeyError: 'label'",
        "BrokenPipeError: [Errno 32] Broken pipe",  # a closed stdout pipe, not a dead peer
        "RuntimeError: shape '[16, 64]' is invalid for input of size 100",
    ],
)
def test_unknown_texts(text: str) -> None:
    assert explain(text) is None


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (INVALID_ORDINAL, "device_ordinal"),
        (NCCL_DUPLICATE, "duplicate_device"),
        (GLOO_MISMATCH, "collective_mismatch"),
        (GLOO_INVALID_SIZE, "collective_mismatch"),
        (DETAIL_OP, "collective_mismatch"),
        (NCCL_MISMATCHED, "collective_mismatch"),
        (NCCL_IB_MISMATCH, "collective_mismatch"),
        (NCCL_GATHER_SIZE, "collective_mismatch"),
        (GLOO_CLOSED, None),
        (DATALOADER_KILLED, None),
    ],
)
def test_kinds(text: str, kind: str | None) -> None:
    signature = explain(text)
    assert signature is not None and signature.kind == kind


def test_hints_name_the_fix() -> None:
    assert "set_device(local_rank)" in (explain(INVALID_ORDINAL) or SIGNATURES[0]).hint
    assert "LOCAL_RANK" in (explain(INVALID_ORDINAL) or SIGNATURES[0]).hint
    assert "global rank" in (explain(INVALID_ORDINAL) or SIGNATURES[0]).cause
    duplicate = explain(NCCL_DUPLICATE)
    assert duplicate is not None and "CUDA_VISIBLE_DEVICES" in duplicate.hint
    port = explain("RuntimeError: Address already in use")
    assert port is not None and "MASTER_PORT" in port.hint and "MASTER_PORT" in port.cause
    unused = explain(
        "RuntimeError: Expected to have finished reduction in the prior iteration before "
        "starting a new one."
    )
    assert unused is not None and "find_unused_parameters=True" in unused.hint


def test_explain_error_prefers_the_message_over_the_traceback() -> None:
    traceback = (
        "Traceback (most recent call last):\n"
        '  File "train.py", line 9, in <module>\n'
        '    if "Connection refused" in str(err):\n'
    )
    error = ErrorInfo(
        type="RuntimeError", message=GLOO_CLOSED.split(": ", 1)[1], traceback=traceback
    )
    signature = explain_error(error)
    assert signature is not None and signature.name == "connection_closed"
    assert explain(f"{error.type}: {error.message}\n{error.traceback}") is signature
    unknown = ErrorInfo(type="ValueError", message="boom", traceback=traceback)
    fallback = explain_error(unknown)
    assert fallback is not None and fallback.name == "rendezvous"


MISMATCH_TEXTS = [
    GLOO_MISMATCH,
    GLOO_INVALID_SIZE,
    DETAIL_SIZE,
    DETAIL_SIZE_ODD,
    DETAIL_OP,
    DETAIL_OLD,
    NCCL_MISMATCHED,
    NCCL_IB_MISMATCH,
    NCCL_GATHER_SIZE,
]


@pytest.mark.parametrize("text", MISMATCH_TEXTS)
def test_every_mismatch_text_is_a_mismatch_not_a_peer_failure(text: str) -> None:
    signature = explain(text)
    assert signature is not None
    assert signature.kind == "collective_mismatch" and signature.family == "collective_mismatch"
    assert not signature.peer_failure


@pytest.mark.parametrize(
    "text",
    [DATALOADER_KILLED, DATALOADER_EXITED, DATALOADER_BUS, DATALOADER_TIMEOUT],
)
def test_data_loading_texts_say_data_loading(text: str) -> None:
    signature = explain(text)
    assert signature is not None
    assert signature.family == "data_loading" and signature.kind is None
    assert signature.cause.startswith("data loading: ")
    assert not signature.peer_failure


def test_a_dead_dataloader_worker_is_not_a_dead_peer() -> None:
    died = explain(DATALOADER_KILLED)
    assert died is not None
    assert died.cause == (
        "data loading: a DataLoader worker died (often the OOM killer or /dev/shm too small "
        "in a container)"
    )
    assert "dmesg" in died.hint and "--shm-size" in died.hint and "num_workers=0" in died.hint
    # the SIGCHLD handler's error, raised while handling the read's reset (seen here): the
    # chained "Connection reset by peer" must not make it a peer failure
    chained = ErrorInfo(
        type="RuntimeError",
        message=DATALOADER_KILLED.split(": ", 1)[1],
        traceback=DATALOADER_RESET_TRACEBACK
        + "\nDuring handling of the above exception, another exception occurred:\n\n"
        + DATALOADER_KILLED
        + "\n",
    )
    assert explain_error(chained) is died
    assert explain(f"{chained.type}: {chained.message}\n{chained.traceback}") is died
    # the bare reset, when the read fails before DataLoader names the worker (seen here)
    reset = ErrorInfo(
        type="ConnectionResetError",
        message="[Errno 104] Connection reset by peer",
        traceback=DATALOADER_RESET_TRACEBACK,
    )
    assert explain_error(reset) is died
    # the same reset from a collective stays a peer failure
    collective = ErrorInfo(type="RuntimeError", message=GLOO_RESET.split(": ", 1)[1])
    signature = explain_error(collective)
    assert signature is not None and signature.name == "connection_reset"


@pytest.mark.parametrize(
    ("text", "name"),
    [
        # ncclInvalidUsage's generic text around a specific cause
        (NCCL_DUPLICATE, "duplicate_gpu"),
        (
            "torch.distributed.DistBackendError: NCCL error in: ProcessGroupNCCL.cpp:1691, invalid "
            "usage (run with NCCL_DEBUG=WARN for details), NCCL version 2.21.5\nncclInvalidUsage: "
            "This usually reflects invalid usage of NCCL library.\nLast error:\n"
            + NCCL_IB_MISMATCH,
            "nccl_net_size_mismatch",
        ),
        # the monitored barrier's own gloo timeout is its detail, not the cause
        (MONITORED_ONE, "monitored_barrier"),
        # a rank that passed the barrier quotes the connection rank 0 closed: a peer failure
        (MONITORED_PEER, "monitored_barrier_peer"),
        # DataLoader's error quoting its queue's "Connection reset by peer"
        (DATALOADER_KILLED + "\n" + DATALOADER_RESET_TRACEBACK, "dataloader_worker_died"),
        (DATALOADER_BUS + "\n" + DATALOADER_RESET_TRACEBACK, "dataloader_shm"),
        # DDP's unused-parameter text mentions nothing generic, but must not read as a timeout
        (DDP_UNUSED, "ddp_unused_parameters"),
    ],
)
def test_the_specific_text_wins_over_the_generic_one(text: str, name: str) -> None:
    signature = explain(text)
    assert signature is not None and signature.name == name


@pytest.mark.parametrize(
    "text",
    [
        GLOO_CLOSED,
        GLOO_RESET,
        "RuntimeError: Connection reset by peer",
        "RuntimeError: [../third_party/gloo/gloo/transport/tcp/pair.cc:589] Read error "
        "[10.0.0.2]:41952: Connection reset by peer",
    ],
)
def test_connection_closed_and_reset_stay_peer_failures(text: str) -> None:
    signature = explain(text)
    assert signature is not None and signature.peer_failure and signature.kind is None


def test_a_source_line_passing_timeout_is_not_a_gloo_timeout() -> None:
    traceback = (
        '  File "torch/distributed/distributed_c10d.py", line 1840, in _new_process_group_helper\n'
        "    backend_class = ProcessGroupGloo(store, rank, world_size, timeout=timeout)\n"
    )
    assert explain(traceback) is None
    error = ErrorInfo(
        type="DistStoreError", message=STORE_WAIT.split(": ", 1)[1], traceback=traceback
    )
    signature = explain_error(error)
    assert signature is not None and signature.name == "store_wait_timeout"


def _error(text: str, traceback: str = "") -> ErrorInfo:
    type_, _, message = text.partition(": ")
    return ErrorInfo(type=type_, message=message, traceback=traceback)


@pytest.mark.parametrize(
    ("text", "named", "reporter"),
    [
        (DDP_UNUSED, (1,), None),
        (
            "RuntimeError: Expected to have finished reduction ...\n" + DDP_UNUSED_INFO_TAIL,
            (1,),
            None,
        ),
        (MONITORED_ONE, (1,), 0),
        (MONITORED_ALL, (1, 2), 0),
        (  # https://github.com/NVIDIA/nccl/issues/849
            "RuntimeError: [Rank 0]: Ranks 4, 5, 6, 7 failed to pass monitoredBarrier in 2000000 ms",
            (4, 5, 6, 7),
            0,
        ),
        # rank 1 passed; "check rank 0 logs" blames nobody
        (MONITORED_PEER, (), 1),
        # DETAIL: the majority names the odd rank, the odd rank names rank 0
        (DETAIL_SIZE, (2,), 0),
        (DETAIL_SIZE_ODD, (0,), 2),
        (DETAIL_OP, (2,), 1),
        (DETAIL_OLD, (0,), None),
        (DDP_MODEL, (0,), 1),
        (  # seen here: ddp_model_mismatch, rank 2 (the majority names the odd rank 1)
            "RuntimeError: DDP expects same model across all ranks, but Rank 2 has 4 params, "
            "while rank 1 has inconsistent 2 params.",
            (1,),
            2,
        ),
        (NCCL_DUPLICATE, (0, 1), None),
        (NCCL_MISMATCHED, (39,), None),
        (NCCL_WATCHDOG, (), 1),
        (  # torch >= 2.2's watchdog prefix; https://github.com/pytorch/pytorch/issues/121606 era
            "RuntimeError: [PG ID 0 PG GUID 0(default_pg) Rank 3] Process group watchdog thread "
            "terminated with exception: [Rank 3] Watchdog caught collective operation timeout: "
            "WorkNCCL(SeqNum=5, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=600000) ran "
            "for 600015 milliseconds before timing out.",
            (),
            3,
        ),
        (  # https://github.com/Lightning-AI/pytorch-lightning/issues/4420 (its logs)
            "RuntimeError: Timed out initializing process group in store based barrier on rank: 4, "
            "for key: store_based_barrier_key:1 (world_size=8, worker_count=7, timeout=0:30:00)",
            (),
            4,
        ),
        ("torch.distributed.DistBackendError: NCCL communicator was aborted on rank 3.", (), 3),
        (GLOO_CLOSED, (), None),
        (GLOO_INVALID_SIZE, (), None),
        (STORE_CLIENTS, (), None),
        (DATALOADER_KILLED, (), None),
        ("ValueError: rank 1 got a bad batch", (), None),
    ],
)
def test_ranks_named_in_error_texts(
    text: str, named: tuple[int, ...], reporter: int | None
) -> None:
    error = _error(text)
    assert named_ranks(error) == named
    assert reporting_rank(error) == reporter


def test_ranks_come_from_the_message_before_the_traceback() -> None:
    # a wrapper re-raised rank 0's monitored-barrier error: only its traceback names the ranks
    wrapped = _error("RuntimeError: barrier failed", "Traceback ...\n" + MONITORED_ALL + "\n")
    assert named_ranks(wrapped) == (1, 2)
    assert reporting_rank(wrapped) == 0
    # the message's own ranks win over a chained error's
    own = _error(DETAIL_SIZE, "Traceback ...\n" + MONITORED_ALL + "\n")
    assert named_ranks(own) == (2,)
    assert reporting_rank(own) == 0


@pytest.mark.parametrize(
    ("text", "joined"),
    [
        (STORE_CLIENTS, (2, 3)),
        (  # https://github.com/OpenRLHF/OpenRLHF/issues/1040
            "torch.distributed.DistStoreError: Timed out after 1801 seconds waiting for clients. "
            "1/3 clients joined.",
            (1, 3),
        ),
        (  # torch 2.2's wording: https://github.com/pytorch/pytorch/pull/111805
            "torch.distributed.DistStoreError: Timed out after 6 seconds waiting for workers. "
            "1/2 workers joined.",
            (1, 2),
        ),
        (  # torch < 2.0: https://github.com/Lightning-AI/pytorch-lightning/issues/4420
            "RuntimeError: Timed out initializing process group in store based barrier on rank: 4, "
            "for key: store_based_barrier_key:1 (world_size=8, worker_count=7, timeout=0:30:00)",
            (7, 8),
        ),
        (  # two jobs on one MASTER_PORT: https://github.com/ultralytics/yolov5/issues/4574
            "RuntimeError: Timed out initializing process group in store based barrier on rank: 0, "
            "for key: store_based_barrier_key:1 (world_size=4, worker_count=8, timeout=0:30:00)",
            (8, 4),
        ),
        (STORE_WAIT, None),
        (MONITORED_ALL, None),
        ("RuntimeError: 2/3 of the data is missing", None),
    ],
)
def test_clients_joined(text: str, joined: tuple[int, int] | None) -> None:
    assert clients_joined(_error(text)) == joined


# ---------------------------------------------------------------- the texts of this torch build


def _run_jobs(jobs: dict[str, tuple[str, int, dict[str, str] | None]], out: Path) -> dict:
    """Run tests/scripts/error_texts.py once per job (its scenario, ranks, environment), every
    rank as torchrun starts it but forked after one torch import (tests/scripts/forked_ranks.py);
    each job's CAUGHT records, by rank."""
    spec = [
        {"name": key, "args": [scenario], "nproc": nproc, "env": env or {}}
        for key, (scenario, nproc, env) in jobs.items()
    ]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    command = [sys.executable, str(FORKED), str(JOB), str(out), json.dumps(spec)]
    launcher = subprocess.Popen(command, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        output, _ = launcher.communicate(timeout=120)
    finally:
        stop_job(launcher, grace=1.0)  # and every rank it forked
    assert launcher.returncode == 0, output.decode(errors="replace")[-4000:]
    caught: dict[str, dict[int, dict]] = {}
    for key, (_, nproc, _) in jobs.items():
        texts = "".join((out / f"{key}.{rank}").read_text() for rank in range(nproc))
        caught[key] = {record["rank"]: record for record in _records(texts)}
    return caught


def _rank_output(out: Path, key: str, rank: int) -> str:
    """What rank ``rank`` of job ``key`` printed, for a failure's message: a missing record
    says why only there (a store that never bound, a SIGTERM after another rank failed)."""
    tails = []
    for suffix in ("", ".err"):
        path = out / f"{key}.{rank}{suffix}"
        text = path.read_text(errors="replace") if path.exists() else "(no file)"
        tails.append(f"--- {path.name}\n{text[-3000:]}")
    return f"no CAUGHT record from rank {rank} of {key!r}\n" + "\n".join(tails)


def _records(output: str) -> list[dict]:
    """Every ``CAUGHT {json}`` record in the output, wherever the line breaks fell."""
    decoder = json.JSONDecoder()
    records = []
    for chunk in output.split("CAUGHT ")[1:]:
        try:
            records.append(decoder.raw_decode(chunk)[0])
        except json.JSONDecodeError:
            continue
    return records


def _as_error(record: dict) -> ErrorInfo:
    return ErrorInfo(type=record["type"], message=record["message"], traceback=record["traceback"])


@pytest.mark.e2e
def test_the_texts_torch_prints_today_are_known(tmp_path: Path) -> None:
    """Reproduce the failures and read what the ranks really raise: if a torch upgrade
    rewords one, this fails before diagnosis quietly stops recognising it."""
    detail = {"TORCH_DISTRIBUTED_DEBUG": "DETAIL"}
    jobs = {
        "size": ("all_gather_size", 3, None),
        "detail": ("allreduce_vs_broadcast", 3, detail),
        "barrier": ("monitored_barrier_all", 3, None),
        "unused": ("ddp_unused", 3, None),
        "model": ("ddp_model_mismatch", 3, None),
        "loader": ("dataloader_timeout", 1, None),
    }
    caught = _run_jobs(jobs, tmp_path)

    def reading(key: str, rank: int) -> tuple[str | None, tuple[int, ...], int | None]:
        assert rank in caught[key], _rank_output(tmp_path, key, rank)
        error = _as_error(caught[key][rank])
        signature = explain_error(error)
        return (signature.name if signature else None), named_ranks(error), reporting_rank(error)

    # rank 2 passed 5 elements: it raises; the others lose their connection to it
    assert reading("size", 2) == ("collective_size_mismatch", (), None)
    assert {reading("size", r)[0] for r in (0, 1) if r in caught["size"]} <= {
        "connection_closed",
        "connection_reset",
    }
    # DETAIL: every rank raises at once; ranks 0 and 1 name rank 2, rank 2 names rank 0
    assert reading("detail", 0) == ("collective_mismatch", (2,), 0)
    assert reading("detail", 1) == ("collective_mismatch", (2,), 1)
    assert reading("detail", 2) == ("collective_mismatch", (0,), 2)
    assert reading("barrier", 0) == ("monitored_barrier", (1, 2), 0)
    assert reading("unused", 1) == ("ddp_unused_parameters", (1,), None)
    assert reading("model", 0) == ("ddp_model_mismatch", (1,), 0)
    assert reading("model", 2) == ("ddp_model_mismatch", (1,), 2)
    assert reading("model", 1) == ("ddp_model_mismatch", (0,), 1)
    assert reading("loader", 0) == ("dataloader_timeout", (), None)


@pytest.mark.e2e
def test_a_missing_rank_is_counted() -> None:
    """Two processes of a world of three, rank 0 hosting the store: it counts who came."""
    port = str(free_port_pair())
    env = {**os.environ, "TCP_PORT": port, "OMP_NUM_THREADS": "1"}
    # the store's host waits longer than its client: under load a host that gave up first
    # closed the store under the client, which then read "store closed" (a peer failure)
    timeouts = {0: "8", 1: "3"}
    procs = [
        subprocess.Popen(
            [sys.executable, str(JOB), "missing_rank_tcp"],
            env={**env, "RANK": str(rank), "INIT_TIMEOUT": timeouts[rank]},
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
            text=True,
        )
        for rank in (0, 1)
    ]
    outputs = [proc.communicate(timeout=120)[0] for proc in procs]
    records = [record for out in outputs for record in _records(out)]
    by_rank = {record["rank"]: _as_error(record) for record in records}
    host = explain_error(by_rank[0])
    assert host is not None and host.name == "store_clients_timeout"
    assert clients_joined(by_rank[0]) == (2, 3)
    client = explain_error(by_rank[1])
    assert client is not None and client.name == "store_wait_timeout"
    assert clients_joined(by_rank[1]) is None
