"""The knowledge base of error signatures, against the texts torch, NCCL and gloo really print.

Texts marked "seen here" were produced on this machine with torch 2.13 (gloo, CPU);
the NCCL and CUDA ones are copied from real reports of those failures.
"""

from __future__ import annotations

import pytest

from ddpwatch.protocol import ErrorInfo
from ddpwatch.server.alerts import KINDS
from ddpwatch.server.knowledge import (
    SIGNATURES,
    TIMEOUT_NAMES,
    error_text,
    explain,
    explain_error,
    is_peer_failure,
)

GLOO_CLOSED = (  # seen here: a peer raised or was killed with SIGKILL
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:553] "
    "Connection closed by peer [127.0.0.1]:21198. This is typically caused by a remote worker "
    "crashing. Check the logs of the remote worker before reporting an error. GLHF!"
)
GLOO_RESET = (  # seen here: the peer aborted after a collective mismatch
    "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/pair.cc:537] "
    "Read error [127.0.0.1]:6302: Connection reset by peer. This is typically caused by a "
    "remote worker hanging or bugs in the application."
)
GLOO_MISMATCH = (  # seen here: std::terminate's what()
    "gloo::EnforceNotMet: [enforce fail at /__w/pytorch/pytorch/third_party/gloo/gloo/transport/"
    "tcp/pair.cc:456] op.preamble.length <= op.nbytes. 12 vs 4. Received data size doesn't "
    "match expected size. Is there a distributed collective mismatch in your code?"
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
    (
        "RuntimeError: Detected mismatch between collectives on ranks. Rank 0 is running "
        "collective: CollectiveFingerPrint(OpType=ALLREDUCE), but Rank 1 is running collective: "
        "CollectiveFingerPrint(OpType=BROADCAST).",
        "collective_mismatch",
        False,
    ),
    (
        "RuntimeError: Expected to have finished reduction in the prior iteration before "
        "starting a new one. This error indicates that your module has parameters that were not "
        "used in producing loss.",
        "ddp_unused_parameters",
        False,
    ),
    (
        "RuntimeError: Expected to mark a variable ready only once. This error is caused by ...",
        "ddp_ready_twice",
        False,
    ),
    (
        "RuntimeError: DDP expects same model across all ranks, but Rank 1 has 2 params, while "
        "rank 0 has inconsistent 4 params.",
        "ddp_model_mismatch",
        False,
    ),
    (NCCL_WATCHDOG, "nccl_timeout", False),
    (  # seen here
        "RuntimeError: [/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
        "unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete",
        "gloo_timeout",
        False,
    ),
    (  # seen here
        "RuntimeError: [Rank 0]: Rank 1 failed to pass monitoredBarrier in 2000 ms\n Original "
        "exception: \n[/__w/pytorch/pytorch/third_party/gloo/gloo/transport/tcp/"
        "unbound_buffer.cc:78] Timed out waiting 2000ms for recv operation to complete",
        "monitored_barrier",
        False,
    ),
    (  # seen here: rank 0 waited for the others in init_process_group
        "torch.distributed.DistStoreError: Timed out after 4 seconds waiting for clients. "
        "1/2 clients joined.",
        "store_clients_timeout",
        False,
    ),
    (  # seen here: nobody listens on MASTER_PORT
        "torch.distributed.DistNetworkError: The client socket has timed out after 3000ms while "
        "trying to connect to (127.0.0.1, 29545).",
        "rendezvous",
        False,
    ),
    ("torch.distributed.elastic.rendezvous.api.RendezvousTimeoutError: ", "rendezvous", False),
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
    assert is_peer_failure(text) is peer


def test_every_signature_has_a_real_text() -> None:
    named = {name for _, name, _ in CASES}
    assert named == {sig.name for sig in SIGNATURES}


def test_signatures_are_well_formed() -> None:
    names = [sig.name for sig in SIGNATURES]
    assert len(names) == len(set(names))
    assert TIMEOUT_NAMES.issubset(names)
    for sig in SIGNATURES:
        assert sig.cause and sig.hint
        assert sig.kind is None or sig.kind in KINDS
        assert not (sig.peer_failure and sig.kind)


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
    assert not is_peer_failure(text)


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (INVALID_ORDINAL, "device_ordinal"),
        (NCCL_DUPLICATE, "duplicate_device"),
        (GLOO_MISMATCH, "collective_mismatch"),
        (GLOO_CLOSED, None),
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
    assert explain(error_text(error)) is signature
    unknown = ErrorInfo(type="ValueError", message="boom", traceback=traceback)
    fallback = explain_error(unknown)
    assert fallback is not None and fallback.name == "rendezvous"


def test_error_text_format() -> None:
    assert error_text(ErrorInfo(type="ValueError", message="boom")) == "ValueError: boom"
    with_tb = ErrorInfo(type="ValueError", message="boom", traceback="tb")
    assert error_text(with_tb) == "ValueError: boom\ntb"
